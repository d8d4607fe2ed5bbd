"""Reading the run store back: runs, rounds and checkpoints as plain dicts (what the dashboard's API returns)."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import func, select

from common.federation.protocol import finite_or_none
from server.store.engine import StoreEngine
from server.store.schema import Checkpoint, Round, Run


def _iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    if moment.tzinfo is None:  # SQLite drops the zone; we only ever write UTC
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.isoformat()


def _round_dict(row: Round) -> dict:
    part, priv = row.participation, row.privacy
    return {
        "round": row.round,
        "metrics": {
            "train_loss": row.train_loss,
            "head_accuracy": list(row.head_accuracy),
            "tau": row.tau,
            "client_head_accuracy": None if row.client_head_accuracy is None else list(row.client_head_accuracy),
            "client_tau": row.client_tau,
        },
        "tau_heads_only": row.tau_heads_only,
        "participation": {
            "sampled": part.sampled if part else 0,
            "succeeded": part.succeeded if part else 0,
            "dropped": part.dropped if part else 0,
            "rejected": [{"reason": r.reason} for r in row.rejected],
        },
        "privacy": {
            "epsilon_max": finite_or_none(priv.epsilon_max) if priv else None,
            "epsilon_mean": finite_or_none(priv.epsilon_mean) if priv else None,
            "delta": priv.delta if priv else None,
        },
        "wall_seconds": row.wall_seconds,
        "bytes_per_client": row.bytes_per_client,
        "bytes": row.traffic,  # None for rounds recorded before v3
        "seconds": row.seconds,
        "recorded_at": _iso(row.recorded_at),
    }


def _checkpoint_dict(row: Checkpoint) -> dict:
    return {
        "round": row.round,
        "head_version": row.head_version,
        "path": row.path,
        "size_bytes": row.size_bytes,
        "sha256": row.sha256,
        "created_at": _iso(row.created_at),
    }


class RunReads(StoreEngine):
    """The reads of `RunStore`: all the dashboard needs (it opens the store read-only)."""

    def list_runs(self) -> list[dict]:
        """All runs, newest first, with their round count and last round's headline numbers."""
        with self._session() as session:
            counts = dict(session.execute(select(Round.run_id, func.count(Round.id)).group_by(Round.run_id)).all())
            runs = session.scalars(select(Run).order_by(Run.started_at.desc(), Run.run_id)).all()
            out = []
            for run in runs:
                last = session.scalar(
                    select(Round).where(Round.run_id == run.run_id).order_by(Round.round.desc()).limit(1)
                )
                out.append(
                    {
                        "run_id": run.run_id,
                        "status": run.status,
                        "started_at": _iso(run.started_at),
                        "updated_at": _iso(run.updated_at),
                        "finished_at": _iso(run.finished_at),
                        "num_rounds": counts.get(run.run_id, 0),
                        "last_round": last.round if last else None,
                        "last_train_loss": last.train_loss if last else None,
                        "last_tau": last.tau if last else None,
                        "last_epsilon_max": finite_or_none(last.privacy.epsilon_max) if last and last.privacy else None,
                        "epsilon_budget": (run.plan or {}).get("privacy", {}).get("epsilon_budget"),
                    }
                )
            return out

    def get_run(self, run_id: str) -> dict | None:
        with self._session() as session:
            run = session.get(Run, run_id)
            if run is None:
                return None
            count = session.scalar(select(func.count(Round.id)).where(Round.run_id == run_id))
            last = session.scalar(select(func.max(Round.round)).where(Round.run_id == run_id))
            return {
                "run_id": run.run_id,
                "status": run.status,
                "config": run.config,
                "secagg": run.secagg,
                "plan": run.plan,
                "starting_heads": run.starting_heads,
                "started_at": _iso(run.started_at),
                "updated_at": _iso(run.updated_at),
                "finished_at": _iso(run.finished_at),
                "num_rounds": count,
                "last_round": last,
                "latest_checkpoint": self._latest_checkpoint(session, run_id),
            }

    def get_rounds(self, run_id: str) -> list[dict]:
        """The run's rounds in order, each shaped like record_round's arguments (+ recorded_at)."""
        with self._session() as session:
            rows = session.scalars(select(Round).where(Round.run_id == run_id).order_by(Round.round)).all()
            return [_round_dict(row) for row in rows]

    def latest_checkpoint(self, run_id: str) -> dict | None:
        with self._session() as session:
            return self._latest_checkpoint(session, run_id)

    def checkpoints(self, run_id: str) -> list[dict]:
        return self._checkpoints(run_id)

    def _checkpoints(self, run_id: str) -> list[dict]:
        with self._session() as session:
            rows = session.scalars(
                select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.round)
            ).all()
            return [_checkpoint_dict(row) for row in rows]

    @staticmethod
    def _latest_checkpoint(session, run_id: str) -> dict | None:
        row = session.scalar(
            select(Checkpoint)
            .where(Checkpoint.run_id == run_id)
            .order_by(Checkpoint.round.desc(), Checkpoint.head_version.desc())
            .limit(1)
        )
        return _checkpoint_dict(row) if row else None
