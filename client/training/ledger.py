"""A device's lifetime privacy ledger, and the marker that makes it fail closed.

Every run's history is kept in one ledger, <state-dir>/privacy-ledger.json, and all of them compose
into the device's lifetime epsilon at the device's delta. A small marker, <state-dir>/trained-once,
remembers that the device has trained and how many DP-SGD steps its ledger held; a ledger that is
missing, unreadable or behind the marker stops training until the owner resets it on purpose
(`reset_ledger`, i.e. `fedla client reset-ledger`). A round holds the ledger lock from reading the
ledger to writing it (client/training/local_round.py's device_round), and so does a reset.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from client.state import StateDir, StateLocked, state_lock
from client.training.dp import History, PrivacyState
from common.durable import write_json
from common.errors import FedLookaheadError

LEDGER_FORMAT = "fedla-privacy-ledger/1"
LEDGER_WAIT_SECONDS = 600.0  # how long a round waits for another round (or a reset) to release the ledger


def remove_stale_temporaries(state_dir: Path) -> None:
    """Temporary ledger and marker files a killed writer left (called under the ledger lock, so no writer
    is running)."""
    for name in (StateDir.LEDGER, StateDir.TRAINED_MARKER):
        for tmp in state_dir.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)


class LedgerError(FedLookaheadError):
    """A device's privacy ledger cannot be trusted: it does not train until its owner resets the ledger."""


@dataclass
class Ledger:
    """A device's lifetime privacy spending: every run's accountant history, in one file."""

    state_dir: Path
    runs: dict[str, PrivacyState] = field(default_factory=dict)
    resets: list[dict] = field(default_factory=list)
    first_trained: str | None = None  # from the trained-once marker

    @property
    def path(self) -> Path:
        return StateDir(self.state_dir).ledger

    def run(self, run_key: str) -> PrivacyState:
        return self.runs.setdefault(run_key, PrivacyState(run_key))

    def history(self, excluding: str | None = None) -> History:
        """Every run's history, concatenated (the device's lifetime), or every run's but one."""
        return [h for key, state in self.runs.items() if key != excluding for h in state.history]

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self.history())


def _reset_hint(state_dir: Path) -> str:
    return (
        f"this device does not train until its owner resets the ledger on purpose: "
        f"`fedla client reset-ledger --state-dir {state_dir} --yes`"
    )


def _read_marker(state_dir: Path) -> dict | None:
    path = StateDir(state_dir).trained_marker
    if not path.exists():
        return None
    try:
        marker = json.loads(path.read_text())
        int(marker["steps"])
        return marker
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LedgerError(
            f"privacy marker {path} is unreadable ({_first_line(exc)}); {_reset_hint(state_dir)}"
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def load_ledger(state_dir: Path) -> Ledger:
    """The device's ledger (empty before it ever trained); LedgerError when it cannot be trusted.

    That is when it is unreadable, or when the trained-once marker says the device has trained and
    the ledger is missing or holds fewer DP-SGD steps than the device has taken (deleted, replaced by
    an empty or older copy): reading it as 0 would give the device's budget back silently.
    """
    state_dir = state_dir.expanduser()
    marker = _read_marker(state_dir)
    ledger = Ledger(state_dir, first_trained=marker.get("first_trained") if marker else None)
    if not ledger.path.exists():
        if marker is not None:
            raise LedgerError(
                f"privacy ledger {ledger.path} is missing but this device has trained "
                f"(since {ledger.first_trained}); {_reset_hint(state_dir)}"
            )
        return ledger
    try:
        data = json.loads(ledger.path.read_text())
        if data.get("format") != LEDGER_FORMAT:
            raise ValueError(f"not a {LEDGER_FORMAT} file")
        ledger.runs = {key: PrivacyState.from_json({"run_key": key, **run}) for key, run in data["runs"].items()}
        ledger.resets = list(data.get("resets", []))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LedgerError(
            f"privacy ledger {ledger.path} is unreadable ({_first_line(exc)}); {_reset_hint(state_dir)}"
        ) from exc
    if marker is not None and ledger.steps < int(marker["steps"]):
        raise LedgerError(
            f"privacy ledger {ledger.path} holds {ledger.steps} DP-SGD steps but this device has "
            f"taken {int(marker['steps'])}; {_reset_hint(state_dir)}"
        )
    return ledger


def save_ledger(ledger: Ledger) -> None:
    """Write the ledger, then the trained-once marker that guards it (in this order: a crash in between
    leaves a ledger ahead of its marker, which is accepted)."""
    now = _utc_now()
    ledger.first_trained = ledger.first_trained or now
    write_json(
        ledger.path,
        {
            "format": LEDGER_FORMAT,
            "runs": {
                key: {name: value for name, value in state.to_json().items() if name != "run_key"}
                for key, state in ledger.runs.items()
            },
            "resets": ledger.resets,
            "updated": now,
        },
        durable=True,
    )
    write_json(
        StateDir(ledger.state_dir).trained_marker,
        {"first_trained": ledger.first_trained, "updated": now, "steps": ledger.steps},
        durable=True,
    )


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def reset_ledger(state_dir: Path, yes: bool = False) -> str:
    """Start a device's privacy ledger over, on purpose (`fedla client reset-ledger --state-dir DIR --yes`).

    This forgets what the device has spent so far, so its whole budget is available again; the privacy
    its past updates cost does not go away (the server and anyone who saw those updates keep them).
    The old ledger, when there is one, is kept beside it as privacy-ledger.json.reset-<time>, and the
    reset is recorded in the new one. Without `yes` nothing changes and FedLookaheadError says what
    resetting means. A round in progress holds the ledger lock: the reset waits for it to finish.
    Returns one line saying what was done.
    """
    state_dir = state_dir.expanduser()
    path = StateDir(state_dir).ledger
    if not yes:
        raise FedLookaheadError(
            f"resetting {path} forgets this device's past privacy spending and makes its whole budget available "
            f"again, although the privacy its past updates cost does not go away; add --yes to reset it"
        )
    if not state_dir.is_dir():
        raise FedLookaheadError(f"state folder not found: {state_dir}")
    try:
        with state_lock(
            state_dir, StateDir.LEDGER_LOCK, wait_seconds=LEDGER_WAIT_SECONDS
        ):  # never under a running round
            return _reset_ledger(state_dir, path)
    except StateLocked as exc:
        raise FedLookaheadError(f"cannot reset {path}: a round still holds it ({exc})") from None


def _reset_ledger(state_dir: Path, path: Path) -> str:
    remove_stale_temporaries(state_dir)
    try:
        marker = _read_marker(state_dir)
    except LedgerError:
        marker = None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept = path.with_name(f"{path.name}.reset-{stamp}") if path.exists() else None
    if kept is not None:
        os.replace(path, kept)
    forgotten = int(marker["steps"]) if marker else None
    ledger = Ledger(
        state_dir,
        first_trained=marker.get("first_trained") if marker else None,
        resets=[{"time": _utc_now(), "forgotten_steps": forgotten, "old_ledger": str(kept) if kept else None}],
    )
    save_ledger(ledger)
    return (
        f"privacy ledger {path} reset: past spending forgotten"
        + (f" ({forgotten} DP-SGD steps)" if forgotten is not None else "")
        + (f", old ledger kept as {kept.name}" if kept else "")
        + "; the device's real privacy loss from past updates remains"
    )
