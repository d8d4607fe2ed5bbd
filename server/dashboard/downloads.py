"""Checkpoint downloads: a recorded checkpoint served as its file or a zip of its folder, only from under
the run's own folder (the database is not trusted to name any other file)."""

from __future__ import annotations

import logging
import os
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

from fastapi import HTTPException
from fastapi.responses import FileResponse, Response, StreamingResponse

log = logging.getLogger("fedla.dashboard")


def _safe_filename(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "run"


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def run_folders_under(roots: list[Path], run_id: str) -> list[Path]:
    """Where the run's checkpoints may live: ``<root>/<run-id>/`` for each run-dir root. Only the
    operator chooses the roots (never a database row), and a run id that is not one path component
    has no folder."""
    if not run_id or run_id in (".", "..") or "/" in run_id or "\\" in run_id or "\0" in run_id:
        return []
    return [Path(os.path.realpath(root / run_id)) for root in roots]


def checkpoint_response(run_id: str, checkpoint: dict, run_folders: list[Path]) -> Response:
    """Serve exactly a recorded checkpoint path: the file, or a zip of the directory's regular files.

    The path (symlinks resolved) must lie under the run's folder (`run_folders_under`): a database row that
    names any other file (``/etc/passwd``) is never served. Symlinks may not lead outside the recorded
    location either (the file's own directory, or the checkpoint directory for a zip)."""
    recorded = Path(checkpoint["path"]).expanduser()
    if not recorded.is_absolute():
        recorded = Path.cwd() / recorded
    recorded = Path(os.path.abspath(recorded))
    resolved = recorded.resolve()
    headers = {
        "X-Checkpoint-Sha256": checkpoint["sha256"],
        "X-Checkpoint-Round": str(checkpoint["round"]),
        "X-Head-Version": str(checkpoint["head_version"]),
    }
    stem = f"{_safe_filename(run_id)}-round{checkpoint['round']}-v{checkpoint['head_version']}"
    if not any(_inside(resolved, folder) and resolved != folder for folder in run_folders):
        log.warning("refused checkpoint path outside the run folder of %r", run_id)
        raise HTTPException(404, "the recorded checkpoint path is outside the run's folder: not served")
    if not _inside(resolved, recorded.parent.resolve()):
        raise HTTPException(404, "checkpoint path leaves its recorded location")
    if resolved.is_file():
        return FileResponse(
            resolved,
            media_type="application/octet-stream",
            headers=headers,
            filename=f"{stem}-{_safe_filename(recorded.name)}",
        )
    if resolved.is_dir():
        return StreamingResponse(
            _zip_directory(resolved),
            media_type="application/zip",
            headers={**headers, "Content-Disposition": f'attachment; filename="{stem}.zip"'},
        )
    raise HTTPException(404, f"checkpoint of round {checkpoint['round']} is recorded but no longer on disk")


def _zip_directory(root: Path, chunk: int = 1 << 20) -> Iterator[bytes]:
    with tempfile.SpooledTemporaryFile(max_size=64 << 20) as buffer:
        with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(root.rglob("*")):
                target = path.resolve()
                if target.is_file() and _inside(target, root):
                    archive.write(target, arcname=path.relative_to(root).as_posix())
        buffer.seek(0)
        while data := buffer.read(chunk):
            yield data
