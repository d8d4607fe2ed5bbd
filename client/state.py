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
    node-config.toml, supernode.log, daemon.json, flwr-home/   written by the daemon
    daemon.lock                 held by the one `fedla client` running on this folder (holds its pid)
    ledger.lock                 held by a round from reading the ledger to writing it (and by a reset)

`fedla client status` reads this folder (client.status); `fedla client forget` deletes chunks/ and
features/ but never the ledger and its marker.

When node config `heads-dir` is set (the daemon sets it to `common.paths.default_heads_dir()`,
i.e. $FEDLA_HEADS or <cache>/heads/latest, unless told otherwise), the newest heads are also
published there, so `fedla generate` on the device uses them by default.

Every function here is best effort: a full disk or a read-only folder is logged, never allowed to
fail a federated round.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping

from client.node_config import HEADS_DIR_KEY, STATE_DIR_KEY
from common.federation.protocol import ROUND_KEY, RUN_KEY, VERSION
from common.paths import LATEST_HEADS

log = logging.getLogger("fedla.client")

HEADS_META = "fedla_heads.json"
KEEP_VERSIONS = 3  # versioned head folders kept in the state dir (the newest ones)


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
    NODE_CONFIG: ClassVar[str] = "node-config.toml"
    SUPERNODE_LOG: ClassVar[str] = "supernode.log"
    DAEMON_STATUS: ClassVar[str] = "daemon.json"
    FLWR_HOME: ClassVar[str] = "flwr-home"
    DAEMON_LOCK: ClassVar[str] = "daemon.lock"
    LEDGER_LOCK: ClassVar[str] = "ledger.lock"
    PRIVATE_CACHES: ClassVar[tuple[str, ...]] = (CHUNKS, FEATURES)  # what `fedla client forget` deletes

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


def read_heads_meta(directory: Path) -> dict | None:
    try:
        return json.loads((directory / HEADS_META).read_text())
    except (OSError, ValueError):
        return None


def latest_heads(state: Path) -> tuple[Path, dict] | None:
    """(folder, metadata) of the newest heads kept in `state`, if any."""
    folder = StateDir(state).latest_heads
    meta = read_heads_meta(folder)
    return (folder.resolve(), meta) if meta else None


def _newer(meta: dict, current: dict | None) -> bool:
    """Replace the kept heads? Yes for a later version of the same run, or any trained heads of another run."""
    if current is None:
        return True
    if (meta["run"], meta["base_fingerprint"]) != (current.get("run"), current.get("base_fingerprint")):
        return True
    return int(meta["version"]) > int(current.get("version", -1))


def _swap_link(link: Path, target: Path) -> None:
    """Point `link` at `target` atomically (a temporary symlink renamed over the old one)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, link)


def _publish(source: Path, destination: Path) -> None:
    """Make `destination` hold the heads in `source`: a symlink swap, or a copy when it is a real folder."""
    if destination.is_symlink() or not destination.exists():
        _swap_link(destination, source)
        return
    tmp = destination.with_name(f".{destination.name}.{os.getpid()}.new")
    old = destination.with_name(f".{destination.name}.{os.getpid()}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    os.replace(destination, old)
    os.replace(tmp, destination)
    shutil.rmtree(old, ignore_errors=True)


def keep_global_heads(
    heads, node_config: Mapping[str, Any], run_id: int, server_round: int | None = None
) -> Path | None:
    """Store heads the server pushed (train or evaluate message) if newer than the kept ones.

    Untrained heads (version 0) are never kept. Returns the folder written, or None.
    """
    state = state_dir_of(node_config)
    version = int(heads.config.version)
    if state is None or version < 1:
        return None
    try:
        heads_root = StateDir(state).heads
        current = latest_heads(state)
        meta = {
            "run": int(run_id),
            "version": version,
            "base_fingerprint": heads.config.base_fingerprint,
            "num_heads": int(heads.config.num_heads),
            "round": server_round,
            "saved_at": time.time(),
        }
        if not _newer(meta, current[1] if current else None):
            return None
        safe = re.sub(r"[^A-Za-z0-9_-]", "_", str(run_id))
        target = heads_root / f"run-{safe}-v{version}"
        tmp = heads_root / f".{target.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        heads.save(tmp)
        meta["sha256"] = hashlib.sha256((tmp / "heads.safetensors").read_bytes()).hexdigest()
        (tmp / HEADS_META).write_text(json.dumps(meta, indent=1))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        _swap_link(StateDir(state).latest_heads, target)
        published = str(node_config.get(HEADS_DIR_KEY, "") or "")
        if published:
            _publish(target, Path(published).expanduser())
        _prune(heads_root, keep=target)
    except OSError as exc:
        log.warning("could not keep the global heads in %s: %s", state, exc)
        return None
    record_event(
        node_config,
        "heads",
        run=int(run_id),
        round=server_round,
        version=version,
        fingerprint=heads.config.base_fingerprint,
        sha256=meta["sha256"],
        path=str(target),
        published=published or None,
    )
    return target


def _prune(heads_root: Path, keep: Path) -> None:
    folders = sorted(
        (p for p in heads_root.glob("run-*-v*") if p.is_dir() and not p.is_symlink()),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in folders[KEEP_VERSIONS:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------ hooks called by client.client_app


def train_started(context, fit_config: Mapping[str, Any], heads) -> None:
    """Top of a local training round: keep the global heads it brought, note the start."""
    node_config = context.node_config
    if state_dir_of(node_config) is None:
        return
    server_round = fit_config.get(ROUND_KEY)
    keep_global_heads(heads, node_config, context.run_id, server_round)
    record_event(
        node_config,
        "train-start",
        run=int(context.run_id),
        fedla_run=fit_config.get(RUN_KEY),
        round=server_round,
        version=int(heads.config.version),
    )


def train_finished(context, fit_config: Mapping[str, Any], metrics: Mapping[str, Any], weight: int) -> None:
    if state_dir_of(context.node_config) is None:
        return
    record_event(
        context.node_config,
        "train-done",
        run=int(context.run_id),
        round=fit_config.get(ROUND_KEY),
        weight=int(weight),
        metrics=dict(metrics),  # the wire's own keys (common.federation.protocol), not renamed
    )


def heads_received(context, heads, heads_config: Mapping[str, Any]) -> None:
    """An evaluation message carries the new global heads: keep them."""
    keep_global_heads(heads, context.node_config, context.run_id, heads_config.get(ROUND_KEY))


def evaluated(context, heads_config: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
    """An evaluation ran; `final` when it was the run's last round (its heads are the run's result)."""
    if state_dir_of(context.node_config) is None:
        return
    server_round = heads_config.get(ROUND_KEY)
    try:
        final = int(server_round) >= int(context.run_config.get("num-server-rounds", 0)) > 0
    except (TypeError, ValueError):
        final = False
    record_event(
        context.node_config,
        "eval",
        run=int(context.run_id),
        round=server_round,
        version=heads_config.get(VERSION),
        final=int(final),
        metrics=dict(metrics),  # the wire's own keys (common.federation.protocol), not renamed
    )
