"""The dashboard never writes to the run store: it refuses a mistyped or empty --db without creating
anything, opens a write-protected store in a read-only folder, and answers 503 once the store is gone."""

from __future__ import annotations

import hashlib
import html
import os
import pickle
import select
import shutil
import signal
import sqlite3
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
from sqlalchemy.exc import OperationalError
from typer.testing import CliRunner

from tests.conftest import LOOPBACK_URL

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette's note about httpx vs httpx2
    from fastapi.testclient import TestClient

from dashboard_data import fill_realistic_run

from common.cli.app import app as cli
from server.dashboard.app import create_app
from server.store.engine import StoreUnavailable
from server.store.run_store import RunStore

NOBODY = 65534


def make_store(path: Path, run_id: str = "run-a") -> Path:
    """A run store written the way the server writes it (WAL mode), then closed."""
    with RunStore(str(path)) as writer:
        fill_realistic_run(writer, run_id, rounds=3, run_dir=path.parent)
    return path


def listing(folder: Path) -> dict[str, str]:
    """Every file under `folder` with the sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def read_pages(db: Path) -> dict[str, Any]:
    """What a dashboard over `db` answers: statuses, run ids, round numbers, checkpoint digest."""
    client = TestClient(create_app(str(db)), base_url=LOOPBACK_URL)
    responses = {
        path: client.get(path)
        for path in ("/api/runs", "/api/runs/run-a/rounds", "/runs/run-a", "/runs/run-a/checkpoint")
    }
    return {
        "status": {path: r.status_code for path, r in responses.items()},
        "runs": [run["run_id"] for run in responses["/api/runs"].json()],
        "rounds": [r["round"] for r in responses["/api/runs/run-a/rounds"].json()],
        "checkpoint": responses["/runs/run-a/checkpoint"].headers.get("x-checkpoint-sha256"),
    }


def as_unprivileged(fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    """fn() in a forked child running as `nobody` when this is root (root ignores file modes, so a
    read-only folder would prove nothing); its result, or its exception, comes back pickled."""
    if os.geteuid() != 0:
        return fn()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read_end)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result: Any = ("ok", fn())
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            result = ("error", f"{type(exc).__name__}: {exc}")
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(pickle.dumps(result))
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        ready, _, _ = select.select([pipe], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        data = pipe.read() if ready else b""
    os.waitpid(pid, 0)
    assert data, f"the unprivileged child gave no answer within {timeout:.0f} s"
    kind, value = pickle.loads(data)
    assert kind == "ok", value
    return value


@pytest.mark.parametrize("form", ["path", "url", "env"])
def test_mistyped_db_path_is_refused_and_creates_nothing(tmp_path, monkeypatch, form):
    missing = tmp_path / "no" / "such" / "fedla.db"
    db = {"path": str(missing), "url": f"sqlite:///{missing}", "env": None}[form]
    monkeypatch.setenv("FEDLA_DB", str(missing))
    with pytest.raises(StoreUnavailable) as info:
        create_app(db)
    assert "\n" not in str(info.value) and f"no run store at {missing}" in str(info.value)
    result = CliRunner().invoke(cli, ["dashboard"] + (["--db", db] if db else []))
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"error: {info.value}"]
    assert list(tmp_path.iterdir()) == []  # no folder, no database file


def test_empty_file_gets_no_schema(tmp_path):
    empty = tmp_path / "fedla.db"
    empty.touch()
    with pytest.raises(StoreUnavailable, match="is an empty file, not a run store"):
        create_app(str(empty))
    assert [p.name for p in tmp_path.iterdir()] == ["fedla.db"] and empty.stat().st_size == 0


def test_foreign_sqlite_file_is_refused_untouched(tmp_path):
    other = tmp_path / "notes.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    before = listing(tmp_path)
    with pytest.raises(StoreUnavailable, match="is not a FedLookahead run store"):
        create_app(str(other))
    assert listing(tmp_path) == before


def test_read_only_store_refuses_writes(tmp_path):
    db = make_store(tmp_path / "fedla.db")
    before = listing(tmp_path)
    with RunStore(str(db), read_only=True) as store:
        with pytest.raises(OperationalError, match="readonly"):
            store.start_run("intruder", {}, {})
        assert [r["run_id"] for r in store.list_runs()] == ["run-a"]
    assert {k: v for k, v in listing(tmp_path).items() if not k.endswith(("-wal", "-shm"))} == before


def test_write_protected_store_in_a_read_only_folder_opens(tmp_path):
    warm = make_store(tmp_path / "warm" / "fedla.db")
    expected = read_pages(warm)  # also imports, as root, whatever the requests import lazily
    assert set(expected["status"].values()) == {200} and expected["rounds"] == [1, 2, 3], expected
    # A folder `nobody` can reach (pytest's tmp_path is private to root), made read-only below.
    outer = Path(tempfile.mkdtemp(prefix="fedla-ro-"))
    folder = outer / "runs"
    try:
        db = make_store(folder / "fedla.db")
        before = listing(folder)
        for path in [p for p in folder.rglob("*") if p.is_file()]:
            path.chmod(0o444)
        for path in sorted([p for p in folder.rglob("*") if p.is_dir()] + [folder], reverse=True):
            path.chmod(0o555)
        outer.chmod(0o755)
        got = as_unprivileged(lambda: read_pages(db))
        assert got == expected
        assert listing(folder) == before  # no -wal/-shm, no byte changed
    finally:
        for path in [outer, *outer.rglob("*")]:
            if path.is_dir():
                path.chmod(stat.S_IRWXU)
        shutil.rmtree(outer)


def test_deleting_the_store_while_serving_is_503_and_recreates_nothing(tmp_path):
    db = make_store(tmp_path / "fedla.db")
    client = TestClient(create_app(str(db)), base_url=LOOPBACK_URL)
    assert client.get("/api/runs").status_code == 200
    for path in tmp_path.glob("fedla.db*"):
        path.unlink()
    api = client.get("/api/runs")
    assert api.status_code == 503 and api.headers["cache-control"] == "no-store"
    detail = api.json()["detail"]
    assert "\n" not in detail and detail.startswith("the run store is gone: no run store at")
    page = client.get("/runs/run-a")
    assert page.status_code == 503 and detail in html.unescape(page.text)
    assert client.get("/runs/run-a/checkpoint").status_code == 503
    assert not list(tmp_path.glob("fedla.db*"))
    # A new store in its place is another file: the dashboard still refuses until restarted.
    make_store(db, run_id="run-b")
    replaced = client.get("/api/runs")
    assert replaced.status_code == 503 and "was replaced by another file" in replaced.json()["detail"]


def test_cli_errors_never_show_secrets(tmp_path):
    """A real `fedla dashboard` process: no traceback, no password of the URL, no token (typer shows no locals)."""
    import subprocess
    import sys

    garbage = tmp_path / "garbage.db"
    garbage.write_text("not a database")
    for db in ("postgresql://user:PW-1234@127.0.0.1:1/runs", str(garbage)):
        done = subprocess.run(
            [sys.executable, "-m", "common.cli.app", "dashboard", "--db", db, "--token", "s3cret-TOKEN-9"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 2, output
        assert "PW-1234" not in output and "s3cret-TOKEN-9" not in output and "Traceback" not in output
        assert len(output.strip().splitlines()) == 1 and output.startswith("error:")


def test_the_dashboard_answers_only_loopback_host_names_unless_a_token_is_set(tmp_path):
    db = tmp_path / "fedla.db"
    RunStore(str(db)).close()
    open_dashboard = create_app(str(db))
    for host in ("evil.example.com", "evil.example.com:8080", "10.0.0.7"):
        response = TestClient(open_dashboard, base_url=f"http://{host}").get("/api/runs")
        assert response.status_code == 400 and "answers only loopback host names" in response.json()["detail"]
    for host in ("127.0.0.1:8080", "localhost"):
        assert TestClient(open_dashboard, base_url=f"http://{host}").get("/api/runs").status_code == 200, host
    token = "t" * 32
    guarded = TestClient(create_app(str(db), token=token), base_url="http://dashboard.example.com")
    assert guarded.get("/api/runs").status_code == 401  # any host, but only with the token
    assert guarded.get("/api/runs", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_host_headers_that_name_this_machine():
    from common.loopback import host_header_is_loopback

    for host in ("127.0.0.1", "127.0.0.1:80", "localhost:8765", "[::1]:8080", "::1", "app.localhost"):
        assert host_header_is_loopback(host), host
    for host in ("evil.example.com", "localhost.evil.com", "[::2]:80", "0.0.0.0:8080", "", None, "[::1"):
        assert not host_header_is_loopback(host), host
