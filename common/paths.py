"""Where FedLookahead keeps what it builds and measures on a machine: one home for the cache paths."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where built models, caches and measurements live: $FEDLA_HOME, else ~/.cache/fedlookahead."""
    return Path(os.environ.get("FEDLA_HOME", Path.home() / ".cache" / "fedlookahead")).expanduser()


def calibration_dir() -> Path:
    """What is measured once per machine: cost curves, int8 calibrations, the int8 kernel choice."""
    return cache_root() / "calibration"


def datastore_cache_dir() -> Path:
    """Where `fedla generate` and `bench-decode` cache the indexes of --datastore folders."""
    return cache_root() / "datastores"


# A heads folder keeps its newest heads under heads/latest: the daemon publishes there, `fedla generate` reads there.
LATEST_HEADS = Path("heads") / "latest"


def default_heads_dir() -> Path:
    """Where `fedla generate` looks for heads by default: $FEDLA_HEADS, else <cache>/heads/latest."""
    return Path(os.environ.get("FEDLA_HEADS", cache_root() / LATEST_HEADS)).expanduser()


def default_state_dir() -> Path:
    """The device daemon's state folder when none is given: <cache>/client."""
    return cache_root() / "client"
