"""The global heads a device keeps: heads/run-<R>-v<V>/ (the newest KEEP_VERSIONS), heads/latest
swapped atomically to the newest, and a copy published at node config `heads-dir` (where `fedla
generate` and the endpoint look by default).

Best effort: a full disk or a read-only folder is logged, never allowed to fail a federated round.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

from client.events import record_event
from client.node_config import HEADS_DIR_KEY
from client.state import StateDir, state_dir_of

log = logging.getLogger("fedla.client")

HEADS_META = "fedla_heads.json"
KEEP_VERSIONS = 3  # versioned head folders kept in the state dir (the newest ones)


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
