"""`RunFolder`: runs/<run-id>/, the one home of every path in a run's folder.

runs/<run-id>/
  run.json                what the run is: config, plan, base, head size (server/run/recorder.py)
  rounds/round-N.json     round N's whole RoundRecord (server/run/record.py)
  checkpoints/round-N/    the heads after round N, written atomically
  summary.json            written from the run store after every round, so it and the dashboard agree
  plot.png                drawn from summary.json when the run finishes (server/run/plot.py)
  privacy_utility_curve.json  where this run sits on a privacy-utility benchmark (server/run/curve.py)
  faults.json             the faults a simulation injected (simulations/faults.py)
  flwr.log                the scenario runner's log of `flwr run` (simulations/run.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.heads.lookahead import CONFIG_FILE, WEIGHTS_FILE

RUN_FILE = "run.json"
ROUNDS_DIR = "rounds"
CHECKPOINTS_DIR = "checkpoints"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "plot.png"
PRIVACY_UTILITY_FILE = "privacy_utility_curve.json"  # a benchmark that made this run leaves it
FAULTS_FILE = "faults.json"
LOG_FILE = "flwr.log"
ROUND_PREFIX = "round-"  # rounds/round-N.json and checkpoints/round-N/


@dataclass(frozen=True)
class RunFolder:
    """The paths of one run's folder (`path` is runs/<run-id>; its name is the run id)."""

    path: Path

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def run_file(self) -> Path:
        return self.path / RUN_FILE

    @property
    def rounds_dir(self) -> Path:
        return self.path / ROUNDS_DIR

    def round_file(self, server_round: int) -> Path:
        return self.rounds_dir / f"{ROUND_PREFIX}{server_round}.json"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    def checkpoint(self, server_round: int) -> Path:
        return self.checkpoints_dir / f"{ROUND_PREFIX}{server_round}"

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def plot(self) -> Path:
        return self.path / PLOT_FILE

    @property
    def privacy_utility(self) -> Path:
        return self.path / PRIVACY_UTILITY_FILE

    @property
    def faults(self) -> Path:
        return self.path / FAULTS_FILE

    @property
    def log(self) -> Path:
        return self.path / LOG_FILE

    def checkpoints_newest_first(self) -> list[tuple[int, Path]]:
        """(round, folder) of every checkpoint under checkpoints/ with both heads files, newest first.
        Whether one loads is for its reader to find out (a checkpoint written before they were atomic may be
        truncated)."""
        found = []
        for path in self.checkpoints_dir.glob(f"{ROUND_PREFIX}*"):
            suffix = path.name.removeprefix(ROUND_PREFIX)
            if suffix.isdigit() and (path / WEIGHTS_FILE).is_file() and (path / CONFIG_FILE).is_file():
                found.append((int(suffix), path))
        return sorted(found, reverse=True)

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        """(round, folder) of the newest checkpoint with both heads files, None if there is none."""
        return next(iter(self.checkpoints_newest_first()), None)
