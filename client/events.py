"""A device's event log, <state>/events.jsonl: one JSON line per ClientApp step (train start and done,
heads kept, evaluation), which the daemon turns into one log line per round (client/daemon/reporter.py).

Best effort: a full disk or a read-only folder is logged, never allowed to fail a federated round.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Mapping

from client.state import StateDir, state_dir_of

log = logging.getLogger("fedla.client")


def record_event(node_config: Mapping[str, Any], event: str, **fields: Any) -> None:
    """Append one JSON line to <state>/events.jsonl (no state dir: nothing)."""
    state = state_dir_of(node_config)
    if state is None:
        return
    line = json.dumps({"time": round(time.time(), 3), "event": event, **fields}, default=_plain)
    try:
        state.mkdir(parents=True, exist_ok=True)
        with open(StateDir(state).events, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
    except OSError as exc:
        log.warning("cannot write the event log in %s: %s", state, exc)


def _plain(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)
