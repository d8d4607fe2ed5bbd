"""DP-SGD accounting: the accountant's history, its epsilon, and the noise multiplier chosen for a run.

The privacy unit is one chunk of the client's text. Base features are computed under no_grad from a
frozen (public) base, so only the head parameters see private gradients; Opacus clips each chunk's
gradient to `dp-max-grad-norm` and adds Gaussian noise, with Poisson sampling of batches
(client/training/local_round.py).

Accounting is Opacus's RDP accountant over a history [(sigma, q, steps), ...] that persists between
rounds, so the epsilon a client reports is the cumulative one (a fresh PrivacyEngine per round,
which forgets history, would under-report it). The noise multiplier is chosen once per run, from the
target epsilon and the steps of all planned rounds. Before each round the client computes the
epsilon it would have after that round's steps; if that exceeds its budget it does not train (and
says so in its reply).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from flwr.app import ConfigRecord
from opacus.accountants import RDPAccountant

from common.federation.config import FedConfig
from common.federation.user_dp import noise_multiplier

EPSILON_SLACK = 1e-6  # float noise only; never a real allowance over the target

History = list[tuple[float, float, int]]


@dataclass
class PrivacyState:
    run_key: str
    noise_multiplier: float = 0.0  # 0: not chosen yet
    history: History = field(default_factory=list)
    # the guarantee charged: "example" (DP-SGD, one chunk the unit) or "user" (noise shares, the whole user;
    # it bounds every chunk too, so both compose into one lifetime epsilon)
    level: str = "example"

    def to_record(self) -> ConfigRecord:
        return ConfigRecord(
            {
                "run-key": self.run_key,
                "noise-multiplier": float(self.noise_multiplier),
                "sigmas": [float(s) for s, _, _ in self.history],
                "rates": [float(q) for _, q, _ in self.history],
                "steps": [int(n) for _, _, n in self.history],
                "level": self.level,
            }
        )

    @classmethod
    def from_record(cls, record: ConfigRecord) -> PrivacyState:
        history = list(zip(map(float, record["sigmas"]), map(float, record["rates"]), map(int, record["steps"])))
        return cls(
            str(record["run-key"]), float(record["noise-multiplier"]), history, str(record.get("level", "example"))
        )

    def to_json(self) -> dict:
        return {
            "run_key": self.run_key,
            "noise_multiplier": self.noise_multiplier,
            "history": [list(h) for h in self.history],
            "level": self.level,
        }

    @classmethod
    def from_json(cls, data: dict) -> PrivacyState:
        return cls(
            data["run_key"],
            float(data["noise_multiplier"]),
            [(float(s), float(q), int(n)) for s, q, n in data["history"]],
            str(data.get("level", "example")),
        )


def epsilon_of(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """Epsilon of Opacus's RDP accountant over this history (0 before any step).

    Entries with the same (sigma, q) are handed to the accountant as one, with their steps summed, as
    RDPAccountant.step itself does for consecutive steps (RDP composes additively, in any order): a
    device's lifetime history repeats the same few mechanisms over many runs, and each distinct one
    costs the accountant ~0.1 s.
    """
    if not history:
        return 0.0
    steps: dict[tuple[float, float], int] = {}
    for sigma, q, n in history:
        steps[(float(sigma), float(q))] = steps.get((float(sigma), float(q)), 0) + int(n)
    accountant = RDPAccountant()
    accountant.history = [(sigma, q, n) for (sigma, q), n in steps.items()]
    return float(accountant.get_epsilon(delta))


def plan(config: FedConfig, num_chunks: int) -> tuple[float, int]:
    """(q, steps per round) of Poisson sampling with expected batch `batch-size` (Opacus: q = 1/len(loader))."""
    batches = math.ceil(num_chunks / config.batch_size)
    return 1.0 / batches, config.local_epochs * batches


def choose_noise_multiplier(config: FedConfig, q: float, steps_per_round: int) -> float:
    """sigma for the whole planned run: target epsilon after `planned_rounds` rounds of this client's steps."""
    if config.dp_noise_multiplier > 0:
        return config.dp_noise_multiplier
    return noise_multiplier(config.dp_target_epsilon, config.dp_delta, q, config.planned_rounds * steps_per_round)
