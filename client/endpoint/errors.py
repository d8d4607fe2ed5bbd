"""The endpoint's two 503 errors."""

from __future__ import annotations

from common.errors import FedLookaheadError


class BaseUnavailable(FedLookaheadError):
    """The base model cannot be loaded: every request is answered 503 until it can."""


class QueueFull(FedLookaheadError):
    """More than max_queue requests are waiting or running: this one is answered 503."""
