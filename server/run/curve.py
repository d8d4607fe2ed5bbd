"""`PrivacyUtilityCurve`: where one run sits among the runs of a privacy-utility comparison.

A benchmark that made several runs (simulations/privacy_utility/) writes one into each run's folder;
the run page plots it. The dashboard reads only this record, never a benchmark's own output, so a
benchmark can change its JSON without touching the product.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.durable import write_json
from common.errors import FedLookaheadError
from server.run.folder import RunFolder

REFERENCES = ("public_only", "federated_nodp", "central_nodp")  # the runs a DP curve is read against
RUN_KINDS = ("federated_nodp", "dp")


@dataclass(frozen=True)
class PrivacyUtilityCurve:
    """Heads-only tau at each target epsilon (delta of the benchmark, all rounds), the references' tau,
    and this run's own point (None: the run is a reference)."""

    epsilon: list[float]
    dp: list[float]  # tau at each epsilon
    references: dict[str, float] = field(default_factory=dict)
    clients: int | None = None
    rounds: int | None = None
    this_run: dict | None = None  # {"kind": "dp" | "federated_nodp", "epsilon": float | None, "tau": float}

    def __post_init__(self) -> None:
        if len(self.epsilon) != len(self.dp) or self.epsilon != sorted(self.epsilon):
            raise FedLookaheadError("a privacy-utility curve needs one tau per epsilon, epsilons ascending")
        taus = list(self.dp) + list(self.references.values()) + ([self.this_run["tau"]] if self.this_run else [])
        if not all(isinstance(t, (int, float)) and math.isfinite(t) for t in taus):
            raise FedLookaheadError("a privacy-utility curve's taus must be finite numbers")
        if set(self.references) - set(REFERENCES):
            raise FedLookaheadError(f"unknown reference(s) {sorted(set(self.references) - set(REFERENCES))}")
        if self.this_run is not None and self.this_run.get("kind") not in RUN_KINDS:
            raise FedLookaheadError(f"this_run.kind must be one of {RUN_KINDS}")

    def write(self, path: Path) -> None:
        write_json(path, asdict(self))

    @classmethod
    def read(cls, path: Path) -> PrivacyUtilityCurve:
        """Raises FileNotFoundError when there is none, ValueError (FedLookaheadError included) when it is
        not a curve."""
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        try:
            return cls(**data)
        except TypeError as exc:  # missing or unknown fields
            raise ValueError(str(exc)) from None


def curve_of_run(run_folders: list[Path]) -> PrivacyUtilityCurve | None:
    """The curve left in the first of a run's folders that has one; None when none has, or when it cannot
    be read (logged: the run page then simply has no such plot)."""
    for folder in run_folders:
        path = RunFolder(folder).privacy_utility
        try:
            return PrivacyUtilityCurve.read(path)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            logging.getLogger(__name__).warning("unreadable %s: %s", path, exc)
            return None
    return None
