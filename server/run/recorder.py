"""Where a run's records go: each `RoundRecord` is written once, here, to every place that keeps it.

Per round, in this order: `rounds/round-N.json` (the whole record, atomically), the store's round row
(what the dashboard reads), the checkpoint (`checkpoints/round-N/`, atomically) and its store row, and
`summary.json` (written from the store, so it and the dashboard never disagree). At the end: the run's
status and the plot (drawn from summary.json).

The order makes a crash recoverable: a checkpoint, which a resumed run starts from, exists only once its
round is recorded. `reconcile` (called on resume) puts the store back in line with the checkpoints: rows
of rounds after the resumed checkpoint are dropped (they are redone), and a checkpoint missing its rows
gets them from its files and its rounds/round-N.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from common.durable import write_text
from common.federation.config import FedConfig
from common.federation.protocol import finite_or_none
from common.heads.lookahead import CONFIG_FILE, WEIGHTS_FILE, DraftHeads
from server.run.folder import RunFolder
from server.run.record import RoundRecord
from server.store.run_store import RunStore

log = logging.getLogger("flwr.fedla.server")


def save_checkpoint(heads: DraftHeads, folder: Path) -> Path:
    """`heads.save(folder)` atomically: written into a temporary folder, flushed to disk, then renamed, so
    that a crash leaves the old checkpoint or the new one, never half of one."""
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a crash's leftover
    heads.save(tmp)
    for path in tmp.iterdir():
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
    if folder.exists():  # the same round written again (a resumed run redoing it)
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Recorder:
    """Writes one run's records: `start`, then `record` once per round, then `finish`."""

    def __init__(self, run_dir: Path, run_id: str, store: RunStore) -> None:
        self.folder, self.run_id, self.store = RunFolder(run_dir), run_id, store
        self.folder.rounds_dir.mkdir(parents=True, exist_ok=True)
        self.folder.checkpoints_dir.mkdir(parents=True, exist_ok=True)

    def start(self, config: FedConfig) -> None:
        """The run's row in the store (a resumed run is set back to running, its rounds kept)."""
        secagg = {
            "enabled": config.secagg,
            "num_shares": config.secagg_num_shares or "by rule",
            "reconstruction_threshold": config.secagg_reconstruction_threshold or "by rule",
            "max_dropout": config.secagg_max_dropout,
            "weight_range": config.secagg_clipping_range,
            "max_weight": config.weight_cap,
        }
        self.store.start_run(self.run_id, finite_or_none(config.to_dict()), secagg)

    def describe(self, info: dict[str, Any]) -> None:
        """run.json: what the run is (config, plan, base, head size), written once it is known."""
        self.folder.run_file.write_text(json.dumps(finite_or_none(info), indent=2))
        self.store.record_plan(self.run_id, info["plan"])

    def record_starting_heads(self, evaluation: dict[str, Any]) -> None:
        """The server's evaluation of the heads before round 1 (the dashboard's round-0 point)."""
        self.store.record_starting_heads(self.run_id, evaluation)
        log.info("starting heads: %s", json.dumps(finite_or_none(evaluation)))

    def record(self, record: RoundRecord, heads: DraftHeads) -> None:
        """The round's checkpoint, round file, store row and summary, and its one log line."""
        write_text(self.folder.round_file(record.round), json.dumps(record.to_json(), indent=2))
        self.store.record_round(self.run_id, record)
        self._record_checkpoint(record.round, save_checkpoint(heads, self.folder.checkpoint(record.round)))
        self.store.write_summary(self.run_id, self.folder.summary)
        log.info(
            "round %d: %s",
            record.round,
            json.dumps(
                finite_or_none(
                    {
                        "tau": record.tau,
                        "acc": list(record.head_accuracy),
                        "train_loss": record.train_loss,
                        "participation": record.to_json()["participation"],
                        "eps_max": record.epsilon_max,
                        "seconds": round(record.wall_seconds, 1),
                    }
                )
            ),
        )

    def _record_checkpoint(self, server_round: int, folder: Path) -> None:
        config = json.loads((folder / CONFIG_FILE).read_text())
        self.store.record_checkpoint(
            self.run_id,
            server_round,
            head_version=int(config.get("version", 0)),
            path=str(folder),
            size_bytes=sum(p.stat().st_size for p in folder.iterdir() if p.is_file()),
            sha256=file_sha256(folder / WEIGHTS_FILE),
        )

    def reconcile(self, resumed_round: int) -> None:
        """Before a run resumes after `resumed_round`'s checkpoint: the store says what the checkpoints say."""
        forgotten = self.store.forget_rounds_after(self.run_id, resumed_round)
        if forgotten:
            log.warning("resume: rounds %s had no checkpoint and are redone", forgotten)
        recorded_rounds = {r["round"] for r in self.store.get_rounds(self.run_id)}
        recorded_checkpoints = {c["round"] for c in self.store.checkpoints(self.run_id)}
        for server_round, folder in sorted(self.folder.checkpoints_newest_first()):
            if server_round > resumed_round:
                continue
            if server_round not in recorded_rounds:
                try:
                    record = RoundRecord.from_json(json.loads(self.folder.round_file(server_round).read_text()))
                except (OSError, ValueError) as exc:
                    log.warning("resume: round %d's record is lost (%s)", server_round, exc)
                else:
                    self.store.record_round(self.run_id, record)
                    log.info(
                        "resume: round %d's store row restored from %s",
                        server_round,
                        self.folder.round_file(server_round),
                    )
            if server_round not in recorded_checkpoints:
                self._record_checkpoint(server_round, folder)
        self.store.write_summary(self.run_id, self.folder.summary)

    def finish(self, status: str) -> None:
        """The run's final status and summary; a finished run also gets its plot."""
        self.store.finish_run(self.run_id, status)
        self.store.write_summary(self.run_id, self.folder.summary)
        if status != "finished":
            return
        try:
            from server.run.plot import plot_run

            plot_run(self.folder.path)
        except Exception as exc:  # noqa: BLE001 - a plot never fails a finished run
            log.warning("could not plot %s: %s", self.folder.path, exc)
