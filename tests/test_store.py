"""RunStore: ORM schema, upserts, resumed runs, bad input, crash safety, schema upgrades."""

from __future__ import annotations

import json
import math
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from server.run.record import RoundRecord
from server.store.migrations import MIGRATIONS
from server.store.run_store import RunStore
from server.store.schema import SCHEMA_VERSION, STORE_TABLES
from tests.dashboard_data import SECAGG

CONFIG = {"num_rounds": 3, "num_heads": 2, "clients_per_round": 4, "lr": 0.001, "noise_multiplier": 0.8}


def round_record(r: int, **over) -> RoundRecord:
    values = dict(
        round=r,
        train_loss=4.0 / r,
        head_accuracy=[0.2 + 0.05 * r, 0.1 + 0.03 * r],
        tau=1.0 + 0.1 * r,
        client_head_accuracy=[0.21 + 0.05 * r, 0.12 + 0.03 * r],
        client_tau=1.05 + 0.1 * r,
        tau_heads_only=0.9 + 0.1 * r,
        sampled=4,
        succeeded=3,
        dropped=1,
        rejected=({"node": 7, "reason": "update norm too large"},),
        epsilon_max=0.5 * r,
        epsilon_mean=0.4 * r,
        delta=1e-5,
        wall_seconds=2.5,
        bytes_down_per_client=100_000,
        bytes_up_per_client=23_456,
        eval_push_bytes_per_client=100_000,
        fit_seconds=1.5,
        server_eval_seconds=0.5,
        client_eval_seconds=0.25,
        client_train_seconds=3.0,
    )
    values.update(over)
    return RoundRecord(**values)


@pytest.fixture
def store(tmp_path) -> RunStore:
    with RunStore(f"sqlite:///{tmp_path / 'fedla.db'}") as s:
        yield s


def test_roundtrip_upsert_and_summary(store, tmp_path):
    store.start_run("run-a", CONFIG, SECAGG)
    for r in (1, 2, 3):
        store.record_round("run-a", round_record(r))
    # Upsert: round 2 recorded again replaces the row, its participation, rejections and privacy.
    store.record_round("run-a", round_record(2, sampled=4, succeeded=4, dropped=0, rejected=()))
    store.record_checkpoint("run-a", 2, head_version=2, path="/ckpt/v2", size_bytes=10, sha256="ab" * 32)
    store.record_checkpoint("run-a", 3, head_version=3, path="/ckpt/v3", size_bytes=11, sha256="CD" * 32)
    store.finish_run("run-a", "finished")

    rounds = store.get_rounds("run-a")
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert rounds[1]["participation"] == {"sampled": 4, "succeeded": 4, "dropped": 0, "rejected": []}
    assert rounds[0]["participation"]["rejected"] == [{"reason": "update norm too large"}]
    assert rounds[2]["metrics"]["head_accuracy"] == pytest.approx([0.35, 0.19])
    assert rounds[2]["privacy"] == {"epsilon_max": 1.5, "epsilon_mean": pytest.approx(1.2), "delta": 1e-5}
    # what the dashboard shows beyond the headline numbers: tau of the heads alone, traffic, timings
    assert rounds[2]["tau_heads_only"] == pytest.approx(1.2) and rounds[2]["bytes_per_client"] == 123_456
    assert rounds[2]["bytes"] == {"down_per_client": 100_000, "up_per_client": 23_456, "eval_push_per_client": 100_000}
    assert rounds[2]["seconds"] == {"fit": 1.5, "server_eval": 0.5, "client_eval": 0.25, "client_train_sum": 3.0}
    run = store.get_run("run-a")
    assert run["status"] == "finished" and run["finished_at"] and run["num_rounds"] == 3
    assert run["secagg"] == SECAGG and run["config"] == CONFIG
    assert run["latest_checkpoint"]["head_version"] == 3 and run["latest_checkpoint"]["sha256"] == "cd" * 32
    assert store.latest_checkpoint("run-a") == run["latest_checkpoint"]
    assert store.latest_checkpoint("nope") is None and store.get_run("nope") is None and store.get_rounds("nope") == []
    listed = store.list_runs()
    assert [(r["run_id"], r["num_rounds"], r["last_round"]) for r in listed] == [("run-a", 3, 3)]

    out = tmp_path / "out" / "summary.json"
    store.write_summary("run-a", out)
    summary = json.loads(out.read_text())
    assert summary["run"]["run_id"] == "run-a" and len(summary["rounds"]) == 3
    assert summary["final"]["round"] == 3 and len(summary["checkpoints"]) == 2
    assert not list(out.parent.glob("*.tmp"))  # temp file renamed away
    store.write_summary("run-a", out.parent)  # a directory gets summary.json inside
    assert json.loads(out.read_text())["rounds"] == summary["rounds"]


def test_resumed_run_keeps_rows(store):
    store.start_run("run-r", CONFIG, SECAGG)
    store.record_round("run-r", round_record(1))
    store.finish_run("run-r", "failed")
    store.start_run("run-r", CONFIG, SECAGG)  # resumed
    run = store.get_run("run-r")
    assert run["status"] == "running" and run["finished_at"] is None and run["num_rounds"] == 1
    store.record_round("run-r", round_record(2))
    assert [r["round"] for r in store.get_rounds("run-r")] == [1, 2]


def test_plan_and_starting_heads_reach_the_run_and_its_budget_the_runs_list(store):
    store.start_run("run-p", CONFIG, SECAGG)
    assert store.list_runs()[0]["epsilon_budget"] is None  # no plan yet
    store.record_plan("run-p", {"nodes": 4, "privacy": {"dp": True, "epsilon_budget": 8.0, "verdict": None}})
    store.record_starting_heads("run-p", {"head_accuracy": [0.3, 0.2], "tau": 1.4, "loss": float("nan")})
    run = store.get_run("run-p")
    assert run["plan"]["privacy"]["epsilon_budget"] == 8.0 and store.list_runs()[0]["epsilon_budget"] == 8.0
    assert run["starting_heads"] == {"head_accuracy": [0.3, 0.2], "tau": 1.4, "loss": None}  # strict JSON
    with pytest.raises(ValueError, match="unknown run id .nope."):
        store.record_plan("nope", {})
    with pytest.raises(ValueError, match="plan must be a dict, got list"):
        store.record_plan("run-p", [])
    assert store.get_run("run-p")["plan"]["nodes"] == 4  # a refused write loses nothing


def test_no_dp_epsilon_is_infinite_and_reported_as_null(store, tmp_path):
    store.start_run("nodp", CONFIG, SECAGG)
    store.record_round("nodp", round_record(1, epsilon_max=math.inf, epsilon_mean=math.inf, delta=0.0))
    assert store.get_rounds("nodp")[0]["privacy"]["epsilon_max"] is None
    store.write_summary("nodp", tmp_path / "s.json")  # strict JSON, no Infinity
    json.loads((tmp_path / "s.json").read_text())


BAD_ROUNDS = [
    ("train_loss", "x", "train_loss must be a number"),
    ("train_loss", math.nan, "non-finite train_loss=nan"),
    ("head_accuracy", [0.1, None], "head_accuracy[1] must be a number"),
    ("head_accuracy", [1.5], "out-of-range head_accuracy[0]=1.5: above 1"),
    ("succeeded", 5, "cannot exceed sampled"),
    ("rejected", ({"why": "x"},), "rejected[0] must be {'reason': a non-empty string}"),
    ("epsilon_max", -1, "out-of-range epsilon_max=-1: below 0"),
    ("delta", 2, "out-of-range delta=2: above 1"),
    ("bytes_up_per_client", 1.5, "bytes_up_per_client must be an integer"),
    ("wall_seconds", -1.0, "out-of-range wall_seconds=-1: below 0"),
    ("round", -1, "out-of-range round=-1: below 0"),
]


@pytest.mark.parametrize("field,value,message", BAD_ROUNDS)
def test_a_bad_round_is_refused_in_one_line_and_loses_nothing(store, field, value, message):
    """A RoundRecord checks itself when made (server.run.record), so nothing malformed reaches the store."""
    store.start_run("run-b", CONFIG, SECAGG)
    store.record_round("run-b", round_record(1))
    before = store.get_rounds("run-b")
    with pytest.raises(ValueError) as info:
        store.record_round("run-b", round_record(1, **{field: value}))
    assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="^record must be a RoundRecord, got dict$"):
        store.record_round("run-b", {"round": 1, "train_loss": 1.0})
    assert store.get_rounds("run-b") == before


def test_unknown_run_and_other_bad_calls(store):
    with pytest.raises(ValueError, match=r"^unknown run id 'ghost': call start_run first$"):
        store.record_round("ghost", round_record(1))
    with pytest.raises(ValueError, match="unknown run id"):
        store.record_checkpoint("ghost", 1, head_version=1, path="p", size_bytes=1, sha256="0" * 64)
    with pytest.raises(ValueError, match="unknown run id"):
        store.finish_run("ghost", "finished")
    store.start_run("run-c", CONFIG, SECAGG)
    with pytest.raises(ValueError, match="status must be one of"):
        store.finish_run("run-c", "done")
    with pytest.raises(ValueError, match="sha256 must be 64 hex digits"):
        store.record_checkpoint("run-c", 1, head_version=1, path="p", size_bytes=1, sha256="xyz")
    with pytest.raises(ValueError, match="config is not JSON-serialisable"):
        store.start_run("run-d", {"x": object()}, SECAGG)
    assert store.get_run("run-d") is None and store.get_run("run-c")["status"] == "running"


def test_tables_pragmas_and_no_client_updates(store, tmp_path):
    db = sqlite3.connect(tmp_path / "fedla.db")
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert (
        tables
        == {"schema_version", "runs", "rounds", "participation", "rejected_replies", "privacy", "checkpoints"}
        == set(STORE_TABLES)
    )
    # Nothing that could hold an individual client's update: no blob columns anywhere.
    for table in tables:
        types = {row[2].upper() for row in db.execute(f"PRAGMA table_info({table})")}
        assert "BLOB" not in types, table
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    assert store.schema_version() == SCHEMA_VERSION


def test_default_url_and_env_override(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDLA_DB", raising=False)
    RunStore().close()
    assert (tmp_path / "runs" / "fedla.db").is_file()
    monkeypatch.setenv("FEDLA_DB", str(tmp_path / "elsewhere" / "x.db"))
    with RunStore() as s:
        s.start_run("e", CONFIG, SECAGG)
    assert (tmp_path / "elsewhere" / "x.db").is_file()


CRASHER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from server.store.run_store import RunStore
    from server.store.schema import Round
    from tests.test_store import CONFIG, SECAGG, round_record
    store = RunStore(sys.argv[1])
    store.start_run("crash", CONFIG, SECAGG)
    for r in (1, 2, 3):
        store.record_round("crash", round_record(r))
    session = store._session()
    session.begin()
    session.add(Round(run_id="crash", round=4, train_loss=1.0, head_accuracy=[], wall_seconds=0.0,
                      bytes_per_client=0, recorded_at=__import__("datetime").datetime.now()))
    session.flush()          # round 4 is half-written inside an open transaction...
    os._exit(17)             # ...when the process dies without cleanup
""")


def test_crash_mid_round_loses_nothing_committed(tmp_path):
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", CRASHER, url, root], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 17, proc.stderr
    with RunStore(url) as store:
        assert [r["round"] for r in store.get_rounds("crash")] == [1, 2, 3]
        assert store.get_run("crash")["status"] == "running"
        store.record_round("crash", round_record(4))  # the resumed run carries on
        assert store.get_run("crash")["num_rounds"] == 4
    assert sqlite3.connect(tmp_path / "crash.db").execute("PRAGMA integrity_check").fetchone()[0] == "ok"


V1_DDL = """
CREATE TABLE schema_version (id INTEGER PRIMARY KEY, version INTEGER NOT NULL);
INSERT INTO schema_version VALUES (1, 1);
CREATE TABLE runs (run_id VARCHAR(200) PRIMARY KEY, status VARCHAR(20) NOT NULL, config JSON NOT NULL,
    secagg JSON NOT NULL, started_at DATETIME NOT NULL, updated_at DATETIME NOT NULL, finished_at DATETIME);
CREATE TABLE rounds (id INTEGER PRIMARY KEY, run_id VARCHAR(200) NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE,
    round INTEGER NOT NULL, train_loss FLOAT NOT NULL, head_accuracy JSON NOT NULL, tau FLOAT,
    wall_seconds FLOAT NOT NULL, bytes_per_client INTEGER NOT NULL, recorded_at DATETIME NOT NULL,
    CONSTRAINT uq_rounds_run_round UNIQUE (run_id, round));
CREATE TABLE participation (round_id INTEGER PRIMARY KEY REFERENCES rounds(id) ON DELETE CASCADE,
    sampled INTEGER NOT NULL, succeeded INTEGER NOT NULL, dropped INTEGER NOT NULL);
CREATE TABLE rejected_replies (id INTEGER PRIMARY KEY, round_id INTEGER NOT NULL REFERENCES rounds(id)
    ON DELETE CASCADE, reason VARCHAR(500) NOT NULL);
CREATE TABLE privacy (round_id INTEGER PRIMARY KEY REFERENCES rounds(id) ON DELETE CASCADE,
    epsilon_max FLOAT NOT NULL, epsilon_mean FLOAT NOT NULL, delta FLOAT NOT NULL);
CREATE TABLE checkpoints (id INTEGER PRIMARY KEY, run_id VARCHAR(200) NOT NULL REFERENCES runs(run_id)
    ON DELETE CASCADE, round INTEGER NOT NULL, head_version INTEGER NOT NULL, path VARCHAR(4096) NOT NULL,
    size_bytes INTEGER NOT NULL, sha256 VARCHAR(64) NOT NULL, created_at DATETIME NOT NULL,
    CONSTRAINT uq_checkpoints_run_round UNIQUE (run_id, round));
INSERT INTO runs VALUES ('old', 'finished', '{"num_rounds": 1}', '{"num_shares": 3}',
    '2025-01-01 00:00:00', '2025-01-01 00:00:00', '2025-01-01 00:00:00');
INSERT INTO rounds VALUES (1, 'old', 1, 2.5, '[0.3, 0.2]', 1.4, 3.0, 999, '2025-01-01 00:00:00');
INSERT INTO participation VALUES (1, 4, 4, 0);
INSERT INTO privacy VALUES (1, 0.7, 0.6, 1e-05);
"""


def test_v1_database_is_upgraded_at_open(tmp_path):
    assert list(MIGRATIONS) == list(range(2, SCHEMA_VERSION + 1))
    path = tmp_path / "v1.db"
    db = sqlite3.connect(path)
    db.executescript(V1_DDL)
    db.close()
    with RunStore(f"sqlite:///{path}") as store:
        assert store.schema_version() == SCHEMA_VERSION == 4
        assert store.get_run("old")["plan"] is None and store.get_run("old")["starting_heads"] is None
        old = store.get_rounds("old")
        assert old[0]["metrics"]["train_loss"] == 2.5 and old[0]["metrics"]["client_tau"] is None
        assert old[0]["tau_heads_only"] is None and old[0]["bytes"] is None and old[0]["seconds"] is None
        assert old[0]["recorded_at"] == "2025-01-01T00:00:00+00:00"
        store.start_run("old", {"num_rounds": 2}, {"num_shares": 3})  # resume the old run on the new schema
        store.record_round("old", round_record(2))
        assert store.get_rounds("old")[1]["metrics"]["client_tau"] == pytest.approx(1.25)
    columns = {row[1] for row in sqlite3.connect(path).execute("PRAGMA table_info(rounds)")}
    assert {"client_head_accuracy", "client_tau", "tau_heads_only", "traffic", "seconds"} <= columns
    assert {"plan", "starting_heads"} <= {row[1] for row in sqlite3.connect(path).execute("PRAGMA table_info(runs)")}
    with RunStore(f"sqlite:///{path}") as store:  # opening again is a no-op
        assert store.schema_version() == SCHEMA_VERSION


def test_newer_or_unversioned_database_is_refused(tmp_path):
    newer = tmp_path / "newer.db"
    RunStore(f"sqlite:///{newer}").close()
    sqlite3.connect(newer).execute("UPDATE schema_version SET version = 99").connection.commit()
    with pytest.raises(ValueError, match="newer than this code"):
        RunStore(f"sqlite:///{newer}")
    bare = tmp_path / "bare.db"
    sqlite3.connect(bare).executescript("CREATE TABLE runs (run_id TEXT PRIMARY KEY);")
    with pytest.raises(ValueError, match="no schema_version"):
        RunStore(f"sqlite:///{bare}")


def test_numpy_scalars_and_non_finite_config_values(store):
    np = pytest.importorskip("numpy")
    store.start_run("np", {"dp_target_epsilon": math.inf, "nested": [math.nan]}, SECAGG)
    assert store.get_run("np")["config"] == {"dp_target_epsilon": None, "nested": [None]}  # strict JSON
    store.record_round(
        "np",
        round_record(
            np.int64(1),
            train_loss=np.float32(2.5),
            head_accuracy=list(np.array([0.5, 0.25], dtype=np.float32)),
            sampled=np.int64(3),
            succeeded=3,
            dropped=0,
            bytes_down_per_client=np.int32(7),
            bytes_up_per_client=0,
        ),
    )
    row = store.get_rounds("np")[0]
    assert row["metrics"]["head_accuracy"] == [0.5, 0.25] and type(row["metrics"]["train_loss"]) is float
    assert row["participation"]["sampled"] == 3 and row["bytes_per_client"] == 7
