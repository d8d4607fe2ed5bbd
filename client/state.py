"""A device's private state folder, written by the ClientApp and read by the daemon (`fedla client`).

Layout of the state dir (node config `state-dir`; the daemon's default is <cache>/client), each path named
once by `StateDir` below:

    privacy-ledger.json         every run's DP accountant history: the device's lifetime privacy
                                spending (client.training.ledger; survives restarts and new runs)
    trained-once                when the device first trained and how many DP-SGD steps its ledger
                                held last; a ledger missing or behind it stops training until
                                `fedla client reset-ledger --state-dir DIR --yes`
    heads/run-<R>-v<V>/         global heads pushed by the server (heads.safetensors, heads_config.json,
                                fedla_heads.json with version, base fingerprint, run, round, sha256)
    heads/latest -> run-<R>-v<V>  the newest of them (a symlink swapped atomically)
    events.jsonl                one JSON line per ClientApp event (train start/done, heads kept,
                                evaluation), which the daemon turns into one log line per round
    chunks/                     the device's private files, tokenised (client.corpus; private text)
    features/                   the base's features of those chunks (common.data.features; private)
    datastore/                  the suffix-array index of those files the endpoint drafts from
                                (common.decoding.datastore; private, never sent)
    node-config.toml, supernode.log, daemon.json, flwr-home/   written by the daemon
    daemon.lock                 held by the one `fedla client` running on this folder (holds its pid)
    ledger.lock                 held by a round from reading the ledger to writing it (and by a reset)

`fedla client status` reads this folder (client.status); `fedla client forget` deletes chunks/,
features/ and datastore/ but never the ledger and its marker.

When node config `heads-dir` is set (the daemon sets it to `common.paths.default_heads_dir()`,
i.e. $FEDLA_HEADS or <cache>/heads/latest, unless told otherwise), the newest heads are also
published there, so `fedla generate` on the device uses them by default.

Its pieces: the layout and the locks here; the event log in client/events.py; the kept heads in
client/kept_heads.py; what the ClientApp records at each step in client/device_hooks.py.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping

from client.node_config import STATE_DIR_KEY
from common.paths import LATEST_HEADS


@dataclass(frozen=True)
class StateDir:
    """Every file and folder of a device's state folder, named once (the layout above)."""

    root: Path

    LEDGER: ClassVar[str] = "privacy-ledger.json"
    TRAINED_MARKER: ClassVar[str] = "trained-once"
    HEADS: ClassVar[str] = "heads"
    EVENTS: ClassVar[str] = "events.jsonl"
    CHUNKS: ClassVar[str] = "chunks"
    FEATURES: ClassVar[str] = "features"
    DATASTORE: ClassVar[str] = "datastore"
    NODE_CONFIG: ClassVar[str] = "node-config.toml"
    SUPERNODE_LOG: ClassVar[str] = "supernode.log"
    DAEMON_STATUS: ClassVar[str] = "daemon.json"
    FLWR_HOME: ClassVar[str] = "flwr-home"
    DAEMON_LOCK: ClassVar[str] = "daemon.lock"
    LEDGER_LOCK: ClassVar[str] = "ledger.lock"
    PRIVATE_CACHES: ClassVar[tuple[str, ...]] = (CHUNKS, FEATURES, DATASTORE)  # what `fedla client forget` deletes

    @property
    def ledger(self) -> Path:
        return self.root / self.LEDGER

    @property
    def trained_marker(self) -> Path:
        return self.root / self.TRAINED_MARKER

    @property
    def heads(self) -> Path:
        return self.root / self.HEADS

    @property
    def latest_heads(self) -> Path:
        return self.root / LATEST_HEADS

    @property
    def events(self) -> Path:
        return self.root / self.EVENTS

    @property
    def chunks(self) -> Path:
        return self.root / self.CHUNKS

    @property
    def features(self) -> Path:
        return self.root / self.FEATURES

    @property
    def datastore(self) -> Path:
        return self.root / self.DATASTORE

    @property
    def node_config(self) -> Path:
        return self.root / self.NODE_CONFIG

    @property
    def supernode_log(self) -> Path:
        return self.root / self.SUPERNODE_LOG

    @property
    def daemon_status(self) -> Path:
        return self.root / self.DAEMON_STATUS

    @property
    def flwr_home(self) -> Path:
        return self.root / self.FLWR_HOME


class StateLocked(OSError):
    """Another process holds a lock on this state folder."""


@contextmanager
def state_lock(state: Path, name: str, wait_seconds: float = 0.0) -> Iterator[None]:
    """Hold the exclusive lock `name` in `state` for the block (flock: the kernel frees it when the holder
    dies, so a SIGKILL never leaves a stale lock). Waits up to `wait_seconds`, then raises StateLocked
    naming the holder's pid."""
    state.mkdir(parents=True, exist_ok=True)
    path = state / name
    handle = open(path, "a+", encoding="utf-8")
    try:
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    handle.seek(0)
                    holder = handle.read().strip() or "unknown"
                    raise StateLocked(errno.EAGAIN, f"{path} is held by process {holder}") from None
                time.sleep(0.1)
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        handle.close()  # closing the descriptor releases the lock


def state_dir_of(node_config: Mapping[str, Any]) -> Path | None:
    value = str(node_config.get(STATE_DIR_KEY, "") or "")
    return Path(value).expanduser() if value else None


def read_node_config(state_dir: Path) -> dict:
    """The node config the daemon last wrote in `state_dir` ({} when none or unreadable)."""
    import tomllib

    try:
        return tomllib.loads(StateDir(state_dir).node_config.read_text())
    except (OSError, ValueError):
        return {}
