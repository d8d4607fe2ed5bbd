"""`flwr run` end to end: a 3-client simulation with SecAgg+ and DP on a private local SuperLink."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from common.data.chunks import stdlib_dir
from common.procs import alive
from server.superlink import SuperLink

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    shutil.which("flower-superlink", path=os.path.dirname(sys.executable)) is None,
    reason="flower-superlink is not installed in this environment",
)


def test_flwr_run_simulation_with_secagg_and_dp(tiny_base_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLA_HOME", str(tmp_path / "fedla-home"))  # chunk caches stay in the test's folder
    run_config = {
        "base-model-dir": str(tiny_base_dir),
        "data-source": str(stdlib_dir() / "json"),
        "num-server-rounds": 2,
        "chunk-len": 32,
        "max-chunks-per-client": 12,
        "num-heads": 2,
        "batch-size": 4,
        "min-train-clients": 3,
        "min-available-clients": 3,
        "node-wait-seconds": 60.0,
        "server-eval-chunks": 8,
        "eval-prompts": 1,
        "eval-max-new-tokens": 4,
        "client-eval-prompts": 1,
        "run-dir": str(tmp_path / "runs"),
        "run-id": "flwr-e2e",
        "secagg": True,
        "dp": True,
        "public-heads-minutes": 0.05,  # the default init-heads="public": trained once, here in seconds
    }
    link = SuperLink.for_simulation(flwr_home=tmp_path / "flwr-home", log_dir=tmp_path, cwd=REPO)
    with link:
        code, _ = link.submit(
            REPO,
            run_config,
            {"num-supernodes": 3, "client-resources-num-cpus": 1},
            timeout=600,
            log_path=tmp_path / "flwr-run.log",
            echo=False,
        )
        port, started = link.port, link.pids()
    log = (tmp_path / "flwr-run.log").read_text()
    assert code == 0, log[-3000:]
    # issue 30 item 5: a first federated run starts from heads trained on public code, built once
    [public] = (tmp_path / "fedla-home" / "heads").glob("public-*-k2-c32-m0.05")
    assert "starting from the public heads in" in log and str(public) in log
    # everything this test started is gone: SuperLink, SuperExec, simulation, Ray workers
    assert not [pid for pid in started if alive(pid)]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
    summary = json.loads((tmp_path / "runs" / "flwr-e2e" / "summary.json").read_text())
    assert summary["run"]["status"] == "finished", log[-3000:]
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    for record in summary["rounds"]:
        assert record["participation"] == {"sampled": 3, "succeeded": 3, "dropped": 0, "rejected": []}
        assert 0 < record["privacy"]["epsilon_max"] <= 8.0
    assert summary["rounds"][1]["privacy"]["epsilon_max"] > summary["rounds"][0]["privacy"]["epsilon_max"]
    assert "Secure aggregation completed" in log
    assert (tmp_path / "runs" / "flwr-e2e" / "checkpoints" / "round-2" / "heads.safetensors").is_file()


def test_the_dropout_scenario_crashes_a_client_through_flwr_run_and_secagg_survives(
    tiny_base_dir, tmp_path, monkeypatch
):
    """simulations.run's dropout scenario: `flwr run` of the app copy whose ClientApp carries the fault mod."""
    sys.path.insert(0, str(REPO))  # simulations/ is a folder of scripts, not installed
    from simulations import run as runner

    monkeypatch.setenv("FEDLA_HOME", str(tmp_path / "fedla-home"))
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    sets = {
        "base-model-dir": f'"{tiny_base_dir}"',
        "data-source": f'"{stdlib_dir() / "json"}"',
        "chunk-len": 32,
        "max-chunks-per-client": 12,
        "num-heads": 2,
        "batch-size": 4,
        "server-eval-chunks": 8,
        "eval-prompts": 1,
        "eval-max-new-tokens": 4,
        "client-eval-prompts": 1,
        "init-heads": '"fresh"',
    }
    argv = ["dropout", "--clients", "3", "--rounds", "1", "--run-id", "drop", "--run-dir", str(tmp_path / "runs")]
    argv += [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    assert runner.main(argv) == 0, (tmp_path / "runs" / "drop" / "flwr.log").read_text()[-3000:]
    record = json.loads((tmp_path / "runs" / "drop" / "rounds" / "round-1.json").read_text())
    assert record["aggregated"], record["aggregate_note"]
    part = record["participation"]
    assert (part["sampled"], part["succeeded"], part["dropped"]) == (3, 2, 1)
    [reason] = part["failures"].values()
    assert "simulated dropout in round 1" in reason
    assert "Secure aggregation completed" in (tmp_path / "runs" / "drop" / "flwr.log").read_text()
