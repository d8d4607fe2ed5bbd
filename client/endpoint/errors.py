"""The endpoint's two 503 errors and its one-line message helper."""

from __future__ import annotations

from common.errors import FedLookaheadError


class BaseUnavailable(FedLookaheadError):
    """The base model cannot be loaded: every request is answered 503 until it can."""


class QueueFull(FedLookaheadError):
    """More than max_queue requests are waiting or running: this one is answered 503."""


def one_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else "unknown error"
