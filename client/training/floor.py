"""A device's privacy floor (`fedla client`: node config `state-dir`): its own settings, which the server's
run config can make stricter but never weaker. DP is always on, delta and the clipping norm are capped,
the noise multiplier has a minimum, and the epsilon budget is the device's lifetime one
(client/training/ledger.py keeps what it has spent)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from client.node_config import (
    BUDGET_KEY,
    MAX_DELTA_KEY,
    MAX_GRAD_NORM_KEY,
    MIN_CHUNK_LEN_KEY,
    MIN_NOISE_KEY,
    STATE_DIR_KEY,
    NodeConfig,
)
from common.errors import FedLookaheadError
from common.federation.config import MIN_CHUNK_LEN, FedConfig


@dataclass(frozen=True)
class DeviceFloor:
    """A device's own privacy settings: the server's run config may be stricter, never weaker."""

    state_dir: Path
    # defaults and meaning: the node-config keys of client/node_config.py
    budget_epsilon: float = NodeConfig.budget_epsilon  # lifetime epsilon at `delta`, over all runs
    delta: float = NodeConfig.max_dp_delta  # the largest delta it accepts (its lifetime epsilon's delta)
    max_grad_norm: float = NodeConfig.max_dp_grad_norm  # the largest per-chunk clipping norm it accepts
    min_noise_multiplier: float = NodeConfig.min_dp_noise_multiplier  # the smallest sigma it trains with
    min_chunk_len: int = NodeConfig.min_chunk_len  # the fewest tokens one privacy unit (a chunk) holds

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> DeviceFloor | None:
        """The floor of a device (its node config has a `state-dir`); None for a simulated client."""
        state_dir = str(node_config.get(STATE_DIR_KEY, "") or "")
        if not state_dir:
            return None
        defaults = cls(Path(state_dir))
        values = {}
        for key, name in (
            (BUDGET_KEY, "budget_epsilon"),
            (MAX_DELTA_KEY, "delta"),
            (MAX_GRAD_NORM_KEY, "max_grad_norm"),
            (MIN_NOISE_KEY, "min_noise_multiplier"),
            (MIN_CHUNK_LEN_KEY, "min_chunk_len"),
        ):
            value = node_config.get(key, getattr(defaults, name))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise FedLookaheadError(f"node config {key} must be a finite number, got {value!r}")
            values[name] = float(value)
        floor = replace(defaults, state_dir=Path(state_dir).expanduser(), **values)
        if not floor.budget_epsilon > 0:
            raise FedLookaheadError(f"node config {BUDGET_KEY} must be positive, got {floor.budget_epsilon:g}")
        if not 0 < floor.delta < 1:
            raise FedLookaheadError(f"node config {MAX_DELTA_KEY} must be in (0, 1), got {floor.delta:g}")
        if not floor.max_grad_norm > 0:
            raise FedLookaheadError(f"node config {MAX_GRAD_NORM_KEY} must be positive, got {floor.max_grad_norm:g}")
        if floor.min_noise_multiplier < 0:
            raise FedLookaheadError(
                f"node config {MIN_NOISE_KEY} must not be negative, got {floor.min_noise_multiplier:g}"
            )
        if floor.min_chunk_len != int(floor.min_chunk_len) or floor.min_chunk_len < MIN_CHUNK_LEN:
            raise FedLookaheadError(
                f"node config {MIN_CHUNK_LEN_KEY} must be a whole number of at least {MIN_CHUNK_LEN} tokens, "
                f"got {floor.min_chunk_len:g}"
            )
        return replace(floor, min_chunk_len=int(floor.min_chunk_len))

    def apply(self, config: FedConfig) -> FedConfig:
        """The run config, made no weaker than this floor (sigma's minimum is applied in train_round)."""
        run_dp = config.dp
        target = config.dp_target_epsilon if run_dp and config.dp_target_epsilon > 0 else self.budget_epsilon
        return replace(
            config,
            dp=True,
            dp_target_epsilon=min(target, self.budget_epsilon),
            dp_delta=config.dp_delta if run_dp and 0 < config.dp_delta < self.delta else self.delta,
            dp_max_grad_norm=min(config.dp_max_grad_norm, self.max_grad_norm),
            dp_noise_multiplier=config.dp_noise_multiplier if run_dp else 0.0,
            # a run asking for 2-token chunks would report the same epsilon for protecting almost nothing
            chunk_len=max(config.chunk_len, self.min_chunk_len),
        )
