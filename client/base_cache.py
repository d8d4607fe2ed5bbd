"""The frozen base a client trains and evaluates with, loaded once per process (a simulation reuses its
Ray actors across rounds and clients, so the base model is loaded once per actor)."""

from __future__ import annotations

import threading
from pathlib import Path

from common.federation.config import FedConfig
from common.model.base import BaseModel, load_base
from common.model.default import ensure_default_base

_LOCK = threading.Lock()
_BASES: dict[tuple[str, str, bool], BaseModel] = {}


def base_dir(config: FedConfig) -> Path:
    return Path(config.base_model_dir).expanduser() if config.base_model_dir else ensure_default_base()


def cached_base(config: FedConfig, body: bool = True) -> BaseModel:
    """The frozen base, loaded once per process; `body=False`: without its decoder layers, which is all that
    training heads on cached features needs (common/data/features.py loads the layers on a cache miss)."""
    path = base_dir(config).resolve()
    key = (str(path), config.device, body)
    with _LOCK:
        if key not in _BASES:
            _BASES[key] = load_base(path, device=config.device, body=body)
        return _BASES[key]
