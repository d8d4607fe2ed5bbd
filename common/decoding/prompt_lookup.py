"""Prompt lookup, the drafting source that continues the context the way it went before."""

from __future__ import annotations

from typing import Sequence


class NgramIndex:
    """Prompt lookup: continue the context's last n tokens the way their most recent earlier occurrence did.

    Tables map every n-gram (n in `sizes`) to the position where it last ended; they are updated
    incrementally as the context grows, so a lookup costs a few dict accesses, not a scan. A match
    that runs into the end of the context continues periodically (a repetition loop predicts itself).
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = sorted(set(sizes), reverse=True)
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # n-grams ending at positions < indexed are in the tables

    def _extend(self, context: Sequence[int]) -> None:
        last = len(context) - 1  # the n-grams ending at the last position are the ones we look up
        if last < self.indexed:  # not the context this index was built on (contexts only grow)
            self.tables = {n: {} for n in self.sizes}
            self.indexed = 0
        for end in range(self.indexed, last):
            for n in self.sizes:
                if end + 1 >= n:
                    self.tables[n][tuple(context[end + 1 - n : end + 1])] = end
        self.indexed = max(self.indexed, last)

    def lookup(self, context: Sequence[int], length: int) -> list[int]:
        self._extend(context)
        total = len(context)
        for n in self.sizes:
            if total <= n:
                continue
            end = self.tables[n].get(tuple(context[total - n :]))
            if end is None:
                continue
            continuation: list[int] = []
            for i in range(length):
                j = end + 1 + i
                continuation.append(context[j] if j < total else continuation[j - total])
            return continuation
        return []
