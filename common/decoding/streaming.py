"""Text as the decoder accepts it: the growing token list turned into deltas, for the endpoint's event stream
and `fedla generate`'s terminal.

A delta is sent only when it extends what was sent: text is held back while it ends in an incomplete
UTF-8 character (U+FFFD) or could be the start of a stop string, so the deltas always concatenate to
the final text.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from common.decoding.core import Stopper


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """The text before the earliest stop string, and whether one was found."""
    found = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


class TextStream:
    """Turns the growing token list into text deltas that are always prefixes of the final text."""

    def __init__(self, tokenizer, stop: Sequence[str], emit: Callable[[str], None]) -> None:
        self.tokenizer, self.stop, self.emit = tokenizer, stop, emit
        self.margin = max((len(s) for s in stop), default=1) - 1  # a stop string may be forming there
        self.sent = ""

    def update(self, tokens: list[int]) -> None:
        text, stopped = cut_at_stop(self.tokenizer.decode(tokens, skip_special_tokens=True), self.stop)
        if not stopped:
            text = text[: len(text) - self.margin].rstrip("\ufffd")  # U+FFFD: a character's bytes still coming
        self._send(text)

    def finish(self, final: str) -> None:
        self._send(final)

    def _send(self, text: str) -> None:
        if len(text) > len(self.sent) and text.startswith(self.sent):
            self.emit(text[len(self.sent) :])
            self.sent = text


class StreamingStopper(Stopper):
    """The decoders' Stopper that also reports every accepted step and ends the decode when cancelled."""

    def __init__(self, *args: Any, on_tokens: Callable[[list[int]], None] | None, cancelled: threading.Event) -> None:
        super().__init__(*args)
        self.on_tokens, self.cancelled = on_tokens, cancelled

    def admit(self, tokens: list[int], new: Sequence[int]) -> str | None:
        reason = super().admit(tokens, new)
        if self.on_tokens is not None:
            self.on_tokens(tokens)
        if reason is None and self.cancelled.is_set():
            return "cancelled"
        return reason
