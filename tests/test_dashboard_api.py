"""Dashboard JSON API and pages with FastAPI's TestClient, over a store filled like a real run."""

from __future__ import annotations

import hashlib
import html
import io
import logging
import math
import os
import warnings
import zipfile
from pathlib import Path

import pytest

from tests.conftest import LOOPBACK_URL

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette's note about httpx vs httpx2
    from fastapi.testclient import TestClient

from dashboard_data import PRIVACY_PLAN, SECAGG, fill_realistic_run, write_checkpoint, write_privacy_utility

from server.dashboard.app import create_app
from server.dashboard.pages import PRIVACY_NOTE
from server.dashboard.serve import _RedactToken, check_bind
from server.run.folder import RunFolder
from server.run.record import RoundRecord
from server.store.run_store import RunStore

TOKEN = "s3cret-token-0123456789"


@pytest.fixture
def store(tmp_path) -> RunStore:
    with RunStore(f"sqlite:///{tmp_path / 'fedla.db'}") as s:
        yield s


@pytest.fixture
def filled(store, tmp_path) -> RunStore:
    fill_realistic_run(store, "run-20", rounds=20, run_dir=tmp_path, checkpoint_every=5)  # next to fedla.db
    store.start_run("run-new", {"num_rounds": 5}, SECAGG)  # running, nothing recorded yet
    return store


@pytest.fixture
def client(filled) -> TestClient:
    return TestClient(create_app(filled), base_url=LOOPBACK_URL)


def test_api_runs_run_and_rounds(client, filled):
    runs = client.get("/api/runs").json()
    assert {r["run_id"]: (r["status"], r["num_rounds"]) for r in runs} == {
        "run-20": ("finished", 20),
        "run-new": ("running", 0),
    }
    assert {r["run_id"]: r["epsilon_budget"] for r in runs} == {"run-20": 4.0, "run-new": None}  # no plan yet
    run = client.get("/api/runs/run-20").json()
    assert run["secagg"] == SECAGG and run["config"]["num_rounds"] == 20 and run["num_rounds"] == 20
    assert run["plan"]["privacy"] == PRIVACY_PLAN and len(run["starting_heads"]["head_accuracy"]) == 4
    assert client.get("/api/runs/run-new").json()["starting_heads"] is None
    assert run["latest_checkpoint"]["round"] == 20 and run["latest_checkpoint"]["head_version"] == 20
    rounds = client.get("/api/runs/run-20/rounds").json()
    assert [r["round"] for r in rounds] == list(range(1, 21))
    stored = filled.get_rounds("run-20")
    assert [r["metrics"] for r in rounds] == [r["metrics"] for r in stored]
    assert [r["participation"] for r in rounds] == [r["participation"] for r in stored]
    assert rounds[-1]["privacy"]["epsilon_max"] == pytest.approx(stored[-1]["privacy"]["epsilon_max"])
    assert len(rounds[0]["metrics"]["head_accuracy"]) == 4
    assert [r["round"] for r in client.get("/api/runs/run-20/rounds?since=17").json()] == [18, 19, 20]
    assert client.get("/api/runs/run-new/rounds").json() == []
    assert client.get("/api/runs/run-20").headers["cache-control"] == "no-store"


def test_openapi_documents_the_api(client):
    spec = client.get("/openapi.json").json()
    assert set(spec["paths"]) == {
        "/api/runs",
        "/api/runs/{run_id}",
        "/api/runs/{run_id}/rounds",
        "/api/runs/{run_id}/privacy-utility",
    }
    ok = spec["paths"]["/api/runs/{run_id}/rounds"]["get"]["responses"]["200"]["content"]["application/json"]
    assert ok["schema"]["items"]["$ref"].endswith("/RoundOut")
    assert "404" in spec["paths"]["/api/runs/{run_id}"]["get"]["responses"]
    assert {
        "RunOut",
        "RunSummaryOut",
        "RoundOut",
        "MetricsOut",
        "ParticipationOut",
        "PrivacyOut",
        "CheckpointOut",
        "PrivacyUtilityOut",
        "StartingHeadsOut",
    } <= set(spec["components"]["schemas"])
    assert all(set(methods) == {"get"} for methods in spec["paths"].values())


def test_pages(client):
    index = client.get("/")
    assert index.status_code == 200 and "run-20" in index.text and "run-new" in index.text
    page = client.get("/runs/run-20")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert PRIVACY_NOTE in html.unescape(page.text) and "never stored" in page.text
    for key in SECAGG:
        assert key in page.text
    for canvas in ("chart-loss", "chart-accuracy", "chart-tau", "chart-epsilon", "chart-participation"):
        assert f'id="{canvas}"' in page.text
    assert 'href="/runs/run-20/checkpoint"' in page.text
    assert "/static/chart.umd.min.js" in page.text and "cdn" not in page.text.lower()
    assert client.get("/static/chart.umd.min.js").status_code == 200
    assert "Content-Security-Policy" in page.headers


def test_unknown_run_is_404_json_for_api_and_html_for_pages(client):
    api = client.get("/api/runs/ghost")
    assert api.status_code == 404 and api.json() == {"detail": "unknown run id 'ghost'"}
    for path in ("/api/runs/ghost/rounds",):
        assert client.get(path).json() == {"detail": "unknown run id 'ghost'"}
    for path in ("/runs/ghost", "/runs/ghost/checkpoint"):
        page = client.get(path)
        assert page.status_code == 404 and page.headers["content-type"].startswith("text/html")
        assert "unknown run id &#39;ghost&#39;" in page.text
    assert client.get("/runs/run-new/checkpoint").status_code == 404  # no checkpoint yet
    bad = client.get("/api/runs/run-20/rounds?since=abc")
    assert bad.status_code == 400 and "since" in bad.json()["detail"]


def test_empty_database_shows_empty_state(store):
    client = TestClient(create_app(store), base_url=LOOPBACK_URL)
    page = client.get("/")
    assert page.status_code == 200 and "No runs recorded yet" in page.text
    assert client.get("/api/runs").json() == []


def test_read_only(client, filled, tmp_path):
    before = (filled.list_runs(), filled.get_rounds("run-20"))
    for method in ("post", "put", "patch", "delete"):
        for path in ("/", "/api/runs", "/api/runs/run-20", "/api/runs/run-20/rounds", "/runs/run-20"):
            response = client.request(method.upper(), path, json={"status": "failed"})
            assert response.status_code == 405, (method, path)
    assert (filled.list_runs(), filled.get_rounds("run-20")) == before


def test_checkpoint_download(client, filled, tmp_path):
    latest = filled.latest_checkpoint("run-20")
    response = client.get("/runs/run-20/checkpoint")
    assert response.status_code == 200 and response.headers["content-type"] == "application/zip"
    assert "run-20-round20-v20.zip" in response.headers["content-disposition"]
    archive = zipfile.ZipFile(io.BytesIO(response.content))
    assert sorted(archive.namelist()) == ["heads.safetensors", "heads_config.json"]
    assert hashlib.sha256(archive.read("heads.safetensors")).hexdigest() == latest["sha256"]
    assert response.headers["x-checkpoint-sha256"] == latest["sha256"]
    assert client.get("/runs/run-20/checkpoint?round=5").headers["x-checkpoint-round"] == "5"
    assert client.get("/runs/run-20/checkpoint?round=6").status_code == 404  # not a recorded checkpoint

    # A checkpoint recorded as a single file is streamed as is.
    single = tmp_path / "run-20" / "checkpoints" / "single" / "heads.safetensors"
    write_checkpoint(single.parent, seed=1)
    filled.record_checkpoint(
        "run-20",
        21,
        head_version=21,
        path=str(single),
        size_bytes=single.stat().st_size,
        sha256=hashlib.sha256(single.read_bytes()).hexdigest(),
    )
    response = client.get("/runs/run-20/checkpoint")
    assert response.content == single.read_bytes()

    # A recorded file that is a symlink out of its directory is refused; a vanished one is a 404.
    secret = tmp_path / "secret.txt"
    secret.write_text("not a checkpoint")
    link_dir = tmp_path / "run-20" / "checkpoints" / "evil"
    link_dir.mkdir()
    os.symlink(secret, link_dir / "heads.safetensors")
    filled.record_checkpoint(
        "run-20", 22, head_version=22, path=str(link_dir / "heads.safetensors"), size_bytes=1, sha256="0" * 64
    )
    response = client.get("/runs/run-20/checkpoint")
    assert response.status_code == 404 and "not a checkpoint" not in response.text
    filled.record_checkpoint(
        "run-20", 23, head_version=23, path=str(tmp_path / "run-20" / "gone"), size_bytes=1, sha256="0" * 64
    )
    assert "no longer on disk" in client.get("/runs/run-20/checkpoint").text

    # Inside a zipped directory, symlinks leading outside it are left out.
    os.symlink(secret, Path(latest["path"]) / "leak.txt")
    names = zipfile.ZipFile(io.BytesIO(client.get("/runs/run-20/checkpoint?round=20").content)).namelist()
    assert "leak.txt" not in names and "heads.safetensors" in names


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "{tmp}/fedla.db",
        "{tmp}/run-new/checkpoints/round-1",
        "{tmp}/run-20",
        "{tmp}/run-20/../run-new/x",
        "{tmp}/run-20x/checkpoints/round-1",
        "run-20/checkpoints/round-20",
    ],
)
def test_checkpoint_outside_the_run_folder_is_refused(client, filled, tmp_path, path, monkeypatch):
    """A database row naming any file outside <run-dir>/<run-id>/ is never served, whatever it names."""
    monkeypatch.chdir("/")  # a relative row resolves against the dashboard's working directory, not the run folder
    target = Path(path.format(tmp=tmp_path))
    if target.is_absolute() and not target.exists():
        write_checkpoint(target, seed=3)  # a real checkpoint, only in the wrong place
    filled.record_checkpoint("run-20", 30, head_version=30, path=str(target), size_bytes=1, sha256="0" * 64)
    response = client.get("/runs/run-20/checkpoint")
    assert response.status_code == 404 and "outside the run's folder" in html.unescape(response.text)
    assert "root:" not in response.text and response.headers["content-type"].startswith("text/html")
    assert client.get("/runs/run-20/checkpoint?round=20").status_code == 200  # the real ones still are


def test_checkpoint_of_a_store_kept_elsewhere_needs_the_run_dir(tmp_path):
    """With the store outside the run folder, checkpoints are served only from the run_dir the operator gives."""
    with RunStore(f"sqlite:///{tmp_path / 'db' / 'fedla.db'}") as writer:
        fill_realistic_run(writer, "away", rounds=5, run_dir=tmp_path / "runs")
    refused = TestClient(create_app(str(tmp_path / "db" / "fedla.db")), base_url=LOOPBACK_URL)
    assert refused.get("/runs/away/checkpoint").status_code == 404
    served = TestClient(create_app(str(tmp_path / "db" / "fedla.db"), run_dir=tmp_path / "runs"), base_url=LOOPBACK_URL)
    response = served.get("/runs/away/checkpoint")
    assert response.status_code == 200 and response.headers["x-checkpoint-round"] == "5"


def test_token_guards_every_request(filled):
    client = TestClient(create_app(filled, token=TOKEN), base_url=LOOPBACK_URL)
    for path in (
        "/",
        "/runs/run-20",
        "/api/runs",
        "/api/runs/run-20/rounds",
        "/openapi.json",
        "/static/dashboard.js",
        "/runs/run-20/checkpoint",
    ):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"Authorization": "Bearer wrong-token-000000000"}).status_code == 401
        assert client.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200, path
        assert client.get(path, params={"token": TOKEN}).status_code == 200, path
    assert client.get("/api/runs").json() == {"detail": "missing or invalid token"}
    page = client.get("/runs/run-20", params={"token": TOKEN}).text
    # The page passes the token on to its assets and links (and its JS to the API calls).
    assert f"/static/dashboard.js?token={TOKEN}" in page and f"/runs/run-20/checkpoint?token={TOKEN}" in page
    assert f'href="/?token={TOKEN}"' in page


@pytest.mark.parametrize(
    "host,token,ok",
    [
        ("127.0.0.1", None, True),
        ("localhost", None, True),
        ("::1", None, True),
        ("127.0.0.2", None, True),
        ("0.0.0.0", None, False),
        ("192.168.1.5", None, False),
        ("0.0.0.0", "short", False),
        ("0.0.0.0", TOKEN, True),
    ],
)
def test_binding_beyond_loopback_requires_token(host, token, ok):
    if ok:
        check_bind(host, token)
    else:
        with pytest.raises(ValueError, match="token") as info:
            check_bind(host, token)
        assert "\n" not in str(info.value)


def test_cli_refuses_public_bind_without_token(monkeypatch):
    from typer.testing import CliRunner

    from common.cli.app import app

    monkeypatch.delenv("FEDLA_DASHBOARD_TOKEN", raising=False)
    result = CliRunner().invoke(app, ["dashboard", "--host", "0.0.0.0", "--db", "sqlite://"])
    assert result.exit_code == 2
    assert "refusing to bind the dashboard to 0.0.0.0" in result.output


def test_access_log_redacts_token():
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        "",
        0,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "GET", f"/runs/x?token={TOKEN}&a=1", "1.1", 200),
        None,
    )
    _RedactToken().filter(record)
    assert TOKEN not in record.getMessage() and "token=***&a=1" in record.getMessage()


def test_unbounded_epsilon_is_null(store):
    store.start_run("nodp", {}, {})
    store.record_round(
        "nodp",
        RoundRecord(
            round=1,
            train_loss=3.0,
            head_accuracy=[0.1],
            sampled=2,
            succeeded=2,
            epsilon_max=math.inf,
            epsilon_mean=math.inf,
            wall_seconds=1.0,
            bytes_down_per_client=10,
        ),
    )
    client = TestClient(create_app(store), base_url=LOOPBACK_URL)
    assert client.get("/api/runs/nodp/rounds").json()[0]["privacy"]["epsilon_max"] is None
    assert client.get("/runs/nodp").status_code == 200


def test_privacy_utility_curve_of_a_benchmark_run(client, tmp_path):
    write_privacy_utility(tmp_path / "run-20")
    curve = client.get("/api/runs/run-20/privacy-utility").json()
    assert curve["epsilon"] == [1.0, 2.0, 4.0, 8.0] and curve["dp"] == [1.40, 1.44, 1.46, 1.49]
    assert curve["references"] == {"public_only": 1.48, "federated_nodp": 1.47, "central_nodp": 1.54}
    assert curve["this_run"] == {"kind": "dp", "epsilon": 8.0, "tau": 1.49}
    assert 'id="chart-privacy-utility"' in client.get("/runs/run-20").text
    # a run that was not part of a benchmark has no curve and no such plot
    assert client.get("/api/runs/run-new/privacy-utility").status_code == 404
    assert "chart-privacy-utility" not in client.get("/runs/run-new").text
    # a damaged curve, or a benchmark's own JSON in its place, costs the plot, never the page
    for damaged in ("{not json", '{"dp": {"8": {"tau_heads_only": 1.4}}}', '{"epsilon": [8, 1], "dp": [1.4, 1.3]}'):
        RunFolder(tmp_path / "run-20").privacy_utility.write_text(damaged)
        assert client.get("/api/runs/run-20/privacy-utility").status_code == 404
        page = client.get("/runs/run-20")
        assert page.status_code == 200 and "chart-privacy-utility" not in page.text
