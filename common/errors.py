"""The user-facing error: every module raises it, so it depends on nothing of ours."""

from __future__ import annotations


class FedLookaheadError(ValueError):
    """A user-facing error: its message is one line naming the problem."""
