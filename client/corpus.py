"""A client's text as chunks: files -> (chunk, group) rows, cached in memory and on disk.

The corpus is tokenised once per machine: chunk tensors are cached on disk, keyed by files,
tokenizer and chunk length: under a device's state folder, `<state-dir>/chunks`, since they are its
private text; under the FedLookahead cache for simulated clients. Each chunk's group is the
top-level package/module (or first folder) it comes from, which the partitioners use
(client/partitions.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from client.node_config import STATE_DIR_KEY
from client.state import StateDir
from common.data.chunks import read_text, stdlib_dir, stdlib_files, text_files
from common.data.packages import PRIVATE_PACKAGES, package_sources
from common.durable import replace_file
from common.errors import FedLookaheadError
from common.model.base import BaseModel
from common.paths import cache_root

log = logging.getLogger(__name__)

PRIVATE_SOURCE = "private-packages"  # data-source of the simulated users' code: the private package split
_LOCK = threading.Lock()
_CORPORA: dict[tuple, "Corpus"] = {}


@dataclass
class Corpus:
    chunks: torch.Tensor  # (N, chunk_len) token ids
    groups: list[str]  # top-level package/module (or first folder) of each chunk


@functools.lru_cache(maxsize=16)
def _group_files(source: str) -> list[tuple[Path, str]]:
    """(file, group) pairs: stdlib train split grouped by top-level name, the private installed packages
    (common/data/packages.py) by package, or a folder by first component.

    Listed once per process (the stdlib walk alone takes over a second).
    """
    if source == PRIVATE_SOURCE:
        return [(path, name) for name in PRIVATE_PACKAGES for path in package_sources(name)]
    if source == "stdlib":
        root = stdlib_dir()
        return [(p, p.relative_to(root).parts[0].removesuffix(".py")) for p in stdlib_files("train")]
    root = Path(source).expanduser().resolve()
    return [
        (p, p.relative_to(root).parts[0] if len(p.relative_to(root).parts) > 1 else p.stem) for p in text_files(root)
    ]


def chunk_corpus(files: list[tuple[Path, str]], tokenizer, chunk_len: int, progress: bool = False) -> Corpus:
    """Tokenise every readable file and cut it into non-overlapping chunks (never across files)."""
    from tqdm import tqdm

    chunks: list[torch.Tensor] = []
    chunk_groups: list[str] = []
    with tqdm(total=len(files), desc="tokenising", unit="file", disable=not progress, leave=False) as bar:
        for start in range(0, len(files), 256):  # batches keep memory flat
            texts, groups = [], []
            for path, group in files[start : start + 256]:
                text = read_text(path)
                if text and text.strip():
                    texts.append(text)
                    groups.append(group)
            encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
            for ids, group in zip(encoded, groups):
                usable = len(ids) - len(ids) % chunk_len
                if usable:
                    block = torch.tensor(ids[:usable], dtype=torch.long).view(-1, chunk_len)
                    chunks.extend(block)
                    chunk_groups.extend([group] * len(block))
            bar.update(len(files[start : start + 256]))
    if not chunks:
        raise FedLookaheadError(f"no file is at least {chunk_len} tokens long")
    return Corpus(torch.stack(chunks), chunk_groups)


def chunk_cache_dir(node_config: Mapping[str, Any]) -> Path:
    """Where chunk tensors are cached: a device's state folder (its private text stays there), else the cache."""
    if node_config.get(STATE_DIR_KEY):
        return StateDir(Path(str(node_config[STATE_DIR_KEY])).expanduser()).chunks
    return cache_root() / "chunks"


def load_corpus(
    source: str, base: BaseModel, chunk_len: int, cache_dir: Path | None = None, progress: bool = False
) -> Corpus:
    """The chunks of `source` for `base`'s tokenizer: memory cache, then disk cache (`cache_dir`,
    default <cache>/chunks), then tokenise."""
    key = (source, base.fingerprint, chunk_len)
    with _LOCK:
        if key in _CORPORA:
            return _CORPORA[key]
        files = _group_files(source)
        listing = json.dumps([[str(p), p.stat().st_size, g] for p, g in files])
        key_hash = hashlib.sha256(f"{base.fingerprint}|{chunk_len}|{listing}".encode()).hexdigest()[:16]
        cache_file = (cache_dir or cache_root() / "chunks") / f"{key_hash}.pt"
        corpus = None
        if cache_file.is_file():
            try:
                saved = torch.load(cache_file, weights_only=True)
                corpus = Corpus(saved["chunks"], list(saved["groups"]))
            except Exception as exc:  # a corrupt cache is rebuilt, never trusted
                log.warning("ignoring unreadable chunk cache %s: %s", cache_file, exc)
        if corpus is None:
            corpus = chunk_corpus(files, base.tokenizer, chunk_len, progress=progress)
            saved = {"chunks": corpus.chunks, "groups": corpus.groups}
            replace_file(cache_file, lambda tmp: torch.save(saved, tmp))  # concurrent actors never read half a file
        _CORPORA[key] = corpus
        return corpus
