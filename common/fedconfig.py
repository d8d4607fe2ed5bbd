"""The federated run's knobs: one table, read by the ServerApp and every ClientApp.

`DEFAULTS` mirrors `[tool.flwr.app.config]` in pyproject.toml (a test keeps the two equal); Flower
hands the merged run config (pyproject defaults + `flwr run --run-config` overrides) to both sides
as `context.run_config`. A real device may override any client-side key in its node config
(`flower-supernode --node-config "max-chunks-per-client=512 ..."`); its privacy settings are a floor
the run cannot lower (client.privacy.DeviceFloor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from common.base import FedLookaheadError

DEFAULTS: dict[str, bool | int | float | str] = {
    # rounds and sampling
    "num-server-rounds": 3,
    "clients-per-round": 0,  # > 0: exactly this many clients per round; 0: use fraction-train
    "fraction-train": 1.0,
    "min-train-clients": 2,
    "min-available-clients": 2,
    "fraction-evaluate": 1.0,  # 0: no client-side evaluation
    "node-wait-seconds": 60.0,  # how long the server waits for min-available-clients nodes to connect
    "round-timeout": 900.0,  # seconds per message exchange; 0: wait forever
    # local training
    "local-epochs": 1,
    "lr": 0.001,
    "batch-size": 16,  # expected (Poisson) batch size
    "chunk-len": 128,
    "num-heads": 4,
    "max-chunks-per-client": 256,  # 0: all of the partition
    "local-heldout-fraction": 0.1,  # share of a client's chunks kept for its local evaluation
    # differential privacy (Opacus, per client, one chunk = one privacy unit)
    "dp": True,
    "dp-target-epsilon": 8.0,
    "dp-delta": 1e-5,
    "dp-noise-multiplier": 0.0,  # > 0: use this sigma instead of calibrating one to dp-target-epsilon
    "dp-max-grad-norm": 1.0,
    "dp-planned-rounds": 0,  # rounds a client plans to take part in (sigma calibration); 0: num-server-rounds
    "dp-level": "example",  # example: Opacus DP-SGD per chunk | user: clipped client updates + server noise
    "dp-user-clip": 0.1,  # dp-level=user: L2 bound of one client's update per round
    "dp-trainable": "all",  # head parameters clients train: all | fusion | blocks
    "server-optimizer": "fedavg",  # fedavg | fedavgm | fedadam over the mean update (server/server_optimizer.py)
    "server-lr": 1.0,
    "server-momentum": 0.9,
    # secure aggregation (Flower SecAgg+)
    "secagg": True,
    "secagg-num-shares": 1.0,  # float: share of the sampled clients; int > 2: a count
    "secagg-reconstruction-threshold": 0.5,  # float: share of num-shares; int: a count
    "secagg-clipping-range": 8.0,
    "secagg-quantization-range": 4194304,
    "secagg-max-weight": 1000.0,  # client weights (train chunks) are capped at this
    # data
    "partitioning": "iid",  # iid | dirichlet | package
    "dirichlet-alpha": 0.5,
    "data-source": "stdlib",  # "stdlib" (train split) or a folder of text files shared by the simulation
    # models, outputs
    "base-model-dir": "",  # "": the embedded default base
    "init-heads": "",  # "": fresh heads; else a DraftHeads directory to start from
    "run-dir": "runs",  # runs/<run-id>/ holds summary.json, rounds/, checkpoints/
    "run-id": "",  # "": <UTC time>-<Flower run id>
    "resume-from": "",  # a previous runs/<run-id> folder: continue after its last checkpoint
    "store-url": "",  # "": $FEDLA_DB or <run-dir>/fedla.db
    # evaluation
    "server-eval-chunks": 64,
    "eval-prompts": 4,
    "eval-prompt-len": 32,
    "eval-max-new-tokens": 32,
    "client-eval-prompts": 2,
    # simulation and devices
    "dropout-rate": 0.0,  # simulation only: this share of sampled clients crashes mid-round
    "client-state-dir": "",  # simulation: persist each client's privacy accountant under here
    "seed": 0,
    "device": "cpu",
}

PARTITIONINGS = ("iid", "dirichlet", "package")
DP_LEVELS = ("example", "user")
DP_TRAINABLE = ("all", "fusion", "blocks")
SERVER_OPTIMIZERS = ("fedavg", "fedavgm", "fedadam")


@dataclass(frozen=True)
class FedConfig:
    num_server_rounds: int
    clients_per_round: int
    fraction_train: float
    min_train_clients: int
    min_available_clients: int
    fraction_evaluate: float
    node_wait_seconds: float
    round_timeout: float
    local_epochs: int
    lr: float
    batch_size: int
    chunk_len: int
    num_heads: int
    max_chunks_per_client: int
    local_heldout_fraction: float
    dp: bool
    dp_target_epsilon: float
    dp_delta: float
    dp_noise_multiplier: float
    dp_max_grad_norm: float
    dp_planned_rounds: int
    dp_level: str
    dp_user_clip: float
    dp_trainable: str
    server_optimizer: str
    server_lr: float
    server_momentum: float
    secagg: bool
    secagg_num_shares: int | float
    secagg_reconstruction_threshold: int | float
    secagg_clipping_range: float
    secagg_quantization_range: int
    secagg_max_weight: float
    partitioning: str
    dirichlet_alpha: float
    data_source: str
    base_model_dir: str
    init_heads: str
    run_dir: str
    run_id: str
    resume_from: str
    store_url: str
    server_eval_chunks: int
    eval_prompts: int
    eval_prompt_len: int
    eval_max_new_tokens: int
    client_eval_prompts: int
    dropout_rate: float
    client_state_dir: str
    seed: int
    device: str

    @classmethod
    def from_mapping(cls, run_config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> FedConfig:
        """Defaults, then the run config, then (device) overrides; unknown keys in the run config are an error."""
        merged: dict[str, Any] = dict(DEFAULTS)
        unknown = sorted(set(run_config) - set(DEFAULTS))
        if unknown:
            raise FedLookaheadError(f"unknown run-config key(s) {unknown}; known keys are listed in pyproject.toml")
        merged.update(run_config)
        for key, value in (overrides or {}).items():
            if key in DEFAULTS:  # node configs also carry Flower's own keys (partition-id, ...)
                merged[key] = value
        values = {}
        for key, default in DEFAULTS.items():
            values[key.replace("-", "_")] = _coerce(key, merged[key], default)
        config = cls(**values)
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}

    @property
    def planned_rounds(self) -> int:
        return self.dp_planned_rounds or self.num_server_rounds

    def validate(self) -> None:
        positive = {
            "num-server-rounds": self.num_server_rounds,
            "local-epochs": self.local_epochs,
            "batch-size": self.batch_size,
            "num-heads": self.num_heads,
            "min-train-clients": self.min_train_clients,
            "min-available-clients": self.min_available_clients,
            "dp-max-grad-norm": self.dp_max_grad_norm,
            "secagg-clipping-range": self.secagg_clipping_range,
            "secagg-max-weight": self.secagg_max_weight,
            "lr": self.lr,
        }
        for key, value in positive.items():
            if not value > 0:
                raise FedLookaheadError(f"{key} must be positive, got {value}")
        if self.chunk_len < 8:
            raise FedLookaheadError(f"chunk-len must be at least 8 tokens, got {self.chunk_len}")
        if not 0 < self.fraction_train <= 1:
            raise FedLookaheadError(f"fraction-train must be in (0, 1], got {self.fraction_train}")
        if not 0 <= self.fraction_evaluate <= 1:
            raise FedLookaheadError(f"fraction-evaluate must be in [0, 1], got {self.fraction_evaluate}")
        if not 0 <= self.dropout_rate < 1:
            raise FedLookaheadError(f"dropout-rate must be in [0, 1), got {self.dropout_rate}")
        if not 0 <= self.local_heldout_fraction < 1:
            raise FedLookaheadError(f"local-heldout-fraction must be in [0, 1), got {self.local_heldout_fraction}")
        if self.min_train_clients > self.min_available_clients:
            raise FedLookaheadError(
                f"min-train-clients ({self.min_train_clients}) exceeds min-available-clients "
                f"({self.min_available_clients}): the round could never start"
            )
        if self.dp:
            if not 0 < self.dp_delta < 1:
                raise FedLookaheadError(f"dp-delta must be in (0, 1), got {self.dp_delta}")
            if self.dp_noise_multiplier <= 0 and not self.dp_target_epsilon > 0:
                raise FedLookaheadError("set dp-target-epsilon > 0 or dp-noise-multiplier > 0 (or dp=false)")
        for key, value, allowed in (("dp-level", self.dp_level, DP_LEVELS), ("dp-trainable", self.dp_trainable, DP_TRAINABLE),
                                    ("server-optimizer", self.server_optimizer, SERVER_OPTIMIZERS)):
            if value not in allowed:
                raise FedLookaheadError(f"unknown {key} {value!r}: use one of {allowed}")
        if self.dp and self.dp_level == "user" and not self.dp_user_clip > 0:
            raise FedLookaheadError(f"dp-user-clip must be positive, got {self.dp_user_clip}")
        if not self.server_lr > 0 or not 0 <= self.server_momentum < 1:
            raise FedLookaheadError("server-lr must be positive and server-momentum in [0, 1)")
        if self.partitioning not in PARTITIONINGS:
            raise FedLookaheadError(f"unknown partitioning {self.partitioning!r}: use one of {PARTITIONINGS}")
        if self.secagg:
            shares, threshold = self.secagg_num_shares, self.secagg_reconstruction_threshold
            if isinstance(shares, float) and not 0 < shares <= 1:
                raise FedLookaheadError(f"secagg-num-shares as a share must be in (0, 1], got {shares}")
            if isinstance(shares, int) and shares <= 2:
                raise FedLookaheadError(f"secagg-num-shares as a count must be > 2, got {shares}")
            if isinstance(threshold, float) and not 0 < threshold <= 1:
                raise FedLookaheadError(f"secagg-reconstruction-threshold as a share must be in (0, 1], got {threshold}")
            if isinstance(threshold, int) and isinstance(shares, int) and threshold >= shares:
                raise FedLookaheadError(
                    f"secagg-reconstruction-threshold ({threshold}) must be below secagg-num-shares ({shares})"
                )
            if self.secagg_quantization_range <= 0 or 2**32 <= self.secagg_quantization_range:
                raise FedLookaheadError("secagg-quantization-range must be in (0, 2**32)")

    def clients_this_round(self, available: int) -> int:
        """How many clients a round samples out of `available` (never fewer than min-train-clients)."""
        wanted = self.clients_per_round or int(available * self.fraction_train)
        return max(wanted, self.min_train_clients)

    def secagg_tolerated_dropouts(self, sampled: int) -> int:
        """Dropouts SecAgg+ survives in a round of `sampled` clients (Flower's own share arithmetic)."""
        shares, threshold = secagg_shares_and_threshold(self, sampled)
        return max(0, min(shares, sampled) - threshold)


def secagg_shares_and_threshold(config: FedConfig, sampled: int) -> tuple[int, int]:
    """The (num_shares, threshold) SecAggPlusWorkflow.setup_stage derives for `sampled` clients."""
    shares_cfg, threshold_cfg = config.secagg_num_shares, config.secagg_reconstruction_threshold
    if isinstance(shares_cfg, float):
        shares = round(shares_cfg * sampled)
        if shares < sampled and shares & 1 == 0:
            shares += 1
        if shares <= 2:
            shares = sampled
    else:
        shares = shares_cfg
    if sampled != shares and shares & 1 == 0:
        shares += 1
    if isinstance(threshold_cfg, float):
        threshold = max(round(threshold_cfg * shares), 2)
    else:
        threshold = threshold_cfg
    return shares, threshold


def _coerce(key: str, value: Any, default: Any) -> Any:
    """The value with the default's type; int/float keep their own type where both make sense."""
    if key in ("secagg-num-shares", "secagg-reconstruction-threshold"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FedLookaheadError(f"{key} must be a number, got {value!r}")
        return value  # int: a count, float: a share (Flower's own convention)
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise FedLookaheadError(f"{key} must be true or false, got {value!r}")
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise FedLookaheadError(f"{key} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise FedLookaheadError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise FedLookaheadError(f"{key} must be a string, got {value!r}")
    return value
