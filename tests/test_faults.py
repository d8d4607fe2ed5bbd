"""Fault injection lives in simulations/ (a mod the product's ClientApp does not have): its plan, its
mod, and the app copy `flwr run` takes it in."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
from flwr.app import Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.clientapp import ClientApp
from flwr.common import ConfigRecord, Metadata
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.common.secure_aggregation.secaggplus_constants import Stage as SecAggStage

import client.client_app as product
from client.node_config import NUM_PARTITIONS_KEY, PARTITION_ID_KEY
from common.errors import FedLookaheadError
from server.run.folder import RunFolder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # simulations/ is a folder of scripts, not installed
from simulations import faults  # noqa: E402
from simulations.faults import FaultPlan, SimulatedDropout, dropout_mod  # noqa: E402


def test_a_plan_drops_exactly_its_share_of_the_partitions_each_round():
    plan = FaultPlan(dropout_rate=0.3, seed=7)
    dropped = [plan.dropped_partitions(r, 10) for r in range(1, 6)]
    assert all(len(d) == 3 and d <= set(range(10)) for d in dropped)
    assert len({frozenset(d) for d in dropped}) > 1  # a fresh draw each round
    assert dropped == [FaultPlan(dropout_rate=0.3, seed=7).dropped_partitions(r, 10) for r in range(1, 6)]
    assert FaultPlan().dropped_partitions(1, 10) == set()


def test_a_bad_fault_table_is_a_one_line_error():
    with pytest.raises(FedLookaheadError, match="unknown key"):
        FaultPlan.from_table({"droput-rate": 0.3})
    with pytest.raises(FedLookaheadError, match=r"dropout-rate must be in \[0, 1\)"):
        FaultPlan.from_table({"dropout-rate": 1.0})


def message(server_round: int, stage: str | None = None) -> Message:
    content = RecordDict()
    if stage is not None:
        content[RECORD_KEY_CONFIGS] = ConfigRecord({SecAggKey.STAGE: stage})
    metadata = Metadata(
        run_id=1,
        message_id="",
        src_node_id=0,
        dst_node_id=1000,
        reply_to_message_id="",
        group_id=str(server_round),
        created_at=0.0,
        ttl=60.0,
        message_type=MessageType.TRAIN,
    )
    return Message(metadata=metadata, content=content)


def node(partition: int, partitions: int = 4) -> Context:
    return Context(1, 1000 + partition, {PARTITION_ID_KEY: partition, NUM_PARTITIONS_KEY: partitions}, RecordDict(), {})


def test_the_mod_crashes_only_the_planned_clients_and_only_where_training_runs():
    plan = FaultPlan(dropout_rate=0.25)
    [victim] = plan.dropped_partitions(2, 4)
    mod, passed = dropout_mod(plan), []

    def call_next(msg, context):
        passed.append(context.node_id)
        return msg

    with pytest.raises(SimulatedDropout, match="simulated dropout in round 2"):
        mod(message(2), node(victim), call_next)
    with pytest.raises(SimulatedDropout):
        mod(message(2, SecAggStage.COLLECT_MASKED_VECTORS), node(victim), call_next)
    mod(message(2, SecAggStage.SHARE_KEYS), node(victim), call_next)  # it shares its keys first
    for partition in set(range(4)) - {victim}:
        mod(message(2), node(partition), call_next)
    assert passed == [1000 + victim] + [1000 + p for p in sorted(set(range(4)) - {victim})]


def test_the_product_app_has_no_fault_injection_and_the_faulty_app_wraps_it():
    assert not hasattr(product, "SimulatedDropout") and "dropout" not in Path(product.__file__).read_text()
    assert isinstance(faults.faulty_client_app(FaultPlan(0.5)), ClientApp)
    assert isinstance(faults.app, ClientApp)


def test_the_flwr_run_app_copy_differs_only_in_its_clientapp(tmp_path):
    copy = faults.faulty_app_copy(REPO, tmp_path / "app")
    original = (REPO / "pyproject.toml").read_text().splitlines()
    changed = (copy / "pyproject.toml").read_text().splitlines()
    assert [(a, b) for a, b in zip(original, changed) if a != b] == [
        ('clientapp = "client.client_app:app"', f'clientapp = "{faults.FAULTY_CLIENTAPP}"')
    ]
    components = tomllib.loads("\n".join(changed))["tool"]["flwr"]["app"]["components"]
    module, _, attribute = components["clientapp"].partition(":")
    assert (copy / Path(*module.split("."))).with_suffix(".py").is_file() and attribute == "app"
    assert not list(copy.rglob("__pycache__"))


def test_the_flwr_run_mod_reads_the_plan_from_the_run_folder_and_fails_closed_without_one(tmp_path):
    run_config = {"run-dir": str(tmp_path), "run-id": "drop"}
    context = node(0, partitions=2)
    context.run_config = run_config
    with pytest.raises(FedLookaheadError, match="no fault plan at .*faults.json"):
        faults.planned_dropout_mod(message(1), context, lambda m, c: m)
    faults.write_plan(RunFolder(tmp_path / "drop"), FaultPlan(dropout_rate=0.5, seed=3))
    assert faults.read_plan(run_config) == FaultPlan(dropout_rate=0.5, seed=3)
    crashed = []
    for partition in (0, 1):
        context = node(partition, partitions=2)
        context.run_config = run_config
        try:
            faults.planned_dropout_mod(message(1), context, lambda m, c: m)
        except SimulatedDropout:
            crashed.append(partition)
    assert crashed == sorted(FaultPlan(dropout_rate=0.5, seed=3).dropped_partitions(1, 2))


def test_the_runner_warns_when_the_plan_exceeds_what_secagg_tolerates_and_names_a_bad_table(tmp_path, capsys):
    from simulations import run as runner

    config = {"secagg": True, "min-train-clients": 4, "min-available-clients": 4}
    runner.warn_if_secagg_cannot_survive(FaultPlan(dropout_rate=0.25), config, 4)  # 1 of 4: tolerated
    assert capsys.readouterr().err == ""
    runner.warn_if_secagg_cannot_survive(FaultPlan(dropout_rate=0.75), config, 4)
    assert "drops about 3 of 4 clients, more than the 2 SecAgg+ tolerates" in capsys.readouterr().err
    argv = ["dropout", "--run-dir", str(tmp_path), "--run-id", "bad", "--set", "min-train-clients=99"]
    assert runner.main(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: min-train-clients (99)")
