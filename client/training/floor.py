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
    MIN_NOISE_COHORT_KEY,
    MIN_NOISE_KEY,
    MIN_USER_SAMPLE_RATE_KEY,
    STATE_DIR_KEY,
    NodeConfig,
)
from common.errors import FedLookaheadError
from common.federation import user_dp
from common.federation.config import MIN_CHUNK_LEN, FedConfig
from common.federation.protocol import (
    USER_DP_BIT_NOISE,
    USER_DP_BIT_SCALE,
    USER_DP_NOISE_COHORT,
    USER_DP_NOISE_MULTIPLIER,
    USER_DP_SAMPLE_RATE,
)


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
    min_noise_cohort: int = NodeConfig.min_noise_cohort  # user-level DP: the fewest noise shares it accepts
    min_user_sample_rate: float = NodeConfig.min_user_sample_rate  # user-level DP: the rate its ledger is charged at

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
            (MIN_NOISE_COHORT_KEY, "min_noise_cohort"),
            (MIN_USER_SAMPLE_RATE_KEY, "min_user_sample_rate"),
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
        if floor.min_noise_cohort != int(floor.min_noise_cohort) or floor.min_noise_cohort < 2:
            raise FedLookaheadError(
                f"node config {MIN_NOISE_COHORT_KEY} must be a whole number of at least 2, got {floor.min_noise_cohort:g}"
            )
        if not 0 < floor.min_user_sample_rate <= 1:
            raise FedLookaheadError(
                f"node config {MIN_USER_SAMPLE_RATE_KEY} must be in (0, 1], got {floor.min_user_sample_rate:g}"
            )
        return replace(floor, min_chunk_len=int(floor.min_chunk_len), min_noise_cohort=int(floor.min_noise_cohort))

    def user_level(self, config: FedConfig, fit_config: Mapping[str, Any]) -> UserNoise | None:
        """The noise this device adds in a user-level round, or None: it trains with its example-level DP-SGD.

        It takes user-level DP only as a noise share of its own, before SecAgg+ masks it, in a sum sized for
        at least `min_noise_cohort` shares; its noise multiplier is at least its floor's and its ledger is
        charged at no less than `min_user_sample_rate`, whatever the server claims.
        """
        if not (config.dp_level == "user" and config.user_dp_noise == "device" and config.secagg):
            return None
        noise = UserNoise.from_fit_config(fit_config)
        if noise is None or noise.shares < self.min_noise_cohort:
            return None
        more = max(1.0, self.min_noise_multiplier / noise.charged)  # more noise on both parts is always safe
        return replace(
            noise,
            noise_multiplier=noise.noise_multiplier * more,
            bit_noise=noise.bit_noise * more,
            sample_rate=max(noise.sample_rate, self.min_user_sample_rate),
        )

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


@dataclass(frozen=True)
class UserNoise:
    """A user-level round's mechanism: noise multiplier z on the sum, the fewest shares the sum is sized for,
    and the sampling rate the accountant is charged at."""

    noise_multiplier: float  # on the update's sum
    shares: int
    sample_rate: float
    bit_noise: float = 0.0  # adaptive clipping: the noise on the sum of centred clip bits (0: a fixed clip)
    bit_scale: float = 0.0  # and the scale the bit travels at (protocol.USER_DP_BIT_SCALE)

    @property
    def charged(self) -> float:
        """The noise multiplier of the one Gaussian mechanism the round amounts to (what the ledger is charged)."""
        if self.bit_noise <= 0:
            return self.noise_multiplier
        return user_dp.combined_noise_multiplier(self.noise_multiplier, self.bit_noise)

    @classmethod
    def from_fit_config(cls, fit_config: Mapping[str, Any]) -> UserNoise | None:
        """The noise settings a train config asks for, or None when they are missing or malformed."""
        try:
            noise = cls(
                float(fit_config[USER_DP_NOISE_MULTIPLIER]),
                int(fit_config[USER_DP_NOISE_COHORT]),
                float(fit_config[USER_DP_SAMPLE_RATE]),
                float(fit_config.get(USER_DP_BIT_NOISE, 0.0)),
                float(fit_config.get(USER_DP_BIT_SCALE, 0.0)),
            )
        except (KeyError, TypeError, ValueError):
            return None
        values = (noise.noise_multiplier, noise.bit_noise, noise.bit_scale)
        if not (all(math.isfinite(v) and v >= 0 for v in values) and noise.noise_multiplier > 0):
            return None
        if noise.shares < 1 or not 0 < noise.sample_rate <= 1 or (noise.bit_noise > 0) != (noise.bit_scale > 0):
            return None
        return noise
