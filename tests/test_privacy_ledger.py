"""A device's privacy is its own: a floor the run config cannot lower, and one lifetime ledger that a lost
or replaced file cannot reset silently (client.training, client.daemon)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict
from opacus.accountants import RDPAccountant

from client.base_cache import cached_base
from client.client_app import client_config, train_handler
from client.daemon import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    DaemonError,
    DaemonOptions,
    preflight,
    reset_ledger_command,
)
from client.local_data import client_data
from client.node_config import (
    BUDGET_KEY,
    MAX_DELTA_KEY,
    MAX_GRAD_NORM_KEY,
    MIN_CHUNK_LEN_KEY,
    MIN_NOISE_KEY,
    NUM_PARTITIONS_KEY,
    PARTITION_ID_KEY,
    STATE_DIR_KEY,
)
from client.state import StateDir
from client.training.dp import epsilon_of, plan
from client.training.ledger import LedgerError, load_ledger, reset_ledger
from common.data.chunks import stdlib_dir
from common.errors import FedLookaheadError
from common.federation.records import heads_config_dict, heads_to_ndarrays
from common.heads.lookahead import DraftHeads

RUN = {
    "chunk-len": 32,
    "max-chunks-per-client": 12,
    "num-heads": 2,
    "batch-size": 4,
    "num-server-rounds": 2,
    "data-source": str(stdlib_dir() / "json"),
}


def _device(tiny_base_dir: Path, state: Path, run: dict | None = None, **floor) -> Context:
    """A device's context: node config with a state-dir (as `fedla client` writes it) and its privacy floor."""
    node_config = {STATE_DIR_KEY: str(state), PARTITION_ID_KEY: 0, NUM_PARTITIONS_KEY: 1, **floor}
    return Context(
        run_id=7,
        node_id=3,
        node_config=node_config,
        state=RecordDict(),
        run_config={"base-model-dir": str(tiny_base_dir), **RUN, **(run or {})},
    )


def _train(context: Context, heads: DraftHeads, run_key: str) -> dict:
    """One round on the device; its whole account of it, as its own event log keeps it (the server gets less)."""
    fit_config = {**heads_config_dict(heads), "fedla-run-id": run_key, "server-round": 1}
    sent = train_handler(fit_config, heads_to_ndarrays(heads), context).metrics
    if STATE_DIR_KEY not in context.node_config:  # a simulated client keeps no log: it reports everything
        return sent
    events = (Path(context.node_config[STATE_DIR_KEY]) / "events.jsonl").read_text().splitlines()
    kept = [json.loads(line)["metrics"] for line in events if json.loads(line)["event"] == "train-done"]
    mine = next(
        m for m in reversed(kept) if m["epsilon"] == sent["epsilon"] and m["skip-reason"] == sent["skip-reason"]
    )
    assert {k: mine[k] for k in sent} == sent  # what was sent is a part of what the device knows
    return mine


def test_device_floor_beats_a_weaker_run_config(tiny_base, tiny_base_dir, tmp_path):
    floor = {MAX_DELTA_KEY: 1e-5, MAX_GRAD_NORM_KEY: 1.0, MIN_NOISE_KEY: 0.8, BUDGET_KEY: 50.0}
    weak = {"dp": False, "dp-delta": 0.5, "dp-max-grad-norm": 100.0}
    context = _device(tiny_base_dir, tmp_path / "state", weak, **floor)
    config = client_config(context)
    assert (config.dp, config.dp_delta, config.dp_max_grad_norm) == (True, 1e-5, 1.0)
    metrics = _train(context, DraftHeads.fresh(tiny_base, 2), "no-dp-run")
    assert metrics["skipped"] == 0 and metrics["dp"] == 1 and metrics["delta"] == 1e-5
    assert metrics["noise-multiplier"] >= 0.8
    # a run asking for a tiny sigma and a large delta gets the device's minimum sigma, accounted at its delta
    context = _device(tiny_base_dir, tmp_path / "state-2", {"dp-noise-multiplier": 0.1, "dp-delta": 0.5}, **floor)
    metrics = _train(context, DraftHeads.fresh(tiny_base, 2), "weak-sigma-run")
    assert metrics["noise-multiplier"] == 0.8 and metrics["delta"] == 1e-5
    assert metrics["epsilon"] == pytest.approx(epsilon_of([(0.8, metrics["q"], metrics["steps"])], 1e-5))


def test_the_privacy_unit_is_the_devices_to_bound(tiny_base_dir, tmp_path):
    """Issue 29: chunk-len, the tokens one epsilon protects, came from the run config alone: a server asking
    for 8-token chunks got the same epsilon reported for protecting a quarter of the text per unit."""
    context = _device(tiny_base_dir, tmp_path / "state", {"chunk-len": 8})
    assert client_config(context).chunk_len == 32  # the floor's default
    context = _device(tiny_base_dir, tmp_path / "state", {"chunk-len": 48}, **{MIN_CHUNK_LEN_KEY: 64})
    assert client_config(context).chunk_len == 64
    assert client_config(_device(tiny_base_dir, tmp_path / "state", {"chunk-len": 96})).chunk_len == 96  # stricter
    for bad in (4, 40.5):
        with pytest.raises(FedLookaheadError, match="min-chunk-len must be a whole number of at least 8 tokens"):
            client_config(_device(tiny_base_dir, tmp_path / "state", **{MIN_CHUNK_LEN_KEY: bad}))


def test_budget_is_the_devices_across_runs(tiny_base, tiny_base_dir, tmp_path):
    """Two rounds of run A fit the budget; a new run B does not start a fresh one."""
    state = tmp_path / "state"
    probe = _device(tiny_base_dir, state)
    config = client_config(probe)
    q, steps = plan(config, len(client_data(config, cached_base(config), dict(probe.node_config)).train))
    continuous = RDPAccountant()
    for _ in range(2 * steps):
        continuous.step(noise_multiplier=1.0, sample_rate=q)
    budget = continuous.get_epsilon(1e-5) + 1e-3
    heads = DraftHeads.fresh(tiny_base, 2)
    run = {"dp-noise-multiplier": 1.0}
    for _ in range(2):
        metrics = _train(_device(tiny_base_dir, state, run, **{BUDGET_KEY: budget}), heads, "run-a")
        assert metrics["skipped"] == 0
    assert metrics["epsilon"] == pytest.approx(continuous.get_epsilon(1e-5), rel=1e-9)  # Opacus over both rounds
    metrics = _train(_device(tiny_base_dir, state, run, **{BUDGET_KEY: budget}), heads, "run-b")
    assert metrics["skipped"] == 1 and "lifetime epsilon" in metrics["skip-reason"]
    assert metrics["epsilon"] == pytest.approx(continuous.get_epsilon(1e-5), rel=1e-9)
    ledger = json.loads((state / StateDir.LEDGER).read_text())
    assert list(ledger["runs"]) == ["run-a"] and sorted(p.name for p in state.glob("privacy*")) == [StateDir.LEDGER]
    # with room for it, run B trains and both runs compose in the one ledger
    metrics = _train(_device(tiny_base_dir, state, run, **{BUDGET_KEY: 100.0}), heads, "run-b")
    assert metrics["skipped"] == 0
    for _ in range(steps):
        continuous.step(noise_multiplier=1.0, sample_rate=q)
    assert metrics["epsilon"] == pytest.approx(continuous.get_epsilon(1e-5), rel=1e-9)
    assert load_ledger(state).steps == 3 * steps


def test_a_lost_ledger_stops_training_until_reset(tiny_base, tiny_base_dir, tmp_path, capsys):
    state = tmp_path / "state"
    heads = DraftHeads.fresh(tiny_base, 2)
    assert _train(_device(tiny_base_dir, state), heads, "run-a")["skipped"] == 0
    assert (state / StateDir.TRAINED_MARKER).is_file()
    ledger_file = state / StateDir.LEDGER
    good = ledger_file.read_text()
    emptied = json.loads(good)
    emptied["runs"]["run-a"]["history"] = []
    replaced = {**emptied, "runs": {"another-run": {"noise_multiplier": 1.0, "history": []}}}
    corrupt = '{"format": "fedla-privacy-ledger/1", "ru'
    cases = [
        ("missing but this device has trained", None),
        ("holds 0 DP-SGD steps", json.dumps(emptied)),
        ("holds 0 DP-SGD steps", json.dumps(replaced)),
        ("unreadable", corrupt),
    ]
    for expected, text in cases:
        if text is None:
            ledger_file.unlink()
        else:
            ledger_file.write_text(text)
        with pytest.raises(LedgerError, match=expected) as caught:
            load_ledger(state)
        assert "\n" not in str(caught.value) and "reset-ledger --state-dir" in str(caught.value)
        metrics = _train(_device(tiny_base_dir, state), heads, "run-b")  # declines; never trains on 0
        assert metrics["skipped"] == 1 and expected in metrics["skip-reason"]
        assert metrics["epsilon"] == float("inf")
        opts = DaemonOptions(superlink="127.0.0.1:9092", data=stdlib_dir() / "json", state_dir=state, insecure=True)
        with pytest.raises(DaemonError, match=expected) as caught:  # `fedla client` does not even start
            preflight(opts)
        assert "\n" not in str(caught.value)

    # resetting is deliberate: without --yes nothing changes, and the message says what it means
    assert reset_ledger_command(state, yes=False) == EXIT_BAD_INPUT
    assert "does not go away" in capsys.readouterr().err
    with pytest.raises(FedLookaheadError, match="forgets this device's past privacy spending"):
        reset_ledger(state, yes=False)
    assert ledger_file.read_text() == corrupt
    assert reset_ledger_command(state, yes=True) == EXIT_OK
    assert "reset: past spending forgotten" in capsys.readouterr().out
    assert [p.read_text() for p in state.glob(f"{StateDir.LEDGER}.reset-*")] == [corrupt]
    assert load_ledger(state).resets[0]["forgotten_steps"] > 0
    assert _train(_device(tiny_base_dir, state), heads, "run-b")["skipped"] == 0


def test_simulated_clients_keep_the_run_config(tiny_base, tiny_base_dir):
    """No state-dir: the run config governs (dp=false trains without DP, as the simulations expect)."""
    context = Context(
        run_id=7,
        node_id=3,
        node_config={PARTITION_ID_KEY: 0, NUM_PARTITIONS_KEY: 1},
        state=RecordDict(),
        run_config={"base-model-dir": str(tiny_base_dir), **RUN, "dp": False},
    )
    metrics = _train(context, DraftHeads.fresh(tiny_base, 2), "sim")
    assert metrics["dp"] == 0 and metrics["epsilon"] == float("inf") and metrics["skipped"] == 0


def test_two_rounds_at_once_on_one_state_folder_both_reach_the_ledger(tiny_base, tiny_base_dir, tmp_path, monkeypatch):
    """Issue 29 item 1: two concurrent rounds (runs A and B) both read the ledger before either wrote it, and
    the ledger kept only B's steps (6 recorded where 9 were spent). The round now holds the ledger lock from
    reading to writing, so the second waits for the first and composes on top of it."""
    import threading
    import time

    import client.training.local_round as local_round

    real_train_round = local_round.train_round

    def slow_train_round(*args, **kwargs):
        result = real_train_round(*args, **kwargs)
        time.sleep(0.5)  # both rounds would be past their ledger read by now without the lock
        return result

    state = tmp_path / "state"
    # a first round loads the base and caches the features (real rounds run in separate processes, each with
    # its own copy; threads of one process would share a half-loaded base)
    results: dict[str, dict] = {
        "run-0": _train(_device(tiny_base_dir, state, **{BUDGET_KEY: 100.0}), DraftHeads.fresh(tiny_base, 2), "run-0")
    }
    monkeypatch.setattr(local_round, "train_round", slow_train_round)

    def round_of(run_key: str) -> None:
        try:
            results[run_key] = _train(
                _device(tiny_base_dir, state, **{BUDGET_KEY: 100.0}), DraftHeads.fresh(tiny_base, 2), run_key
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            results[run_key] = {"error": repr(exc)}

    threads = [threading.Thread(target=round_of, args=(key,)) for key in ("run-a", "run-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(m.get("skipped") == 0 for m in results.values()), results
    ledger = load_ledger(state)
    assert sorted(ledger.runs) == ["run-0", "run-a", "run-b"]
    assert ledger.steps == sum(m["steps"] for m in results.values())
    # whichever went second reports the lifetime epsilon of both
    assert max(m["epsilon"] for m in results.values()) == pytest.approx(epsilon_of(ledger.history(), 1e-5))


def test_a_killed_writers_temporary_ledger_is_cleaned_up(tiny_base, tiny_base_dir, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    stale = [state / f".{StateDir.LEDGER}.99999.tmp", state / f".{StateDir.TRAINED_MARKER}.99999.tmp"]
    for path in stale:
        path.write_text('{"half": ')
    assert _train(_device(tiny_base_dir, state), DraftHeads.fresh(tiny_base, 2), "run-a")["skipped"] == 0
    assert not any(path.exists() for path in stale)
    assert load_ledger(state).steps > 0


def test_a_second_daemon_on_the_same_state_folder_is_refused(tiny_base_dir, tmp_path):
    """Issue 29 item 1: a second `fedla client` on one --state-dir started without complaint."""
    from client.daemon import ClientDaemon
    from client.state import state_lock

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    state = tmp_path / "state"
    opts = DaemonOptions(superlink="127.0.0.1:9092", data=data, base=tiny_base_dir, device="cpu", state_dir=state)
    with state_lock(state, StateDir.DAEMON_LOCK):  # what the first daemon holds while it runs
        with pytest.raises(DaemonError, match=r"another fedla client is running on state folder .*process \d+"):
            ClientDaemon(opts, emit=lambda line: None).run()
