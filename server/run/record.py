"""`RoundRecord`, the one shape of a finished round on the server, checked when it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from common.federation.protocol import fail, finite_or_none, integer, number, show


def _accuracies(values: Any, name: str) -> tuple[float, ...]:
    if not isinstance(values, (list, tuple)):
        fail(f"{name} must be a list of numbers, got {type(values).__name__} {show(values)}")
    return tuple(number(a, f"{name}[{i}]", hi=1.0) for i, a in enumerate(values))


@dataclass(frozen=True)
class RoundRecord:
    """One federated round, as the round produced it (server/rounds.py) and as every record of it holds it:
    the checkpoint, rounds/round-N.json, the run store, summary.json, the plot and the dashboard.

    Construction checks every value (one-line ReplyError, a ValueError), so nobody downstream re-validates.
    `to_json` is the layout of rounds/round-N.json.
    """

    round: int
    train_loss: float  # the clients' weighted training loss, else the server's held-out loss (loss_source)
    head_accuracy: tuple[float, ...]  # server-side held-out top-1 accuracy per head
    tau: float | None = None  # server-side AMS-LD tau
    client_head_accuracy: tuple[float, ...] | None = None
    client_tau: float | None = None
    tau_heads_only: float | None = None  # tau without the n-gram drafter (last round only)
    head_version: int = 0
    aggregated: bool = False
    aggregate_note: str = ""
    loss_source: str = "clients"
    train_head_accuracy: tuple[float, ...] | None = None  # the clients' own training accuracy
    server_eval_loss: float | None = None
    sampled: int = 0
    succeeded: int = 0  # replies that reached aggregation
    dropped: int = 0
    rejected: tuple[dict[str, Any], ...] = ()  # {"node": id, "reason": str}; the store keeps the reason only
    failures: dict[str, str] = field(default_factory=dict)  # node -> why it failed (not rejected)
    skipped_budget: dict[str, str] = field(default_factory=dict)  # node -> its skip reason
    weights: dict[str, int] = field(default_factory=dict)  # node -> the (capped) aggregation weight
    capped_weights: dict[str, int] = field(default_factory=dict)  # node -> the larger weight it claimed
    client_eval: dict[str, Any] = field(default_factory=dict)  # server/evaluation.client_evaluation's summary
    epsilon_max: float = 0.0  # +inf: no DP guarantee
    epsilon_mean: float = 0.0
    delta: float = 0.0
    target_epsilon: float | None = None
    epsilon_this_round: dict[str, float] = field(default_factory=dict)
    noise_multiplier: tuple[float, ...] = ()
    q: tuple[float, ...] = ()
    no_amplification_clients: int = 0
    bytes_down_per_client: int = 0
    bytes_up_per_client: int = 0
    eval_push_bytes_per_client: int = 0
    wall_seconds: float = 0.0
    fit_seconds: float | None = None
    server_eval_seconds: float | None = None
    client_eval_seconds: float | None = None
    client_train_seconds: float | None = None  # the clients' training time, summed
    update_norm: dict[str, Any] = field(default_factory=dict)  # {"bound", "checked", "median", "max"}

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # frozen: store the checked (plain Python) value
            object.__setattr__(self, name, value)

        put("round", integer(self.round, "round"))
        put("train_loss", number(self.train_loss, "train_loss"))
        for name in ("head_accuracy", "client_head_accuracy", "train_head_accuracy"):
            if getattr(self, name) is not None:
                put(name, _accuracies(getattr(self, name), name))
        if self.head_accuracy is None:
            fail("head_accuracy must be a list of numbers, got None")
        for name in (
            "tau",
            "client_tau",
            "tau_heads_only",
            "server_eval_loss",
            "target_epsilon",
            "fit_seconds",
            "server_eval_seconds",
            "client_eval_seconds",
            "client_train_seconds",
        ):
            if getattr(self, name) is not None:
                put(name, number(getattr(self, name), name))
        for name in (
            "head_version",
            "sampled",
            "succeeded",
            "dropped",
            "no_amplification_clients",
            "bytes_down_per_client",
            "bytes_up_per_client",
            "eval_push_bytes_per_client",
        ):
            put(name, integer(getattr(self, name), name))
        if self.succeeded > self.sampled or self.dropped > self.sampled:
            fail(f"succeeded ({self.succeeded}) and dropped ({self.dropped}) cannot exceed sampled ({self.sampled})")
        for i, item in enumerate(self.rejected):
            if not isinstance(item, Mapping) or not isinstance(item.get("reason"), str) or not item["reason"].strip():
                fail(f"rejected[{i}] must be {{'reason': a non-empty string}}, got {show(item)}")
        put("epsilon_max", number(self.epsilon_max, "epsilon_max", allow_inf=True))
        put("epsilon_mean", number(self.epsilon_mean, "epsilon_mean", allow_inf=True))
        put("delta", number(self.delta, "delta", hi=1.0))
        put("wall_seconds", number(self.wall_seconds, "wall_seconds"))

    @property
    def bytes_per_client(self) -> int:
        """Train traffic of one client in this round: the heads down plus its update up."""
        return self.bytes_down_per_client + self.bytes_up_per_client

    @property
    def seconds(self) -> dict[str, float | None]:
        return {
            "fit": self.fit_seconds,
            "server_eval": self.server_eval_seconds,
            "client_eval": self.client_eval_seconds,
            "client_train_sum": self.client_train_seconds,
        }

    @property
    def bytes(self) -> dict[str, int]:
        return {
            "down_per_client": self.bytes_down_per_client,
            "up_per_client": self.bytes_up_per_client,
            "eval_push_per_client": self.eval_push_bytes_per_client,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoundRecord:
        """The record `to_json` wrote (an epsilon of null is unbounded again); ReplyError when it is not one."""

        def unbounded(value: Any) -> Any:
            return math.inf if value is None else value

        try:
            metrics, train, part, privacy = data["metrics"], data["train"], data["participation"], data["privacy"]
            seconds, traffic = data["seconds"], data["bytes"]
            return cls(
                round=data["round"],
                head_version=data["head_version"],
                aggregated=bool(data["aggregated"]),
                aggregate_note=str(data["aggregate_note"]),
                train_loss=metrics["train_loss"],
                head_accuracy=metrics["head_accuracy"],
                tau=metrics["tau"],
                client_head_accuracy=metrics["client_head_accuracy"],
                client_tau=metrics["client_tau"],
                loss_source=str(train["loss_source"]),
                train_head_accuracy=train["head_accuracy"],
                server_eval_loss=train["server_eval_loss"],
                tau_heads_only=data["tau_heads_only"],
                sampled=part["sampled"],
                succeeded=part["succeeded"],
                dropped=part["dropped"],
                rejected=tuple(part["rejected"]),
                failures=dict(part["failures"]),
                skipped_budget=dict(part["skipped_budget"]),
                weights=dict(part["weights"]),
                capped_weights=dict(part["capped_weights"]),
                client_eval=dict(data["client_eval"]),
                epsilon_max=unbounded(privacy["epsilon_max"]),
                epsilon_mean=unbounded(privacy["epsilon_mean"]),
                delta=privacy["delta"],
                target_epsilon=privacy["target_epsilon"],
                epsilon_this_round={k: unbounded(v) for k, v in privacy["epsilon_this_round"].items()},
                noise_multiplier=tuple(privacy["noise_multiplier"]),
                q=tuple(privacy["q"]),
                no_amplification_clients=privacy["no_amplification_clients"],
                bytes_down_per_client=traffic["down_per_client"],
                bytes_up_per_client=traffic["up_per_client"],
                eval_push_bytes_per_client=traffic["eval_push_per_client"],
                wall_seconds=data["wall_seconds"],
                fit_seconds=seconds["fit"],
                server_eval_seconds=seconds["server_eval"],
                client_eval_seconds=seconds["client_eval"],
                client_train_seconds=seconds["client_train_sum"],
                update_norm=dict(data.get("update_norm", {})),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            fail(f"not a round record ({type(exc).__name__}: {exc})")

    def to_json(self) -> dict[str, Any]:
        """The rounds/round-N.json layout (strict JSON: an unbounded epsilon is null)."""
        return finite_or_none(
            {
                "round": self.round,
                "head_version": self.head_version,
                "aggregated": self.aggregated,
                "aggregate_note": self.aggregate_note,
                "metrics": {
                    "train_loss": self.train_loss,
                    "head_accuracy": list(self.head_accuracy),
                    "tau": self.tau,
                    "client_head_accuracy": None
                    if self.client_head_accuracy is None
                    else list(self.client_head_accuracy),
                    "client_tau": self.client_tau,
                },
                "train": {
                    "loss_source": self.loss_source,
                    "head_accuracy": None if self.train_head_accuracy is None else list(self.train_head_accuracy),
                    "server_eval_loss": self.server_eval_loss,
                },
                "tau_heads_only": self.tau_heads_only,
                "participation": {
                    "sampled": self.sampled,
                    "succeeded": self.succeeded,
                    "dropped": self.dropped,
                    "rejected": [dict(item) for item in self.rejected],
                    "failures": dict(self.failures),
                    "skipped_budget": dict(self.skipped_budget),
                    "weights": dict(self.weights),
                    "capped_weights": dict(self.capped_weights),
                },
                "client_eval": dict(self.client_eval),
                "privacy": {
                    "epsilon_max": self.epsilon_max,
                    "epsilon_mean": self.epsilon_mean,
                    "delta": self.delta,
                    "target_epsilon": self.target_epsilon,
                    "epsilon_this_round": dict(self.epsilon_this_round),
                    "noise_multiplier": list(self.noise_multiplier),
                    "q": list(self.q),
                    "no_amplification_clients": self.no_amplification_clients,
                },
                "bytes_per_client": self.bytes_per_client,
                "bytes": self.bytes,
                "wall_seconds": self.wall_seconds,
                "seconds": self.seconds,
                "update_norm": dict(self.update_norm),
            }
        )
