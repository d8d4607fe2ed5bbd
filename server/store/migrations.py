"""Schema migrations: a fresh store gets today's schema, an older one is upgraded step by step."""

from __future__ import annotations

from typing import Callable

from sqlalchemy import JSON, Float, inspect, select, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, OperationalError

from server.store.schema import SCHEMA_VERSION, STORE_TABLES, Base, SchemaVersion


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


def ensure_schema(engine: Engine) -> None:
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
