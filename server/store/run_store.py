"""`RunStore`: records a federated run (its rounds, checkpoints, status and summary.json) and reads it back.

Every ``record_*`` call is its own transaction, so a crash mid-round loses nothing already recorded.
Bad input (unknown run id, malformed dicts) raises a one-line ``ValueError`` before anything is
written; what is already stored is untouched. The tables are in server/store/schema.py, opening and
migrating a store in engine.py and migrations.py, the reads in reads.py.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from common.durable import write_text
from common.federation.protocol import finite_or_none, integer
from server.run.folder import SUMMARY_FILE
from server.run.record import RoundRecord
from server.store.reads import RunReads
from server.store.schema import (
    FINAL_STATUSES,
    SCHEMA_VERSION,
    Checkpoint,
    Participation,
    Privacy,
    RejectedReply,
    Round,
    Run,
)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _fail(message: str) -> NoReturn:
    raise ValueError(" ".join(message.split()))  # always one line


def _json_dict(value: Any, name: str) -> dict:
    if not isinstance(value, dict):
        _fail(f"{name} must be a dict, got {type(value).__name__}")
    try:  # strict JSON (PostgreSQL's JSON type has no Infinity/NaN)
        return json.loads(json.dumps(finite_or_none(value), allow_nan=False))
    except (TypeError, ValueError) as exc:
        _fail(f"{name} is not JSON-serialisable: {exc}")


def _run_id(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        _fail(f"run_id must be a non-empty string of at most 200 characters, got {value!r}")
    return value


class RunStore(RunReads):
    """Records runs and rounds; reads them back for the dashboard (`RunReads`). Thread-safe (a session per
    call). How a store is opened (``read_only=True``: the dashboard) is `StoreEngine`'s (engine.py)."""

    def start_run(self, run_id: str, config: dict, secagg: dict) -> None:
        """Create the run, or (resumed run) set it back to "running" keeping all its recorded rows."""
        run_id = _run_id(run_id)
        config = _json_dict(config, "config")
        secagg = _json_dict(secagg, "secagg")
        for attempt in range(2):
            try:
                with self._session.begin() as session:
                    now = _now()
                    run = session.get(Run, run_id)
                    if run is None:
                        session.add(
                            Run(
                                run_id=run_id,
                                status="running",
                                config=config,
                                secagg=secagg,
                                started_at=now,
                                updated_at=now,
                                finished_at=None,
                            )
                        )
                    else:
                        run.status, run.config, run.secagg = "running", config, secagg
                        run.updated_at, run.finished_at = now, None
                return
            except IntegrityError:  # created concurrently by another process: resume it instead
                if attempt:
                    raise

    def record_plan(self, run_id: str, plan: dict) -> None:
        """The run's plan, known before round 1 (server/federation.py: nodes, SecAgg+, privacy)."""
        self._set_run_field(run_id, "plan", _json_dict(plan, "plan"))

    def record_starting_heads(self, run_id: str, evaluation: dict) -> None:
        """The server's evaluation of the heads the run starts from: the point each round's gain is seen against."""
        self._set_run_field(run_id, "starting_heads", _json_dict(evaluation, "evaluation"))

    def _set_run_field(self, run_id: str, name: str, value: dict) -> None:
        run_id = _run_id(run_id)
        with self._session.begin() as session:
            run = session.get(Run, run_id)
            if run is None:
                _fail(f"unknown run id {run_id!r}: call start_run first")
            setattr(run, name, value)
            run.updated_at = _now()

    def record_round(self, run_id: str, record: RoundRecord) -> None:
        """Insert or replace one round's aggregates (keyed by run and round), in one transaction.

        `record` was checked when it was made (server.run.record.RoundRecord); only its aggregates and
        rejection reasons are kept, never a client's update."""
        run_id = _run_id(run_id)
        if not isinstance(record, RoundRecord):
            _fail(f"record must be a RoundRecord, got {type(record).__name__}")
        with self._session.begin() as session:
            run = session.get(Run, run_id)
            if run is None:
                _fail(f"unknown run id {run_id!r}: call start_run first")
            now = _now()
            row = session.scalar(select(Round).where(Round.run_id == run_id, Round.round == record.round))
            if row is None:
                row = Round(run_id=run_id, round=record.round)
                session.add(row)
            row.train_loss, row.head_accuracy, row.tau = record.train_loss, list(record.head_accuracy), record.tau
            row.client_head_accuracy = (
                None if record.client_head_accuracy is None else list(record.client_head_accuracy)
            )
            row.client_tau, row.tau_heads_only = record.client_tau, record.tau_heads_only
            row.traffic, row.seconds = record.bytes, finite_or_none(record.seconds)
            row.wall_seconds, row.bytes_per_client, row.recorded_at = record.wall_seconds, record.bytes_per_client, now
            if row.participation is None:
                row.participation = Participation(
                    sampled=record.sampled, succeeded=record.succeeded, dropped=record.dropped
                )
            else:
                row.participation.sampled, row.participation.succeeded = record.sampled, record.succeeded
                row.participation.dropped = record.dropped
            row.rejected.clear()
            row.rejected.extend(RejectedReply(reason=item["reason"][:500]) for item in record.rejected)
            if row.privacy is None:
                row.privacy = Privacy(
                    epsilon_max=record.epsilon_max, epsilon_mean=record.epsilon_mean, delta=record.delta
                )
            else:
                row.privacy.epsilon_max, row.privacy.epsilon_mean = record.epsilon_max, record.epsilon_mean
                row.privacy.delta = record.delta
            run.updated_at = now

    def record_checkpoint(
        self, run_id: str, round: int, *, head_version: int, path: str, size_bytes: int, sha256: str
    ) -> None:
        """Insert or replace the checkpoint saved after ``round`` (keyed by run and round)."""
        run_id = _run_id(run_id)
        round = integer(round, "round")
        head_version = integer(head_version, "head_version")
        if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
            _fail("path must be a non-empty string")
        size_bytes = integer(size_bytes, "size_bytes")
        if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", sha256):
            _fail(f"sha256 must be 64 hex digits, got {sha256!r}")
        with self._session.begin() as session:
            run = session.get(Run, run_id)
            if run is None:
                _fail(f"unknown run id {run_id!r}: call start_run first")
            now = _now()
            row = session.scalar(select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.round == round))
            if row is None:
                row = Checkpoint(run_id=run_id, round=round)
                session.add(row)
            row.head_version, row.path, row.size_bytes = head_version, str(path), size_bytes
            row.sha256, row.created_at = sha256.lower(), now
            run.updated_at = now

    def forget_rounds_after(self, run_id: str, round: int) -> list[int]:
        """Delete the round and checkpoint rows after `round` (a resumed run redoes those rounds from round
        `round`'s checkpoint); returns the rounds whose rows were deleted."""
        run_id = _run_id(run_id)
        round = integer(round, "round")
        with self._session.begin() as session:
            rows = session.scalars(select(Round).where(Round.run_id == run_id, Round.round > round)).all()
            checkpoints = session.scalars(
                select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.round > round)
            ).all()
            forgotten = sorted({row.round for row in rows} | {row.round for row in checkpoints})
            for row in [*rows, *checkpoints]:
                session.delete(row)
        return forgotten

    def finish_run(self, run_id: str, status: str) -> None:
        if status not in FINAL_STATUSES:
            _fail(f"status must be one of {FINAL_STATUSES}, got {status!r}")
        run_id = _run_id(run_id)
        with self._session.begin() as session:
            run = session.get(Run, run_id)
            if run is None:
                _fail(f"unknown run id {run_id!r}")
            now = _now()
            run.status, run.updated_at, run.finished_at = status, now, now

    def write_summary(self, run_id: str, path: Path) -> None:
        """Write the run's summary.json from the database, atomically (temp file + rename).

        ``path`` is the file to write; an existing directory gets ``summary.json`` inside it."""
        run = self.get_run(run_id)
        if run is None:
            _fail(f"unknown run id {run_id!r}")
        path = Path(path)
        if path.is_dir():
            path = path / SUMMARY_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        rounds = self.get_rounds(run_id)
        summary = {
            "schema_version": SCHEMA_VERSION,
            "run": run,
            "rounds": rounds,
            "final": rounds[-1] if rounds else None,
            "checkpoints": self._checkpoints(run_id),
            "note": "Individual client updates are never stored: with SecAgg+ the server only sees the aggregate.",
        }
        write_text(path, json.dumps(summary, indent=2, allow_nan=False) + "\n", durable=True)
