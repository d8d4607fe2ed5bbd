"""A node's settings as Flower node config: `NodeConfig`, the single source of its keys, defaults and help.

A device's daemon (`fedla client`) writes them to <state>/node-config.toml (client.daemon.options
says which values) and passes that file to `flower-supernode --node-config <file>`; every ClientApp
of a run reads them from `context.node_config`. A simulated node carries only Flower's own
`partition-id` and `num-partitions`. Node config key = field name with `-` for `_`; a node config
may also override any client-side FedConfig key (common/federation/config.py), which FedConfig reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from common.procs import toml_value


def _key(default: int | float | str, help: str) -> Any:
    """A node-config key: its default and its one line of help."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class NodeConfig:
    """Every node-config key FedLookahead reads or writes; values as the node config gives them."""

    data_dir: str = _key("", "the device's private text folder (client.local_data reads it instead of a partition)")
    state_dir: str = _key(
        "", "the device's state folder (client.state): ledger, heads, chunks, features; empty: a simulated node"
    )
    heads_dir: str = _key("", "where the newest global heads are also published for `fedla generate`")
    device: str = _key("", "auto | cpu | cuda (FedConfig's `device`, overriding the run config)")
    base_model_dir: str = _key("", "the device's base, prepared before joining (client.daemon.readiness)")
    # the device's privacy floor (client.training.floor.DeviceFloor): a run config can only make it stricter
    budget_epsilon: float = _key(8.0, "lifetime epsilon of this device and its data, at max-dp-delta, over all runs")
    max_dp_delta: float = _key(1e-5, "the largest delta it accepts; its lifetime epsilon is accounted at this delta")
    max_dp_grad_norm: float = _key(1.0, "the largest per-chunk clipping norm it accepts")
    min_dp_noise_multiplier: float = _key(0.5, "the smallest sigma it trains with")
    min_chunk_len: int = _key(32, "the fewest tokens one privacy unit (a chunk) holds: epsilon protects a chunk")
    min_noise_cohort: int = _key(
        64, "user-level DP: the fewest noise shares a run may size its sum for (fewer: this device keeps DP-SGD)"
    )
    min_user_sample_rate: float = _key(
        1.0, "user-level DP: the smallest sampling rate its ledger is charged at (1: trusts no claimed population)"
    )
    # Flower's own, in simulations
    partition_id: int = _key(0, "this simulated node's partition of the corpus")
    num_partitions: int = _key(1, "how many partitions the corpus is cut into")

    @classmethod
    def from_mapping(cls, node_config: Mapping[str, Any]) -> NodeConfig:
        """The keys `node_config` sets (unset ones: their defaults; FedConfig's and others are left to them).

        Values are taken as given; their readers convert them (DeviceFloor checks the floor's).
        """
        return cls(**{f.name: node_config[key_of(f.name)] for f in fields(cls) if key_of(f.name) in node_config})


def key_of(name: str) -> str:
    """The node-config key of a NodeConfig field (KeyError for a name that is none)."""
    if name not in {f.name for f in fields(NodeConfig)}:
        raise KeyError(f"NodeConfig has no field {name!r}")
    return name.replace("_", "-")


DATA_DIR_KEY = key_of("data_dir")
STATE_DIR_KEY = key_of("state_dir")
HEADS_DIR_KEY = key_of("heads_dir")
DEVICE_KEY = key_of("device")
BASE_MODEL_DIR_KEY = key_of("base_model_dir")
BUDGET_KEY = key_of("budget_epsilon")
MAX_DELTA_KEY = key_of("max_dp_delta")
MAX_GRAD_NORM_KEY = key_of("max_dp_grad_norm")
MIN_NOISE_KEY = key_of("min_dp_noise_multiplier")
MIN_CHUNK_LEN_KEY = key_of("min_chunk_len")
MIN_NOISE_COHORT_KEY = key_of("min_noise_cohort")
MIN_USER_SAMPLE_RATE_KEY = key_of("min_user_sample_rate")
PARTITION_ID_KEY = key_of("partition_id")
NUM_PARTITIONS_KEY = key_of("num_partitions")


def write_node_config(path: Path, values: dict) -> Path:
    path.write_text("".join(f"{key} = {toml_value(value)}\n" for key, value in values.items()))
    return path
