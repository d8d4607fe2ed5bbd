"""Opening a run store: the database URL, the SQLAlchemy engine (SQLite pragmas, read-only mode), and the
checks that a read-only store is still the file it opened."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Self
from urllib.parse import quote

from sqlalchemy import create_engine, event, inspect, select
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import sessionmaker
from sqlalchemy.pool import StaticPool

from common.errors import first_line
from common.federation.config import DEFAULTS
from server.store.migrations import ensure_schema
from server.store.schema import SCHEMA_VERSION, SchemaVersion

DB_FILE = "fedla.db"  # the run store's SQLite file in the run-dir, beside the runs' <run-id>/ folders
DB_ENV = "FEDLA_DB"


def store_url(url: str | None = None, run_dir: str | Path | None = None) -> str:
    """Where the run store is, by one rule for the server and the dashboard: `url` (the run config's
    store-url, the dashboard's --db), else $FEDLA_DB, else the SQLite file fedla.db in `run_dir` (the run
    config's run-dir; without one, run-dir's default, runs/). Each is a SQLAlchemy URL or a file path (a
    bare path is a SQLite file: `StoreEngine`)."""
    default = Path(run_dir or DEFAULTS["run-dir"]).expanduser().resolve() / DB_FILE
    return url or os.environ.get(DB_ENV, "").strip() or str(default)


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
    return first_line(orig if orig is not None else exc)[:limit]


def _sqlite_file(parsed: URL) -> Path | None:
    """The file behind a SQLite URL; None for in-memory SQLite."""
    database = parsed.database or ""
    if database in ("", ":memory:") or database.startswith("file::memory:") or parsed.query.get("mode") == "memory":
        return None
    if database.startswith("file:"):
        database = database[len("file:") :]
    return Path(database).expanduser()


class StoreEngine:
    """One run store's engine and sessions; the base of `RunStore` (server/store/run_store.py).

    ``read_only=True`` (the dashboard): an existing store is opened without writing anything (SQLite
    ``mode=ro``, no schema creation, no migration, no WAL pragma); a missing or empty file, or one
    that is not a run store, is refused with a one-line ``StoreUnavailable``, and nothing is created.
    A write-protected file (no write bit, e.g. 0444) is read as ``immutable``, so it opens in a
    read-only folder too. Reading a live WAL store in a writable folder may leave SQLite's empty
    ``-wal``/``-shm`` companions beside it (SQLite's reader protocol; the database itself is untouched).
    """

    def __init__(self, url: str | None = None, *, read_only: bool = False):
        url = url if url is not None else store_url()
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
                ensure_schema(self.engine)
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def schema_version(self) -> int:
        with self.engine.connect() as conn:
            return conn.execute(select(SchemaVersion.version).where(SchemaVersion.id == 1)).scalar_one()
