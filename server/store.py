"""Run store: what the ServerApp records about a federated run, and what the dashboard reads.

One SQL database (SQLite by default, any SQLAlchemy URL such as postgresql:// by configuration) with
real ORM tables:

* ``runs``              one row per run: config, SecAgg+ settings, status, timestamps;
* ``rounds``            aggregated metrics of one round (loss, per-head accuracy, tau, client-side eval);
* ``participation``     sampled / succeeded / dropped clients of that round;
* ``rejected_replies``  one row per rejected client reply, with its reason only;
* ``privacy``           max / mean epsilon and delta after that round;
* ``checkpoints``       saved head checkpoints (head version, path, size, sha256);
* ``schema_version``    the schema's version, upgraded in order by ``MIGRATIONS`` when a store opens.

Individual client updates are never stored: there is no table for them, and with SecAgg+ the server
never has them anyway (it only sees the aggregate).

Every ``record_*`` call is its own transaction, so a crash mid-round loses nothing already recorded.
Bad input (unknown run id, malformed dicts) raises a one-line ``ValueError`` before anything is
written; what is already stored is untouched.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional
from urllib.parse import quote

from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    UniqueConstraint,
    create_engine,
    event,
    func,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, sessionmaker
from sqlalchemy.pool import StaticPool

from common.federation.protocol import finite_or_none, integer
from server.run.folder import SUMMARY_FILE
from server.run.record import RoundRecord

DEFAULT_DB_PATH = Path("runs") / "fedla.db"
RUN_STATUSES = ("running", "finished", "failed")
FINAL_STATUSES = ("finished", "failed")

# ------------------------------------------------------------------------------------------ schema

SCHEMA_VERSION = 4


class Base(DeclarativeBase):
    pass


def _now() -> datetime:
    return datetime.now(timezone.utc)


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


# -------------------------------------------------------------------------------------- migrations


def _migrate_1_to_2(conn: Connection) -> None:
    """v2: client-side evaluation (per-head accuracy and tau measured on the clients) per round."""
    json_type = JSON().compile(dialect=conn.dialect)
    float_type = Float().compile(dialect=conn.dialect)
    conn.execute(text(f"ALTER TABLE rounds ADD COLUMN client_head_accuracy {json_type}"))
    conn.execute(text(f"ALTER TABLE rounds ADD COLUMN client_tau {float_type}"))


def _migrate_2_to_3(conn: Connection) -> None:
    """v3: tau of the heads alone, the byte breakdown and the round's timings, for the dashboard."""
    json_type = JSON().compile(dialect=conn.dialect)
    float_type = Float().compile(dialect=conn.dialect)
    conn.execute(text(f"ALTER TABLE rounds ADD COLUMN tau_heads_only {float_type}"))
    conn.execute(text(f"ALTER TABLE rounds ADD COLUMN traffic {json_type}"))
    conn.execute(text(f"ALTER TABLE rounds ADD COLUMN seconds {json_type}"))


def _migrate_3_to_4(conn: Connection) -> None:
    """v4: the run's plan (budget, verdict) and its starting heads' evaluation, for the dashboard."""
    json_type = JSON().compile(dialect=conn.dialect)
    conn.execute(text(f"ALTER TABLE runs ADD COLUMN plan {json_type}"))
    conn.execute(text(f"ALTER TABLE runs ADD COLUMN starting_heads {json_type}"))


# target version -> migration from (target - 1); applied in order when a store opens an older database.
MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    2: _migrate_1_to_2,
    3: _migrate_2_to_3,
    4: _migrate_3_to_4,
}
assert sorted(MIGRATIONS) == list(range(2, SCHEMA_VERSION + 1)), "every version needs its migration"


def _ensure_schema(engine: Engine) -> None:
    """Create a fresh schema, or upgrade an older one step by step; each step is one transaction."""
    for attempt in range(5):  # another process may be creating the same fresh database right now
        try:
            with engine.begin() as conn:
                tables = set(inspect(conn).get_table_names())
                if "schema_version" not in tables:
                    if tables & STORE_TABLES:
                        raise ValueError(
                            f"database {engine.url!r} has run-store tables but no schema_version "
                            "table; refusing to guess its version"
                        )
                    Base.metadata.create_all(conn)
                    conn.execute(SchemaVersion.__table__.insert().values(id=1, version=SCHEMA_VERSION))
                    return
            break
        except (IntegrityError, OperationalError):
            if attempt == 4:
                raise
    while True:
        with engine.begin() as conn:
            version = conn.execute(select(SchemaVersion.version).where(SchemaVersion.id == 1)).scalar_one_or_none()
            if version is None:
                raise ValueError(f"database {engine.url!r} has an empty schema_version table")
            if version > SCHEMA_VERSION:
                raise ValueError(
                    f"database schema version {version} is newer than this code's "
                    f"({SCHEMA_VERSION}); upgrade fedlookahead"
                )
            if version == SCHEMA_VERSION:
                return
            MIGRATIONS[version + 1](conn)
            conn.execute(SchemaVersion.__table__.update().where(SchemaVersion.id == 1).values(version=version + 1))


# -------------------------------------------------------------------------------------- validation


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


# ------------------------------------------------------------------------------------------ output


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


# ------------------------------------------------------------------------------------------- store


def default_url() -> str:
    """$FEDLA_DB (a SQLAlchemy URL or a file path), else the SQLite file runs/fedla.db."""
    configured = os.environ.get("FEDLA_DB", "").strip()
    if configured:
        return configured if "://" in configured else f"sqlite:///{Path(configured)}"
    return f"sqlite:///{DEFAULT_DB_PATH}"


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _sqlite_read_only_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA query_only=ON")  # belt and braces: mode=ro already refuses every write
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _mask_password(url: str) -> str:
    """An unparseable `url` with whatever sits between ``user:`` and ``@`` replaced by ***."""
    return re.sub(r"(://[^:/@\s]*:)[^@\s]*@", r"\1***@", url)


class StoreUnavailable(ValueError):
    """The run store cannot be read (missing, moved, not a run store); the message is one line."""


def one_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of a database error, without SQLAlchemy's statement and background link."""
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


def _sqlite_file(parsed: URL) -> Path | None:
    """The file behind a SQLite URL; None for in-memory SQLite."""
    database = parsed.database or ""
    if database in ("", ":memory:") or database.startswith("file::memory:") or parsed.query.get("mode") == "memory":
        return None
    if database.startswith("file:"):
        database = database[len("file:") :]
    return Path(database).expanduser()


class RunStore:
    """Records runs and rounds; reads them back for the dashboard. Thread-safe (a session per call).

    ``read_only=True`` (the dashboard): an existing store is opened without writing anything (SQLite
    ``mode=ro``, no schema creation, no migration, no WAL pragma); a missing or empty file, or one
    that is not a run store, is refused with a one-line ``StoreUnavailable``, and nothing is created.
    A write-protected file (no write bit, e.g. 0444) is read as ``immutable``, so it opens in a
    read-only folder too. Reading a live WAL store in a writable folder may leave SQLite's empty
    ``-wal``/``-shm`` companions beside it (SQLite's reader protocol; the database itself is untouched).
    """

    def __init__(self, url: str | None = None, *, read_only: bool = False):
        url = url if url is not None else default_url()
        if "://" not in url:  # a bare path is a SQLite file
            url = f"sqlite:///{Path(url)}"
        try:
            parsed = make_url(url)
        except Exception:  # noqa: BLE001 - never echo a URL that may hold a password
            raise StoreUnavailable(f"not a database URL: {_mask_password(url)}") from None
        self.url = parsed.render_as_string(hide_password=True)
        self.sqlite_path: Path | None = None
        self._pin: int | None = None  # read-only SQLite: the file, held open (see check_available)
        kwargs: dict[str, Any] = {}
        if parsed.get_backend_name() == "sqlite":
            path = _sqlite_file(parsed)
            if path is None:  # in-memory
                kwargs.update(poolclass=StaticPool, connect_args={"check_same_thread": False})
            else:
                self.sqlite_path = Path(os.path.abspath(path))
                kwargs.update(connect_args={"check_same_thread": False, "timeout": 30})
                if read_only:
                    self._check_file()
                    try:
                        self._pin = os.open(self.sqlite_path, os.O_RDONLY)
                    except OSError as exc:
                        raise StoreUnavailable(
                            f"cannot read the run store {self.sqlite_path}: {exc.strerror}"
                        ) from None
                    query = {"mode": "ro", "uri": "true"}
                    if not self.sqlite_path.stat().st_mode & 0o222:
                        # Write-protected: an archive nobody (but root) can change. `immutable` reads it
                        # without the -shm/-wal files that a WAL store in a read-only folder cannot get.
                        query["immutable"] = "1"
                    parsed = parsed.set(database=f"file:{quote(str(self.sqlite_path))}", query=query)
                else:
                    self.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
        self.engine = create_engine(parsed, **kwargs)
        if parsed.get_backend_name() == "sqlite":
            event.listen(self.engine, "connect", _sqlite_read_only_pragmas if read_only else _sqlite_pragmas)
        try:
            if read_only:
                self._check_schema()
            else:
                _ensure_schema(self.engine)
        except StoreUnavailable:
            self.close()
            raise
        except SQLAlchemyError as exc:
            self.close()
            raise StoreUnavailable(f"cannot open the run store {self.url}: {one_line(exc)}") from None
        self._session = sessionmaker(self.engine, expire_on_commit=False)

    def _check_file(self) -> tuple[int, int]:
        """(device, inode) of the SQLite file, after checking it is there and not empty."""
        path = self.sqlite_path
        try:
            info = path.stat()
        except FileNotFoundError:
            raise StoreUnavailable(
                f"no run store at {path}: the file does not exist "
                "(the dashboard never creates one; check --db or $FEDLA_DB)"
            ) from None
        except OSError as exc:
            raise StoreUnavailable(f"cannot read the run store {path}: {exc.strerror}") from None
        if not path.is_file():
            raise StoreUnavailable(f"the run store {path} is not a file")
        if info.st_size == 0:
            raise StoreUnavailable(f"the run store {path} is an empty file, not a run store")
        return info.st_dev, info.st_ino

    def _check_schema(self) -> None:
        with self.engine.connect() as conn:
            tables = set(inspect(conn).get_table_names())
            if "schema_version" not in tables or not {"runs", "rounds"} <= tables:
                raise StoreUnavailable(f"{self.url} is not a FedLookahead run store (no run-store tables)")
            version = conn.execute(select(SchemaVersion.version).where(SchemaVersion.id == 1)).scalar_one_or_none()
        if version != SCHEMA_VERSION:
            raise StoreUnavailable(
                f"the run store {self.url} has schema version {version}, this code reads "
                f"{SCHEMA_VERSION}: open it once with the server (which migrates it)"
            )

    def check_available(self) -> None:
        """Raise StoreUnavailable if a read-only store's file went away or was replaced since it opened.

        The file opened is held open, so its inode number cannot be reused: a file at the same path
        with another (device, inode) is another file, even one written in its place right away."""
        if self._pin is None:
            return
        try:
            current = self._check_file()
        except StoreUnavailable as exc:
            self.engine.dispose()  # let go of the deleted file (its pages are stale)
            raise StoreUnavailable(f"the run store is gone: {exc}") from None
        pinned = os.fstat(self._pin)
        if current != (pinned.st_dev, pinned.st_ino):
            self.engine.dispose()
            raise StoreUnavailable(
                f"the run store {self.sqlite_path} was replaced by another file since the "
                "dashboard opened it: restart the dashboard"
            )

    def close(self) -> None:
        self.engine.dispose()
        if self._pin is not None:
            os.close(self._pin)
            self._pin = None

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def schema_version(self) -> int:
        with self.engine.connect() as conn:
            return conn.execute(select(SchemaVersion.version).where(SchemaVersion.id == 1)).scalar_one()

    # ------------------------------------------------------------------------------------- writes

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
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(summary, handle, indent=2, allow_nan=False)
                handle.write("\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # -------------------------------------------------------------------------------------- reads

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
