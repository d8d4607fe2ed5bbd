"""This node's data: its own folder (a device) or its simulation partition, split into the chunks it
trains on and the ones it keeps for evaluation, and their cached base features."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from client.corpus import chunk_cache_dir, load_corpus
from client.node_config import STATE_DIR_KEY, NodeConfig
from client.partitions import partition_indices
from client.state import StateDir
from common.data.features import Features, base_features
from common.federation.config import FedConfig
from common.model.base import BaseModel
from common.paths import cache_root


@dataclass
class ClientData:
    train: torch.Tensor  # chunks this client trains on (one chunk = one DP privacy unit)
    heldout: torch.Tensor  # chunks it keeps for local evaluation, never trained on


def split_local(chunks: torch.Tensor, config: FedConfig, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cap at max-chunks-per-client (seeded sample), then keep local-heldout-fraction for evaluation."""
    order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(config.seed * 100_003 + salt))
    if config.max_chunks_per_client:
        order = order[: config.max_chunks_per_client]
    chunks = chunks[order]
    heldout = int(round(len(chunks) * config.local_heldout_fraction))
    if config.local_heldout_fraction > 0 and len(chunks) >= 2:
        heldout = max(1, heldout)
    return chunks[heldout:], chunks[:heldout]


def feature_cache_dir(node_config: dict) -> Path:
    """Where this client's base features live: under its state folder when it has one (device data
    stays with the device), else the FedLookahead cache, shared by every run of simulated clients (a
    population's features are computed once, not once per run)."""
    if node_config.get(STATE_DIR_KEY):
        return StateDir(Path(str(node_config[STATE_DIR_KEY])).expanduser()).features
    return cache_root() / "features"


def client_features(
    config: FedConfig, base: BaseModel, chunks: torch.Tensor, node_config: dict, progress: bool = False
) -> Features:
    """Base features of this client's chunks, computed once and reused across rounds (common/data/features.py)."""
    return base_features(base, chunks, feature_cache_dir(node_config), progress=progress)


def client_data(config: FedConfig, base: BaseModel, node_config: dict, progress: bool = False) -> ClientData:
    """This node's data: its own folder (`data-dir` node config, a real device) or its simulation partition."""
    node = NodeConfig.from_mapping(node_config)
    data_dir = str(node.data_dir or "")
    partition_id = 0
    if data_dir:
        chunks = load_corpus(data_dir, base, config.chunk_len, chunk_cache_dir(node_config), progress=progress).chunks
    else:
        partition_id = int(node.partition_id)
        num_partitions = int(node.num_partitions)
        corpus = load_corpus(config.data_source, base, config.chunk_len, progress=progress)
        chunks = corpus.chunks[torch.from_numpy(partition_indices(corpus, config, num_partitions, partition_id))]
    train, heldout = split_local(chunks, config, salt=partition_id)
    return ClientData(train, heldout)
