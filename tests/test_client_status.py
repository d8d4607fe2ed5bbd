"""One state folder per device: readiness writes its chunks and features there, `fedla client status`
reads it, `fedla client forget` wipes the private caches but keeps the ledger, and `fedla generate`
finds the daemon's heads (client.daemon.readiness, client.status, common/cli/app.py generate)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from client.daemon import DaemonOptions, node_config_values, write_node_config
from client.daemon.readiness import prepare
from client.events import record_event
from client.kept_heads import keep_global_heads
from client.node_config import HEADS_DIR_KEY
from client.state import StateDir
from client.status import device_status, forget, format_status
from client.training.dp import PrivacyState, epsilon_of
from client.training.ledger import Ledger, save_ledger
from common.cli.app import app
from common.data.chunks import stdlib_dir
from common.errors import FedLookaheadError
from common.heads.lookahead import DraftHeads
from common.model import int8_kernels
from common.paths import cache_root

HISTORY = [(2.0, 0.1, 10), (2.5, 0.1, 10)]  # lifetime epsilon about 1 at delta 1e-5


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def device(tmp_path_factory, tiny_base_dir, tiny_base, one_thread):
    """A device's state folder as the daemon and two runs leave it: node config, chunks and features
    (readiness), a ledger over two runs, heads v2 of the last run, round events."""
    root = tmp_path_factory.mktemp("device")
    data = root / "data"
    data.mkdir()
    for source in sorted((stdlib_dir() / "json").glob("*.py")):
        shutil.copy(source, data / source.name)
    state = root / "state"
    state.mkdir()
    opts = DaemonOptions(
        superlink="127.0.0.1:9092",
        data=data,
        base=tiny_base_dir,
        device="cpu",
        budget_eps=3.0,
        node_config="chunk-len=32",
        heads_dir=root / "published",
    )
    values = node_config_values(opts, state, tiny_base_dir)
    write_node_config(state / "node-config.toml", values)
    chunks_before = set((cache_root() / "chunks").glob("*")) if (cache_root() / "chunks").is_dir() else set()
    said: list[str] = []
    ready = prepare(values, said.append)
    save_ledger(
        Ledger(
            state,
            runs={
                "deploy-a": PrivacyState("deploy-a", 2.0, HISTORY[:1]),
                "deploy-b": PrivacyState("deploy-b", 2.5, HISTORY[1:]),
            },
        )
    )
    heads = DraftHeads.fresh(tiny_base, 2)
    for run, name in ((7, "deploy-a"), (8, "deploy-b")):
        for server_round in (1, 2):
            record_event(values, "train-start", run=run, fedla_run=name, round=server_round, version=server_round - 1)
            record_event(
                values, "train-done", run=run, round=server_round, metrics={"skipped": 0, "dp": 1, "epsilon": 1.0}
            )
            heads.config.version = server_round
            keep_global_heads(heads, values, run, server_round)
            record_event(
                values, "eval", run=run, round=server_round, version=server_round, final=int(server_round == 2)
            )
    chunks_after = set((cache_root() / "chunks").glob("*")) if (cache_root() / "chunks").is_dir() else set()
    return {
        "state": state,
        "values": values,
        "ready": ready,
        "said": said,
        "new_shared_chunks": chunks_after - chunks_before,
    }


def test_readiness_keeps_the_private_text_in_the_state_folder(device):
    state, ready = device["state"], device["ready"]
    assert ready.train_chunks > 0 and ready.features.startswith("computed")
    assert len(list((state / "chunks").glob("*.pt"))) == 1
    assert list((state / "features").rglob("*.pt"))
    assert device["new_shared_chunks"] == set()  # nothing under $FEDLA_HOME/chunks
    assert any(line.startswith("tokenised: ") for line in device["said"])


def test_status_reads_the_state_folder(device):
    state = device["state"]
    status = device_status(state)
    privacy = status["privacy"]
    assert privacy["trusted"] and privacy["budget"] == 3.0 and privacy["delta"] == 1e-5
    assert privacy["epsilon"] == pytest.approx(epsilon_of(HISTORY, 1e-5))  # both runs compose: lifetime
    assert privacy["remaining"] == pytest.approx(3.0 - privacy["epsilon"])
    assert [(r["name"], r["rounds"], r["trained"], r["finished"]) for r in status["runs"]] == [
        ("deploy-a", 2, 2, True),
        ("deploy-b", 2, 2, True),
    ]
    assert status["last_round"] == {"run": "deploy-b", "round": 2}
    assert (status["heads"]["version"], status["heads"]["run"]) == (2, 8)
    assert status["paths"]["chunks (private text)"] == str(state.resolve() / "chunks")
    assert status["paths"]["published heads"] == device["values"][HEADS_DIR_KEY]
    assert status["generate"].startswith(f"fedla generate --state-dir {state.resolve()} --base ")
    text = format_status(status)
    assert f"lifetime epsilon {privacy['epsilon']:.3f} of budget 3" in text
    assert "heads: v2 of run deploy-b" in text and "runs joined: 2" in text
    result = CliRunner().invoke(app, ["client", "status", "--state-dir", str(state), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["heads"]["version"] == 2


def test_status_names_the_cpu_and_the_int8_kernel_measured_on_it(device, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLA_HOME", str(tmp_path / "home"))
    cpu = int8_kernels.cpu_info()
    text = format_status(device_status(device["state"]))
    assert f"cpu: {int8_kernels.describe_cpu(cpu)}; int8 kernel: not measured yet" in text
    key = {"cpu": cpu, "torch": torch.__version__, "threads": 2, "shapes": [[8, 8]]}
    errors, timings = {"onednn": 163840, "int_mm": 0}, {"int_mm": {"1": 0.5, "17": 0.9}}
    int8_kernels.save_report(int8_kernels.KernelReport(key, errors, timings, {"fp32": 41.0, "int_mm": 23.5}))
    status = device_status(device["state"])
    assert status["machine"]["int8_kernel"]["name"] == "int_mm"
    assert "int8 kernel: int_mm (checked exact here; one token fp32 41.0 ms, int_mm 23.5 ms)" in format_status(status)


def test_status_of_an_untrusted_ledger_fails_closed(tmp_path):
    state = tmp_path / "state"
    save_ledger(Ledger(state, runs={"r": PrivacyState("r", 1.0, HISTORY)}))
    (state / StateDir.LEDGER).unlink()  # the marker remembers that the device trained
    result = CliRunner().invoke(app, ["client", "status", "--state-dir", str(state)])
    assert result.exit_code == 1
    assert "lifetime epsilon UNKNOWN" in result.stdout and "reset-ledger" in result.stdout
    missing = CliRunner().invoke(app, ["client", "status", "--state-dir", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and missing.stderr.strip().startswith("error: state folder not found")


def test_status_of_a_device_without_heads_suggests_no_plain_generate(tmp_path):
    """Issue 30 item 4: with no heads yet, status suggested a generate command that could only decode plainly."""
    state = tmp_path / "state"
    save_ledger(Ledger(state, runs={"r": PrivacyState("r", 1.0, HISTORY)}))
    result = CliRunner().invoke(app, ["client", "status", "--state-dir", str(state)])
    assert "heads: none kept yet" in result.stdout
    assert "generate with the newest heads" not in result.stdout
    assert "generate: after the first round delivers heads" in result.stdout


def test_generate_uses_the_daemons_heads(device, tiny_base_dir, monkeypatch, tmp_path):
    state = device["state"]
    args = [
        "generate",
        "--base",
        str(tiny_base_dir),
        "--prompt",
        "import json\n",
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
    ]
    runner = CliRunner()
    result = runner.invoke(app, args + ["--state-dir", str(state)])
    assert result.exit_code == 0, result.output
    assert "[ams]" in result.stderr  # the stats line; the text is on stdout
    assert f"heads: {state / 'heads' / 'latest'} -> {state.resolve() / 'heads' / 'run-8-v2'} (v2" in result.stderr
    # by default: the daemon's default state folder under $FEDLA_HOME (nothing published, no $FEDLA_HEADS)
    home = tmp_path / "home"
    (home / "client").mkdir(parents=True)
    shutil.copytree(state / "heads", home / "client" / "heads", symlinks=True)
    monkeypatch.setenv("FEDLA_HOME", str(home))
    monkeypatch.delenv("FEDLA_HEADS", raising=False)
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"heads: {home / 'client' / 'heads' / 'latest'} -> " in result.stderr and "warning" not in result.stderr
    # a state folder without heads is a one-line error, not plain decoding
    empty = tmp_path / "empty-state"
    empty.mkdir()
    result = runner.invoke(app, args + ["--state-dir", str(empty)])
    assert result.exit_code == 2 and result.stderr.startswith("error: no heads in") and result.stderr.count("\n") == 1


def test_forget_wipes_private_caches_and_keeps_the_ledger(device):
    state = device["state"]
    kept = {name: digest(state / name) for name in (StateDir.LEDGER, StateDir.TRAINED_MARKER)}
    heads = digest(state / "heads" / "latest" / "heads.safetensors")
    epsilon = device_status(state)["privacy"]["epsilon"]
    refused = CliRunner().invoke(app, ["client", "forget", "--state-dir", str(state)])
    assert refused.exit_code == 2 and "add --yes" in refused.stderr and refused.stderr.count("\n") == 1
    assert (state / "chunks").is_dir() and (state / "features").is_dir()  # nothing lost without --yes
    done = CliRunner().invoke(app, ["client", "forget", "--state-dir", str(state), "--yes"])
    assert done.exit_code == 0, done.output
    assert (
        done.stdout.startswith("forgot chunks/, features/")
        and "kept privacy-ledger.json, trained-once, heads" in done.stdout
    )
    assert not (state / "chunks").exists() and not (state / "features").exists()
    assert {name: digest(state / name) for name in kept} == kept
    assert digest(state / "heads" / "latest" / "heads.safetensors") == heads
    after = device_status(state)
    assert after["privacy"]["trusted"] and after["privacy"]["epsilon"] == epsilon  # the spending is not forgotten
    assert forget(state, yes=True).startswith("forgot nothing")


def test_forget_refuses_while_the_daemon_runs(tmp_path):
    import subprocess
    import sys
    import time

    state = tmp_path / "state"
    (state / "chunks").mkdir(parents=True)
    (state / "chunks" / "x.pt").write_bytes(b"private")
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "fedla", "client"])
    cmdline = Path(f"/proc/{daemon.pid}/cmdline")
    for _ in range(100):  # until the child has exec'd (before, its command line is pytest's)
        if b"fedla" in cmdline.read_bytes():
            break
        time.sleep(0.05)
    try:
        (state / "daemon.json").write_text(json.dumps({"status": "connected", "pid": daemon.pid}))
        with pytest.raises(FedLookaheadError, match="stop it first"):
            forget(state, yes=True)
        assert (state / "chunks" / "x.pt").exists()
    finally:
        daemon.kill()
        daemon.wait()
    assert forget(state, yes=True).startswith("forgot chunks/")  # its pid is gone: a stale daemon.json
