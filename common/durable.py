"""Files written whole or not at all: a crash leaves the old file or the new one, never half of one.

Every writer goes through a temporary file in the same folder, named `.<name>.<pid>.tmp` (so a crash's
leftovers can be found by that pattern), and a rename. `durable=True` also waits until the file and the
rename are on disk, for what must survive a power cut (a device's privacy ledger before its update leaves).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable


def replace_file(path: Path, write: Callable[[Path], None], *, durable: bool = False) -> None:
    """Make `path` what `write(tmp)` writes to a temporary file, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself
        finally:
            os.close(folder)


def write_text(path: Path, text: str, *, durable: bool = False) -> None:
    """`path.write_text(text)`, atomically."""
    replace_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable=durable)


def write_json(path: Path, data: Any, *, indent: int = 1, durable: bool = False) -> None:
    """`json.dumps(data)` at `path`, atomically."""
    write_text(path, json.dumps(data, indent=indent), durable=durable)
