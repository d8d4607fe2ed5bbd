"""The run store's tables (SQLAlchemy ORM) and their version.

One SQL database (SQLite by default, any SQLAlchemy URL such as postgresql:// by configuration) with
real ORM tables:

* ``runs``              one row per run: config, SecAgg+ settings, status, timestamps;
* ``rounds``            aggregated metrics of one round (loss, per-head accuracy, tau, client-side eval);
* ``participation``     sampled / succeeded / dropped clients of that round;
* ``rejected_replies``  one row per rejected client reply, with its reason only;
* ``privacy``           max / mean epsilon and delta after that round;
* ``checkpoints``       saved head checkpoints (head version, path, size, sha256);
* ``schema_version``    the schema's version, upgraded in order by ``MIGRATIONS`` (server/store/migrations.py)
  when a store opens.

Individual client updates are never stored: there is no table for them, and with SecAgg+ the server
never has them anyway (it only sees the aggregate).
"""

from __future__ import annotations

from datetime import datetime
from typing import Optional

from sqlalchemy import JSON, DateTime, Float, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

FINAL_STATUSES = ("finished", "failed")

SCHEMA_VERSION = 4


class Base(DeclarativeBase):
    pass


class SchemaVersion(Base):
    __tablename__ = "schema_version"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # always 1: a single row
    version: Mapped[int] = mapped_column(Integer, nullable=False)


class Run(Base):
    __tablename__ = "runs"
    run_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    status: Mapped[str] = mapped_column(String(20), nullable=False)
    config: Mapped[dict] = mapped_column(JSON, nullable=False)
    secagg: Mapped[dict] = mapped_column(JSON, nullable=False)
    plan: Mapped[Optional[dict]] = mapped_column(JSON, nullable=True)  # v4: run.json's plan
    starting_heads: Mapped[Optional[dict]] = mapped_column(JSON, nullable=True)  # v4: server eval before round 1
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    finished_at: Mapped[Optional[datetime]] = mapped_column(DateTime(timezone=True), nullable=True)

    rounds: Mapped[list["Round"]] = relationship(
        back_populates="run", cascade="all, delete-orphan", passive_deletes=True, order_by="Round.round"
    )
    checkpoints: Mapped[list["Checkpoint"]] = relationship(
        cascade="all, delete-orphan", passive_deletes=True, order_by="Checkpoint.round"
    )


class Round(Base):
    """Aggregated metrics of one round (never any individual client's update)."""

    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("run_id", "round", name="uq_rounds_run_round"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False, index=True)
    round: Mapped[int] = mapped_column(Integer, nullable=False)
    train_loss: Mapped[float] = mapped_column(Float, nullable=False)
    head_accuracy: Mapped[list] = mapped_column(JSON, nullable=False)
    tau: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    client_head_accuracy: Mapped[Optional[list]] = mapped_column(JSON, nullable=True)  # added in v2
    client_tau: Mapped[Optional[float]] = mapped_column(Float, nullable=True)  # added in v2
    tau_heads_only: Mapped[Optional[float]] = mapped_column(Float, nullable=True)  # added in v3
    traffic: Mapped[Optional[dict]] = mapped_column(JSON, nullable=True)  # v3: RoundRecord.bytes
    seconds: Mapped[Optional[dict]] = mapped_column(JSON, nullable=True)  # v3: RoundRecord.seconds
    wall_seconds: Mapped[float] = mapped_column(Float, nullable=False)
    bytes_per_client: Mapped[int] = mapped_column(Integer, nullable=False)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)

    run: Mapped[Run] = relationship(back_populates="rounds")
    participation: Mapped[Optional["Participation"]] = relationship(
        cascade="all, delete-orphan", passive_deletes=True, uselist=False
    )
    rejected: Mapped[list["RejectedReply"]] = relationship(
        cascade="all, delete-orphan", passive_deletes=True, order_by="RejectedReply.id"
    )
    privacy: Mapped[Optional["Privacy"]] = relationship(
        cascade="all, delete-orphan", passive_deletes=True, uselist=False
    )


class Participation(Base):
    __tablename__ = "participation"
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id", ondelete="CASCADE"), primary_key=True)
    sampled: Mapped[int] = mapped_column(Integer, nullable=False)
    succeeded: Mapped[int] = mapped_column(Integer, nullable=False)
    dropped: Mapped[int] = mapped_column(Integer, nullable=False)


class RejectedReply(Base):
    """A client reply the server refused, with the reason only (no payload is ever kept)."""

    __tablename__ = "rejected_replies"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id", ondelete="CASCADE"), nullable=False, index=True)
    reason: Mapped[str] = mapped_column(String(500), nullable=False)


class Privacy(Base):
    __tablename__ = "privacy"
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id", ondelete="CASCADE"), primary_key=True)
    epsilon_max: Mapped[float] = mapped_column(Float, nullable=False)  # may be +inf: no DP guarantee
    epsilon_mean: Mapped[float] = mapped_column(Float, nullable=False)
    delta: Mapped[float] = mapped_column(Float, nullable=False)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "round", name="uq_checkpoints_run_round"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False, index=True)
    round: Mapped[int] = mapped_column(Integer, nullable=False)
    head_version: Mapped[int] = mapped_column(Integer, nullable=False)
    path: Mapped[str] = mapped_column(String(4096), nullable=False)
    size_bytes: Mapped[int] = mapped_column(Integer, nullable=False)
    sha256: Mapped[str] = mapped_column(String(64), nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


STORE_TABLES = frozenset(Base.metadata.tables)
