"""Heads hot-swap: the newest heads in a watched folder, handed to requests as whole snapshots."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from client.kept_heads import read_heads_meta
from common.errors import FedLookaheadError, first_line
from common.heads.lookahead import CONFIG_FILE, WEIGHTS_FILE, DraftHeads
from common.model.base import BaseModel

log = logging.getLogger("fedla.endpoint")


@dataclass(frozen=True)
class HeadsSnapshot:
    """The heads one request decodes with; version None: no usable heads (plain decoding)."""

    version: int | None
    heads: DraftHeads | None


def _stamp(directory: Path) -> tuple | None:
    """What changes when the folder's heads change: its resolved target and its files' identities.

    A symlink swap changes the target; a published copy replaced in place gets new inodes.
    """
    try:
        files = [os.stat(directory / name) for name in (WEIGHTS_FILE, CONFIG_FILE)]
    except OSError:
        return None
    return (os.path.realpath(directory), *((s.st_ino, s.st_mtime_ns, s.st_size) for s in files))


class HeadsHolder:
    """The newest heads in `directory`, swapped atomically: readers get whole snapshots, never a mix."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else None
        self._snapshot = HeadsSnapshot(None, None)
        self._seen: tuple | None = None

    def current(self) -> HeadsSnapshot:
        return self._snapshot  # one attribute read: atomic

    def swap(self, heads: DraftHeads | None, version: int | None) -> HeadsSnapshot:
        self._snapshot = HeadsSnapshot(version, heads)
        return self._snapshot

    def refresh(self, base: BaseModel) -> HeadsSnapshot:
        """Load the folder's heads if they changed since the last look (a few stat calls otherwise).

        Heads that do not load (damaged, or for another base) are logged and the current ones kept;
        they are not retried until the folder changes again.
        """
        if self.directory is None:
            return self._snapshot
        stamp = _stamp(self.directory)
        if stamp is None or stamp == self._seen:
            return self._snapshot
        self._seen = stamp
        try:
            heads = DraftHeads.load(self.directory, base).eval()
        except FedLookaheadError as exc:
            log.warning("new heads in %s not used: %s", self.directory, first_line(exc))
            return self._snapshot
        meta = read_heads_meta(self.directory) or {}
        version = int(meta.get("version", heads.config.version))
        log.info("endpoint: heads version %s from %s", version, os.path.realpath(self.directory))
        return self.swap(heads, version)
