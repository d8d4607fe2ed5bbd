"""The user-facing error: every module raises it, so it depends on nothing of ours."""

from __future__ import annotations


class FedLookaheadError(ValueError):
    """A user-facing error: its message is one line naming the problem."""


def first_line(error: object) -> str:
    """The first line of another library's error message (what follows is a traceback, a statement, a hint)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else "unknown error"
