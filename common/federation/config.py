"""The federated run's knobs: `FedConfig`, the single source of their defaults and help text.

Flower reads the defaults from `[tool.flwr.app.config]` in pyproject.toml, so that table must exist; a
test checks it line by line (key, value, comment) against `FedConfig`. Flower hands the merged run
config (pyproject defaults + `flwr run --run-config` overrides) to both sides as `context.run_config`.
A real device may override any client-side key in its node config (`flower-supernode --node-config
"max-chunks-per-client=512 ..."`); its privacy settings are a floor the run cannot lower
(client.training.floor.DeviceFloor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from common.errors import FedLookaheadError

MIN_CHUNK_LEN = 8  # the shortest chunk (privacy unit) any run or device floor may use

PARTITIONINGS = ("iid", "dirichlet", "package", "user")
DP_LEVELS = ("example", "user")
USER_DP_NOISE = ("device", "server")  # common/federation/user_dp.py
DP_TRAINABLE = ("all", "fusion", "blocks", "lowrank")
SERVER_OPTIMIZERS = ("fedavg", "fedavgm", "fedadam")
CLIENT_OPTIMIZERS = ("adamw", "public-sgd")
HEADS_CODECS = ("float32", "float16", "int8")  # common/federation/wire.py


def _knob(default: bool | int | float | str, help: str) -> Any:
    """A run-config key: its default and the one line of help pyproject.toml repeats."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class FedConfig:
    """Every knob of a federated run; run-config key = field name with `-` for `_`."""

    # rounds and sampling
    num_server_rounds: int = _knob(3, "federated rounds")
    clients_per_round: int = _knob(0, "> 0: exactly this many clients per round; 0: fraction-train of the nodes")
    fraction_train: float = _knob(1.0, "share of nodes sampled per round (when clients-per-round = 0)")
    min_train_clients: int = _knob(2, "never sample fewer (validated against the node count up front)")
    min_available_clients: int = _knob(2, "nodes that must be connected before round 1")
    fraction_evaluate: float = _knob(1.0, "share of nodes that evaluate the new heads each round (0: none)")
    node_wait_seconds: float = _knob(60.0, "how long to wait for min-available-clients nodes")
    round_timeout: float = _knob(900.0, "seconds per message exchange (SecAgg+ stage, evaluation); 0: wait forever")

    # local training
    local_epochs: int = _knob(1, "epochs over the client's chunks per round")
    lr: float = _knob(0.001, "learning rate of the client optimizer (public-sgd wants about 1e-4)")
    client_optimizer: str = _knob(
        "adamw",
        "adamw | public-sgd: SGD with per-coordinate steps from public gradients, sent by the server "
        "(common/training/preconditioner.py; the user-level DP client)",
    )
    batch_size: int = _knob(16, "expected (Poisson-sampled) batch size")
    chunk_len: int = _knob(128, "tokens per chunk (one chunk = one DP privacy unit)")
    num_heads: int = _knob(4, "K lookahead heads")
    max_chunks_per_client: int = _knob(256, "cap on a client's chunks (seeded sample); 0: its whole partition")
    local_heldout_fraction: float = _knob(0.1, "share of a client's chunks kept for its local evaluation")

    # differential privacy (Opacus on each client, one chunk = one privacy unit, unless dp-level=user)
    dp: bool = _knob(True, "Opacus DP-SGD on every client")
    dp_target_epsilon: float = _knob(8.0, "per-client budget after all planned rounds (sigma is calibrated to it)")
    dp_delta: float = _knob(1e-05, "DP delta")
    dp_noise_multiplier: float = _knob(0.0, "> 0: fixed sigma instead of calibrating to dp-target-epsilon")
    dp_max_grad_norm: float = _knob(1.0, "per-chunk gradient clipping bound")
    dp_planned_rounds: int = _knob(0, "rounds a client plans to join for sigma calibration; 0: num-server-rounds")
    dp_level: str = _knob(
        "example",
        "example: Opacus DP-SGD per chunk on each client | user: each client's whole update clipped and noised "
        "(common/federation/user_dp.py)",
    )
    user_dp_noise: str = _knob(
        "device",
        "dp-level=user: device: each client adds a noise share before SecAgg+ masks it | server: the server "
        "noises the unmasked sum (fl-dp-sa)",
    )
    user_dp_alignment: float = _knob(
        0.1, "dp-level=user plan: root mean pairwise cosine of client updates, from public data or a prior run"
    )
    user_dp_clip_quantile: float = _knob(
        0.0,
        "dp-level=user with device noise: 0: the clip is update-max-norm; in (0, 1): adaptive clipping to this "
        "quantile of the update norms (Andrew et al. 2021), at most update-max-norm, the clip bits summed under SecAgg+",
    )
    user_dp_clip_lr: float = _knob(0.2, "adaptive clipping's geometric step per round")
    dp_trainable: str = _knob(
        "all",
        "head parameters trained on clients: all | fusion | blocks | lowrank (fewer coordinates under noise); "
        "for eagle heads, blocks is the decoder layer",
    )
    dp_rank: int = _knob(8, "dp-trainable=lowrank: rank of the update each round trains per Linear (merged after)")

    # server-side optimiser over the (secure) mean update
    server_optimizer: str = _knob(
        "fedavg", "fedavg | fedavgm | fedadam over the (secure) mean update (server/server_optimizer.py)"
    )
    server_lr: float = _knob(1.0, "server learning rate of fedavgm / fedadam")
    server_momentum: float = _knob(0.9, "fedavgm momentum; fedadam beta1")

    # secure aggregation (Flower SecAgg+)
    secagg: bool = _knob(True, "aggregate through Flower SecAgg+ (false: plain FedAvg)")
    secagg_num_shares: int | float = _knob(
        0,
        "0: by rule from the cohort (common/federation/wire.py); float: share of the sampled clients; int > 2: a count",
    )
    secagg_reconstruction_threshold: int | float = _knob(
        0, "0: by rule (the largest that survives secagg-max-dropout); float: share of num-shares; int: a count"
    )
    secagg_max_dropout: float = _knob(
        0.3, "share of a round's clients SecAgg+'s threshold is sized to survive dropping"
    )
    secagg_clipping_range: float = _knob(8.0, "head weights must stay within +-this (checked by clients and server)")
    heads_codec: str = _knob(
        "int8", "how the global heads travel to clients: float32 | float16 | int8 (a scale per 32 weights)"
    )
    secagg_max_weight: float = _knob(1000.0, "client weights (train chunks) are capped at this")
    update_max_norm: float = _knob(
        0.0,
        "L2 bound of one client's update per round (clipped by clients, checked by the server in plain rounds; "
        "the dp-level=user clip); 0: the most an honest AdamW client moves the heads in a round",
    )

    # data
    partitioning: str = _knob(
        "iid",
        "iid | dirichlet | package (whole top-level packages per client) | user (one user of user-chunks per client)",
    )
    dirichlet_alpha: float = _knob(0.5, "concentration of the dirichlet partitioning")
    user_chunks: int = _knob(4, "partitioning=user: consecutive chunks of one package that make one user")
    data_source: str = _knob(
        "stdlib",
        '"stdlib" (train split), "private-packages" (the users\' installed packages) or a folder of text files',
    )

    # models, outputs
    base_model_dir: str = _knob("", '"": the embedded default base (built on first use)')
    init_heads: str = _knob(
        "public",
        '"public": heads trained once on public code (cached per base) | "fresh": untrained heads | '
        "a saved DraftHeads folder",
    )
    public_heads_minutes: float = _knob(3.0, 'init-heads="public": training budget of those heads (the first time)')
    run_dir: str = _knob("runs", "runs/<run-id>/ gets summary.json, rounds/, checkpoints/, plot.png")
    run_id: str = _knob("", '"": <UTC time>-<Flower run id>')
    resume_from: str = _knob("", "a previous run folder: continue after its last checkpoint")
    store_url: str = _knob("", '"": $FEDLA_DB, else <run-dir>/fedla.db')

    # evaluation
    server_eval_chunks: int = _knob(64, "held-out stdlib chunks for server-side per-head accuracy")
    eval_prompts: int = _knob(4, "held-out stdlib prompts for server-side tau")
    eval_prompt_len: int = _knob(32, "prompt tokens")
    eval_max_new_tokens: int = _knob(32, "tokens generated per prompt when measuring tau")
    client_eval_prompts: int = _knob(2, "prompts per client for client-side tau")

    # simulation and devices
    client_state_dir: str = _knob(
        "", "simulation: persist client privacy accountants here (devices: node config state-dir)"
    )
    seed: int = _knob(0, "seed of sampling and partitioning (never of DP noise)")
    device: str = _knob("cpu", "cpu | cuda | auto")

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

    @property
    def epsilon_budget(self) -> float | None:
        """The epsilon each client may spend in this run: the target sigma is calibrated to. None without DP,
        and with a fixed dp-noise-multiplier, where epsilon is whatever that sigma accumulates."""
        return self.dp_target_epsilon if self.dp and self.dp_noise_multiplier <= 0 else None

    @property
    def weight_cap(self) -> int:
        """The largest aggregation weight of one client: the most train chunks an honest client can have
        (max-chunks-per-client, 0: unbounded), never above secagg-max-weight, and at least 1 so that a
        trained reply never weighs 0. Under SecAgg+ it is also the workflow's max_weight: honest clients
        scale their update by weight / cap, and a plaintext claim above it is refused (server/guard.py)."""
        cap = int(self.secagg_max_weight)
        if self.max_chunks_per_client:
            cap = min(cap, self.max_chunks_per_client)
        return max(1, cap)

    def update_bound(self, num_parameters: int) -> float:
        """The L2 bound of one client's update (its new heads minus the heads it was sent) in one round:
        update-max-norm, else the most an honest client can move `num_parameters` weights. AdamW moves each
        weight by at most lr * (1 - beta1) / sqrt(1 - beta2) per step (Kingma & Ba 2015, section 2.1: 3.16 lr
        for torch's betas) plus its weight decay (0.01 lr |w|, |w| <= secagg-clipping-range), over at most
        local-epochs * ceil(weight-cap / batch-size) steps."""
        if self.update_max_norm > 0:
            return self.update_max_norm
        per_step = self.lr * ((1 - 0.9) / math.sqrt(1 - 0.999) + 0.01 * self.secagg_clipping_range)
        steps = self.local_epochs * math.ceil(self.weight_cap / self.batch_size)
        return per_step * steps * math.sqrt(max(1, num_parameters))

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
            "dp-rank": self.dp_rank,
            "user-chunks": self.user_chunks,
        }
        for key, value in positive.items():
            if not value > 0:
                raise FedLookaheadError(f"{key} must be positive, got {value}")
        if self.chunk_len < MIN_CHUNK_LEN:
            raise FedLookaheadError(f"chunk-len must be at least {MIN_CHUNK_LEN} tokens, got {self.chunk_len}")
        if not 0 < self.fraction_train <= 1:
            raise FedLookaheadError(f"fraction-train must be in (0, 1], got {self.fraction_train}")
        if not 0 <= self.fraction_evaluate <= 1:
            raise FedLookaheadError(f"fraction-evaluate must be in [0, 1], got {self.fraction_evaluate}")
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
        for key, value, allowed in (
            ("dp-level", self.dp_level, DP_LEVELS),
            ("user-dp-noise", self.user_dp_noise, USER_DP_NOISE),
            ("dp-trainable", self.dp_trainable, DP_TRAINABLE),
            ("server-optimizer", self.server_optimizer, SERVER_OPTIMIZERS),
            ("client-optimizer", self.client_optimizer, CLIENT_OPTIMIZERS),
        ):
            if value not in allowed:
                raise FedLookaheadError(f"unknown {key} {value!r}: use one of {allowed}")
        if self.client_optimizer == "public-sgd" and (
            self.dp_trainable == "lowrank" or (self.dp and self.dp_level == "example") or not self.update_max_norm > 0
        ):
            raise FedLookaheadError(
                "client-optimizer=public-sgd steps the heads' own parameters without per-chunk DP and has no "
                "AdamW step bound: use it with dp=false or dp-level=user, a dp-trainable other than lowrank, "
                "and update-max-norm > 0"
            )
        if not self.init_heads:
            raise FedLookaheadError('init-heads must be "public", "fresh" or a heads folder, got ""')
        if not self.public_heads_minutes > 0:
            raise FedLookaheadError(f"public-heads-minutes must be positive, got {self.public_heads_minutes}")
        if not (math.isfinite(self.update_max_norm) and self.update_max_norm >= 0):
            raise FedLookaheadError(f"update-max-norm must be a finite number >= 0, got {self.update_max_norm}")
        if self.dp and self.dp_level == "user" and not self.update_max_norm > 0:
            raise FedLookaheadError(
                "dp-level=user needs update-max-norm > 0: it is the clip the noise is calibrated to "
                "(docs/privacy_utility.json used 0.1)"
            )
        if self.dp and self.dp_level == "user" and self.user_dp_noise == "device" and not self.secagg:
            raise FedLookaheadError(
                "dp-level=user with user-dp-noise=device needs secagg=true: a noise share protects only inside "
                "a secure sum (the server would see each client's update with its share alone)"
            )
        if not 0 <= self.user_dp_clip_quantile < 1 or not self.user_dp_clip_lr > 0:
            raise FedLookaheadError("user-dp-clip-quantile must be in [0, 1) and user-dp-clip-lr positive")
        if self.adaptive_clip and not (self.dp and self.dp_level == "user" and self.user_dp_noise == "device"):
            raise FedLookaheadError(
                "user-dp-clip-quantile > 0 needs dp=true, dp-level=user and user-dp-noise=device: the clip bits are "
                "private too, and only the devices' noise shares under SecAgg+ keep them out of the server's sight"
            )
        if not 0 < self.user_dp_alignment <= 1:
            raise FedLookaheadError(f"user-dp-alignment must be in (0, 1], got {self.user_dp_alignment}")
        if not self.server_lr > 0 or not 0 <= self.server_momentum < 1:
            raise FedLookaheadError("server-lr must be positive and server-momentum in [0, 1)")
        if self.partitioning not in PARTITIONINGS:
            raise FedLookaheadError(f"unknown partitioning {self.partitioning!r}: use one of {PARTITIONINGS}")
        if self.secagg:
            shares, threshold = self.secagg_num_shares, self.secagg_reconstruction_threshold
            if isinstance(shares, float) and not 0 < shares <= 1:
                raise FedLookaheadError(f"secagg-num-shares as a share must be in (0, 1], got {shares}")
            if isinstance(shares, int) and shares and shares <= 2:
                raise FedLookaheadError(f"secagg-num-shares as a count must be > 2 (0: by rule), got {shares}")
            if isinstance(threshold, float) and not 0 < threshold <= 1:
                raise FedLookaheadError(
                    f"secagg-reconstruction-threshold as a share must be in (0, 1], got {threshold}"
                )
            if isinstance(threshold, int) and isinstance(shares, int) and shares and threshold >= shares:
                raise FedLookaheadError(
                    f"secagg-reconstruction-threshold ({threshold}) must be below secagg-num-shares ({shares})"
                )
            if threshold < 0 or (isinstance(threshold, int) and threshold == 1):
                raise FedLookaheadError(
                    f"secagg-reconstruction-threshold must be 0 (by rule) or at least 2, got {threshold}"
                )
            if not 0 <= self.secagg_max_dropout < 1:
                raise FedLookaheadError(f"secagg-max-dropout must be in [0, 1), got {self.secagg_max_dropout}")
        if self.heads_codec not in HEADS_CODECS:
            raise FedLookaheadError(f"unknown heads-codec {self.heads_codec!r}: use one of {HEADS_CODECS}")

    @property
    def adaptive_clip(self) -> bool:
        """Whether the user-level clip follows a quantile of the update norms (user-dp-clip-quantile > 0)."""
        return self.user_dp_clip_quantile > 0

    def clients_this_round(self, available: int) -> int:
        """How many clients a round samples out of `available` (never fewer than min-train-clients)."""
        wanted = self.clients_per_round or int(available * self.fraction_train)
        return max(wanted, self.min_train_clients)


# Derived from FedConfig, keyed like the run config.
DEFAULTS: dict[str, bool | int | float | str] = {f.name.replace("_", "-"): f.default for f in fields(FedConfig)}
HELP: dict[str, str] = {f.name.replace("_", "-"): f.metadata["help"] for f in fields(FedConfig)}


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
