"""Drafts from the device's own files: a suffix array over their tokens (retrieval drafting, as REST
and SuffixDecoding do).

The files are tokenised once and concatenated, a SEPARATOR between files so no match spans two. The
index is a suffix array of the *reversed* stream: the context's last tokens, read backwards, are a
prefix of the reversed suffixes that end where an occurrence ends, so one pass of range narrowing
(one binary search per context token) finds the longest suffix of the context that occurs in the
files, with all its occurrences. What followed those occurrences, counted into a trie, is the draft:
each node's estimate is the share of occurrences that continued that way, which AMS-LD calibrates
per depth and prices with the same cost model as the heads' and prompt lookup's candidates.

The index lives on the device and never leaves it, so it needs no privacy accounting. Memory: four
int32 arrays, 16 bytes per token (a 1M-token datastore: 16 MB).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from transformers import PreTrainedTokenizerBase

from common.data.chunks import read_text
from common.durable import replace_file
from common.errors import FedLookaheadError

log = logging.getLogger(__name__)

SEPARATOR = -1  # between files: matches no token, so no match or continuation crosses files
SORTED_PREFIX = 64  # suffixes are sorted by their first 64 tokens: longer matches are never needed
FORMAT = 1


def reversed_suffix_array(stream: np.ndarray) -> np.ndarray:
    """Start positions of the suffixes of `stream`, sorted by their first SORTED_PREFIX tokens
    (prefix doubling: each pass sorts by twice as many tokens, with numpy's lexsort)."""
    n = len(stream)
    rank = np.unique(stream, return_inverse=True)[1].astype(np.int64) + 1  # 0 is "past the end"
    order = np.argsort(rank, kind="stable")
    span = 1
    while span < SORTED_PREFIX:
        following = np.zeros(n, dtype=np.int64)
        following[: n - span] = rank[span:]
        order = np.lexsort((following, rank))
        changed = (np.diff(rank[order]) != 0) | (np.diff(following[order]) != 0)
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.concatenate([[1], 1 + np.cumsum(changed)])
        span *= 2
        if rank.max() == n:  # every suffix is distinct already
            break
    return order.astype(np.int32)


@dataclass(frozen=True)
class StoreDraft:
    """A trie of continuations: node i continues `parents[i]` (-1: the context) by `tokens[i]`; `shares[i]` is
    the fraction of the occurrences that continued along the whole path to it."""

    tokens: list[int]
    parents: list[int]
    shares: list[float]
    match_length: int
    occurrences: int


class Datastore:
    """The suffix-array index of a device's files (see the module docstring)."""

    def __init__(self, stream: np.ndarray, suffixes: np.ndarray | None = None, files: int = 0) -> None:
        self.files = files
        # padded: a gather past the end reads a SEPARATOR instead of failing
        pad = np.full(SORTED_PREFIX, SEPARATOR, dtype=np.int32)
        self._stream_padded = np.concatenate([np.asarray(stream, dtype=np.int32), pad])
        self._reversed_padded = np.concatenate([self.stream[::-1], pad])
        self.suffixes = reversed_suffix_array(self.reversed) if suffixes is None else suffixes.astype(np.int32)
        self._first = self.reversed[self.suffixes]  # the first column of the sorted suffixes

    @property
    def stream(self) -> np.ndarray:
        return self._stream_padded[:-SORTED_PREFIX]

    @property
    def reversed(self) -> np.ndarray:
        return self._reversed_padded[:-SORTED_PREFIX]

    def __len__(self) -> int:
        return len(self.stream)

    # ------------------------------------------------------------------ building and caching
    @classmethod
    def from_token_lists(cls, documents: Sequence[Sequence[int]]) -> Datastore:
        parts: list[int] = []
        for document in documents:
            if document:
                parts.extend(document)
                parts.append(SEPARATOR)
        if not parts:
            raise FedLookaheadError("the datastore has no text: nothing to draft from")
        return cls(np.array(parts, dtype=np.int32), files=sum(1 for d in documents if d))

    @classmethod
    def from_files(cls, files: Sequence[Path], tokenizer: PreTrainedTokenizerBase) -> Datastore:
        texts = [text for text in (read_text(path) for path in files) if text and text.strip()]
        if not texts:
            raise FedLookaheadError("the datastore's files hold no readable text")
        return cls.from_token_lists(tokenizer(texts, add_special_tokens=False)["input_ids"])

    def save(self, path: Path) -> None:
        def write(tmp: Path) -> None:
            with open(tmp, "wb") as handle:
                np.savez(handle, stream=self.stream, suffixes=self.suffixes, files=self.files, format=FORMAT)

        replace_file(path, write)

    @classmethod
    def load(cls, path: Path) -> Datastore:
        try:
            with np.load(path) as data:
                if int(data["format"]) != FORMAT or len(data["stream"]) != len(data["suffixes"]):
                    raise ValueError("another format")
                return cls(data["stream"], data["suffixes"], int(data["files"]))
        except (OSError, ValueError, KeyError) as exc:
            raise FedLookaheadError(f"datastore index {path} is unreadable ({exc})") from exc

    # ------------------------------------------------------------------ drafting
    def longest_match(self, context: Sequence[int], max_length: int) -> tuple[int, int, int]:
        """(length, lo, hi): the longest suffix of `context` (at most `max_length` tokens) that occurs in
        the files, and the range of the suffix array holding its occurrences."""
        lo, hi, length = 0, len(self.suffixes), 0
        for j in range(min(max_length, len(context), SORTED_PREFIX)):
            token = context[-1 - j]
            column = self._first[lo:hi] if j == 0 else self._reversed_padded[self.suffixes[lo:hi] + j]
            left, right = np.searchsorted(column, token, "left"), np.searchsorted(column, token, "right")
            if left == right:
                break
            lo, hi, length = lo + int(left), lo + int(right), j + 1
        return length, lo, hi

    def draft(
        self, context: Sequence[int], depth: int, samples: int, min_match: int, max_match: int = 32
    ) -> StoreDraft | None:
        """The continuations of the longest match of the context's end (at least `min_match` tokens): a
        trie `depth` deep over at most `samples` occurrences (evenly spaced over all of them)."""
        length, lo, hi = self.longest_match(context, max_match)
        if length < min_match or depth < 1:
            return None
        chosen = self.suffixes[lo:hi]
        if len(chosen) > samples:
            chosen = chosen[np.linspace(0, len(chosen) - 1, samples).round().astype(np.int64)]
        after = len(self.stream) - chosen.astype(np.int64)  # stream index just after each occurrence's end
        rows = self._stream_padded[after[:, None] + np.arange(depth)].tolist()
        node_of: dict[tuple[int, int], int] = {}
        counts: list[int] = []
        tokens: list[int] = []
        parents: list[int] = []
        for continuation in rows:
            node = -1
            for token in continuation:
                if token == SEPARATOR:
                    break
                index = node_of.get((node, token))
                if index is None:
                    index = node_of[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                    counts.append(0)
                counts[index] += 1
                node = index
        if not tokens:
            return None
        total = len(rows)
        return StoreDraft(tokens, parents, [c / total for c in counts], length, hi - lo)


KEPT_INDEXES = 4  # a cache folder keeps the newest few indexes (one per file set seen lately)


def datastore_for(
    files: Sequence[Path], tokenizer: PreTrainedTokenizerBase, cache_dir: Path, progress: bool = True
) -> Datastore:
    """The index of `files`, built once and cached in `cache_dir` under a key of the files (path, size,
    mtime) and the tokenizer, so an edited file rebuilds it; older indexes beyond KEPT_INDEXES are removed."""
    if not files:
        raise FedLookaheadError("no files to index for the datastore")
    digest = hashlib.sha256(tokenizer.name_or_path.encode() + str(len(tokenizer)).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    cached = cache_dir / f"datastore-{digest.hexdigest()[:16]}.npz"
    if cached.exists():
        try:
            store = Datastore.load(cached)
            cached.touch()  # recently used: kept by the pruning below
            return store
        except FedLookaheadError as exc:  # a cache: rebuilt, never trusted half-written
            log.warning("%s: rebuilding it", exc)
    if progress:
        log.warning("indexing %d files for datastore drafts (once; cached in %s)", len(files), cache_dir)
    store = Datastore.from_files(files, tokenizer)
    store.save(cached)
    older = sorted(cache_dir.glob("datastore-*.npz"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for stale in older[KEPT_INDEXES:]:
        stale.unlink(missing_ok=True)
    return store
