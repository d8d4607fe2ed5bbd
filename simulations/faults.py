"""Fault injection for simulations: a ClientApp mod that makes a share of the clients crash mid-round.

The product's ClientApp knows nothing of it: simulations compose this mod outside the product's own
(`faulty_client_app`), as Flower's examples compose mods. A scenario asks for it with a `[faults]` table
(simulations/scenarios/dropout.toml); the runner writes that table into the run's folder (`faults.json`)
and runs `flwr run` on a copy of the app whose ClientApp is this module's `app`, which reads the table
through the run config's run-dir and run-id. The in-process grid takes `faulty_client_app(plan)` directly.

A dropping client crashes when its training starts: under SecAgg+ that is the collect-masked-vectors
stage, after it shared its keys, the case SecAgg+ exists to survive.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from flwr.app import Context, Message
from flwr.app.message_type import MessageType
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import Stage as SecAggStage

from client.client_app import client_app
from client.node_config import NUM_PARTITIONS_KEY, PARTITION_ID_KEY
from client.secagg import secagg_stage
from common.errors import FedLookaheadError
from server.run.folder import RunFolder

FAULTY_CLIENTAPP = "simulations.faults:app"  # the clientapp component of the runner's faulty app copy
APP_PACKAGES = ("client", "common", "server", "simulations")  # what the copy holds beside pyproject.toml


class SimulatedDropout(RuntimeError):
    """Raised on purpose: the client vanishes mid-round (after SecAgg+ key sharing)."""


@dataclass(frozen=True)
class FaultPlan:
    """Which clients crash. Each round, `dropout_rate` of the partitions (rounded; a fresh draw per round,
    seeded) crash when asked to train: with every client sampled, exactly that share of the round."""

    dropout_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.dropout_rate < 1:
            raise FedLookaheadError(f"faults: dropout-rate must be in [0, 1), got {self.dropout_rate}")

    @classmethod
    def from_table(cls, table: dict) -> FaultPlan:
        known = {"dropout-rate", "seed"}
        if set(table) - known:
            raise FedLookaheadError(f"faults: unknown key(s) {sorted(set(table) - known)}; known: {sorted(known)}")
        return cls(dropout_rate=float(table.get("dropout-rate", 0.0)), seed=int(table.get("seed", 0)))

    @property
    def injects(self) -> bool:
        return self.dropout_rate > 0

    def dropped_partitions(self, server_round: int, num_partitions: int) -> set[int]:
        count = int(round(self.dropout_rate * num_partitions))
        return set(random.Random(f"{self.seed}:{server_round}").sample(range(num_partitions), count))

    def drops(self, server_round: int, node_config: dict) -> bool:
        partition, partitions = int(node_config[PARTITION_ID_KEY]), int(node_config[NUM_PARTITIONS_KEY])
        return partition in self.dropped_partitions(server_round, partitions)


def is_training_step(msg: Message) -> bool:
    """A plain FedAvg train message, or SecAgg+'s collect-masked-vectors stage (where training runs)."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return False
    return secagg_stage(msg) in (None, SecAggStage.COLLECT_MASKED_VECTORS)


def crash_if_planned(msg: Message, context: Context, plan_of: Callable[[], FaultPlan]) -> None:
    """Raise SimulatedDropout where the plan says this node crashes (asked for only at training steps;
    the round is the message's group id, as Flower's workflows set it)."""
    if not is_training_step(msg):
        return
    plan, server_round = plan_of(), int(msg.metadata.group_id or 0)
    if plan.drops(server_round, context.node_config):
        raise SimulatedDropout(f"simulated dropout in round {server_round} (dropout-rate={plan.dropout_rate})")


def dropout_mod(plan: FaultPlan):
    """A Flower mod: crash instead of training where `plan` says so."""

    def mod(msg: Message, context: Context, call_next):
        crash_if_planned(msg, context, lambda: plan)
        return call_next(msg, context)

    return mod


def faulty_client_app(plan: FaultPlan) -> ClientApp:
    """The product's ClientApp with the fault mod outside its own mods."""
    return client_app(mods=[dropout_mod(plan)])


# -- the `flwr run` path: the plan travels in the run folder, the ClientApp in a copy of the app


def write_plan(run_folder: RunFolder, plan: FaultPlan) -> None:
    run_folder.path.mkdir(parents=True, exist_ok=True)
    run_folder.faults.write_text(json.dumps(asdict(plan)))


def read_plan(run_config: dict) -> FaultPlan:
    folder = RunFolder(Path(str(run_config["run-dir"])) / str(run_config["run-id"]))
    try:
        return FaultPlan(**json.loads(folder.faults.read_text()))
    except FileNotFoundError:  # a plan lost is a run without faults, which would pass for a dropout test
        raise FedLookaheadError(f"no fault plan at {folder.faults}: run it with python -m simulations.run") from None


def planned_dropout_mod(msg: Message, context: Context, call_next):
    """`dropout_mod` with the plan the runner left in this run's folder (read at training steps only)."""
    crash_if_planned(msg, context, lambda: read_plan(dict(context.run_config)))
    return call_next(msg, context)


app = client_app(mods=[planned_dropout_mod])


def faulty_app_copy(repo: Path, dest: Path) -> Path:
    """A copy of the Flower App at `repo` whose ClientApp is FAULTY_CLIENTAPP (`flwr run` takes its
    components from the app's pyproject.toml only)."""
    pyproject = (repo / "pyproject.toml").read_text()
    product = 'clientapp = "client.client_app:app"'
    if pyproject.count(product) != 1:
        raise FedLookaheadError(f"pyproject.toml does not name the ClientApp as {product}")
    if dest.exists():
        shutil.rmtree(dest)
    for package in APP_PACKAGES:
        shutil.copytree(repo / package, dest / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (dest / "pyproject.toml").write_text(pyproject.replace(product, f'clientapp = "{FAULTY_CLIENTAPP}"'))
    return dest
