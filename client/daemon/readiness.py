"""Readiness: everything slow a device can do before it joins, so that round 1 is only training.

1. The base: the embedded default (or `--base toy`) is built or converted once under $FEDLA_HOME;
   a model folder is used as is. Its resolved folder goes into the node config, so every ClientApp
   loads exactly this base and never builds one inside a round.
2. The device's private files are tokenised into chunks, cached in <state>/chunks (client.corpus),
   with a progress bar.
3. Base features of those chunks, cached in <state>/features (common.data.features), when that is cheap:
   a timed sample projects the whole cost, and above `FEATURE_SECONDS` round 1 computes them.

Chunks and features depend on run-config keys (chunk-len, max-chunks-per-client, seed,
local-heldout-fraction): readiness uses the defaults with the device's own --node-config. A run that
sets other values tokenises or extracts again in its first round (and caches that too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from client.daemon.options import DaemonError
from client.node_config import BASE_MODEL_DIR_KEY, STATE_DIR_KEY
from client.state import StateDir
from common.errors import FedLookaheadError

FEATURE_SECONDS = 120.0  # projected feature extraction up to this long is done before joining
SAMPLE_CHUNKS = 4


class NotPrepared(FedLookaheadError):
    """The device's files gave no chunks with the default settings (a run's own chunk length may)."""


@dataclass
class Readiness:
    base_dir: Path
    train_chunks: int = 0
    heldout_chunks: int = 0
    features: str = "skipped"  # "cached" | "computed in Ns" | why skipped
    seconds: float = 0.0


def prepare_base(base: str | Path | None, emit: Callable[[str], None]) -> Path:
    """The base's folder, building the embedded one first if this device has none yet."""
    from common.model.default import DEFAULT_BASE, NAMED_BASES, default_base_dir, resolve_base, toy_base_dir

    name = DEFAULT_BASE if base is None or str(base) == "" else str(base)
    if name in NAMED_BASES:
        folder = (default_base_dir if name == "smollm2" else toy_base_dir)()
        if not (folder / "config.json").is_file():
            emit(f"preparing the {name} base in {folder} (once; the SuperNode starts when it is ready)")
    try:
        return resolve_base(base).resolve()
    except FedLookaheadError as exc:
        raise DaemonError(f"base: {exc}") from None


def prepare(node_config: dict, emit: Callable[[str], None], features: bool = True) -> Readiness:
    """Chunks (and base features when cheap) of this device's files, cached in its state folder."""
    import torch

    from client.local_data import client_data, client_features
    from common.data.features import compute_features, extractor_for
    from common.federation.config import FedConfig
    from common.model.base import load_base

    started = time.perf_counter()
    base_dir = Path(node_config[BASE_MODEL_DIR_KEY])
    try:
        config = FedConfig.from_mapping({}, node_config)
        base = load_base(base_dir, device=config.device)
    except FedLookaheadError as exc:
        raise DaemonError(f"base {base_dir}: {exc}") from None
    try:
        data = client_data(config, base, node_config, progress=True)
    except FedLookaheadError as exc:
        raise NotPrepared(str(exc)) from None
    ready = Readiness(base_dir, len(data.train), len(data.heldout))
    state = StateDir(Path(node_config[STATE_DIR_KEY]))
    emit(
        f"tokenised: {len(data.train)} training and {len(data.heldout)} held-out chunks of {config.chunk_len} tokens "
        f"in {state.chunks}"
    )
    if features and len(data.train):
        extractor = extractor_for(base)
        sample = data.train[:SAMPLE_CHUNKS]
        tick = time.perf_counter()
        with torch.inference_mode():
            compute_features(extractor, sample, progress=False)
        projected = (time.perf_counter() - tick) / len(sample) * (len(data.train) + len(data.heldout))
        if projected <= FEATURE_SECONDS:
            tick = time.perf_counter()
            client_features(config, base, data.train, node_config, progress=True)
            if len(data.heldout):
                client_features(config, base, data.heldout, node_config, progress=True)
            ready.features = f"computed in {time.perf_counter() - tick:.0f}s"
            emit(f"base features: {ready.features}, in {state.features}")
        else:
            ready.features = f"skipped (about {projected / 60:.0f} min here: round 1 computes them)"
            emit(f"base features: {ready.features}")
        del extractor
    del base
    _release_models()
    ready.seconds = time.perf_counter() - started
    return ready


def _release_models() -> None:
    """The daemon lives on: it keeps no copy of the base (the ClientApps load their own)."""
    import gc

    from common.data import features

    features._EXTRACTORS.clear()  # extractor_for's per-process cache
    gc.collect()
