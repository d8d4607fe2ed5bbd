"""A client's data and models: the frozen base, its corpus of chunks, its partition.

Everything expensive is cached per process: a simulation reuses its Ray actors across rounds and
clients, so the base model is loaded once per actor and the corpus is tokenised once per machine
(chunk tensors are also cached on disk, keyed by files, tokenizer and chunk length: under a device's
state folder, `<state-dir>/chunks`, since they are its private text; under the FedLookahead cache
for simulated clients).

Partitions use flwr-datasets partitioners over a Hugging Face `datasets.Dataset` with one row per
chunk (its index and its group, the top-level package/module it comes from):

* ``iid``        IidPartitioner over the shuffled chunks;
* ``dirichlet``  DirichletPartitioner over the group label (alpha = dirichlet-alpha);
* ``package``    PackagePartitioner (below): whole top-level packages per client, balanced by size.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import datasets
import numpy as np
import torch
from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, Partitioner

from common.data.chunks import read_text, stdlib_dir, stdlib_files, text_files
from common.data.features import Features, base_features
from common.errors import FedLookaheadError
from common.federation.config import FedConfig
from common.model.base import BaseModel, load_base
from common.model.default import ensure_default_base
from common.paths import cache_root

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_BASES: dict[tuple[str, str], BaseModel] = {}
_CORPORA: dict[tuple, "Corpus"] = {}
_PARTITIONS: dict[tuple, list[np.ndarray]] = {}


@dataclass
class Corpus:
    chunks: torch.Tensor  # (N, chunk_len) token ids
    groups: list[str]  # top-level package/module (or first folder) of each chunk


@dataclass
class ClientData:
    train: torch.Tensor  # chunks this client trains on (one chunk = one DP privacy unit)
    heldout: torch.Tensor  # chunks it keeps for local evaluation, never trained on


def base_dir(config: FedConfig) -> Path:
    return Path(config.base_model_dir).expanduser() if config.base_model_dir else ensure_default_base()


def cached_base(config: FedConfig) -> BaseModel:
    """The frozen base, loaded once per process."""
    path = base_dir(config).resolve()
    key = (str(path), config.device)
    with _LOCK:
        if key not in _BASES:
            _BASES[key] = load_base(path, device=config.device)
        return _BASES[key]


# ----------------------------------------------------------------------------------------- corpus


@functools.lru_cache(maxsize=16)
def _group_files(source: str) -> list[tuple[Path, str]]:
    """(file, group) pairs: stdlib train split grouped by top-level name, or a folder by first component.

    Listed once per process (the stdlib walk alone takes over a second).
    """
    if source == "stdlib":
        root = stdlib_dir()
        return [(p, p.relative_to(root).parts[0].removesuffix(".py")) for p in stdlib_files("train")]
    root = Path(source).expanduser().resolve()
    return [
        (p, p.relative_to(root).parts[0] if len(p.relative_to(root).parts) > 1 else p.stem) for p in text_files(root)
    ]


def chunk_corpus(files: list[tuple[Path, str]], tokenizer, chunk_len: int, progress: bool = False) -> Corpus:
    """Tokenise every readable file and cut it into non-overlapping chunks (never across files)."""
    from tqdm import tqdm

    chunks: list[torch.Tensor] = []
    chunk_groups: list[str] = []
    with tqdm(total=len(files), desc="tokenising", unit="file", disable=not progress, leave=False) as bar:
        for start in range(0, len(files), 256):  # batches keep memory flat
            texts, groups = [], []
            for path, group in files[start : start + 256]:
                text = read_text(path)
                if text and text.strip():
                    texts.append(text)
                    groups.append(group)
            encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
            for ids, group in zip(encoded, groups):
                usable = len(ids) - len(ids) % chunk_len
                if usable:
                    block = torch.tensor(ids[:usable], dtype=torch.long).view(-1, chunk_len)
                    chunks.extend(block)
                    chunk_groups.extend([group] * len(block))
            bar.update(len(files[start : start + 256]))
    if not chunks:
        raise FedLookaheadError(f"no file is at least {chunk_len} tokens long")
    return Corpus(torch.stack(chunks), chunk_groups)


def chunk_cache_dir(node_config: Mapping[str, Any]) -> Path:
    """Where chunk tensors are cached: a device's state folder (its private text stays there), else the cache."""
    if node_config.get("state-dir"):
        return Path(str(node_config["state-dir"])).expanduser() / "chunks"
    return cache_root() / "chunks"


def load_corpus(
    source: str, base: BaseModel, chunk_len: int, cache_dir: Path | None = None, progress: bool = False
) -> Corpus:
    """The chunks of `source` for `base`'s tokenizer: memory cache, then disk cache (`cache_dir`,
    default <cache>/chunks), then tokenise."""
    key = (source, base.fingerprint, chunk_len)
    with _LOCK:
        if key in _CORPORA:
            return _CORPORA[key]
        files = _group_files(source)
        listing = json.dumps([[str(p), p.stat().st_size, g] for p, g in files])
        key_hash = hashlib.sha256(f"{base.fingerprint}|{chunk_len}|{listing}".encode()).hexdigest()[:16]
        cache_file = (cache_dir or cache_root() / "chunks") / f"{key_hash}.pt"
        corpus = None
        if cache_file.is_file():
            try:
                saved = torch.load(cache_file, weights_only=True)
                corpus = Corpus(saved["chunks"], list(saved["groups"]))
            except Exception as exc:  # a corrupt cache is rebuilt, never trusted
                log.warning("ignoring unreadable chunk cache %s: %s", cache_file, exc)
        if corpus is None:
            corpus = chunk_corpus(files, base.tokenizer, chunk_len, progress=progress)
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            torch.save({"chunks": corpus.chunks, "groups": corpus.groups}, tmp)
            os.replace(tmp, cache_file)  # atomic: concurrent actors never read half a file
        _CORPORA[key] = corpus
        return corpus


# ------------------------------------------------------------------------------------- partitions


class PackagePartitioner(Partitioner):
    """Non-IID by construction: each client gets whole groups (top-level packages), balanced greedily.

    Groups are assigned largest first to the partition with the fewest rows so far, so sizes stay
    close while no package is ever split between clients.
    """

    def __init__(self, num_partitions: int, partition_by: str = "group") -> None:
        super().__init__()
        self._num_partitions = num_partitions
        self._partition_by = partition_by
        self._assignment: list[list[int]] | None = None

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    def _assign(self) -> list[list[int]]:
        if self._assignment is None:
            labels = self.dataset[self._partition_by]
            by_group: dict[str, list[int]] = {}
            for row, label in enumerate(labels):
                by_group.setdefault(label, []).append(row)
            if len(by_group) < self._num_partitions:
                raise FedLookaheadError(
                    f"package partitioning needs at least one package per client: {len(by_group)} packages "
                    f"for {self._num_partitions} clients (use dirichlet or iid)"
                )
            parts: list[list[int]] = [[] for _ in range(self._num_partitions)]
            for _, rows in sorted(by_group.items(), key=lambda kv: (-len(kv[1]), kv[0])):
                min(parts, key=len).extend(rows)
            self._assignment = parts
        return self._assignment

    def load_partition(self, partition_id: int) -> datasets.Dataset:
        return self.dataset.select(self._assign()[partition_id])


def make_partitioner(config: FedConfig, num_partitions: int) -> Partitioner:
    if config.partitioning == "iid":
        return IidPartitioner(num_partitions)
    if config.partitioning == "dirichlet":
        return DirichletPartitioner(
            num_partitions,
            partition_by="group",
            alpha=config.dirichlet_alpha,
            min_partition_size=0,
            self_balancing=True,
            seed=config.seed,
        )
    return PackagePartitioner(num_partitions)


def partition_indices(corpus: Corpus, config: FedConfig, num_partitions: int, partition_id: int) -> np.ndarray:
    """Row indices of the chunks in partition `partition_id` (all partitions computed once per process)."""
    key = (id(corpus), len(corpus.groups), config.partitioning, config.dirichlet_alpha, config.seed, num_partitions)
    with _LOCK:
        if key not in _PARTITIONS:
            table = datasets.Dataset.from_dict({"idx": list(range(len(corpus.groups))), "group": corpus.groups})
            if config.partitioning == "iid":  # IidPartitioner shards contiguously: shuffle first
                table = table.shuffle(seed=config.seed)
            partitioner = make_partitioner(config, num_partitions)
            partitioner.dataset = table
            try:
                _PARTITIONS[key] = [
                    np.asarray(partitioner.load_partition(p)["idx"], dtype=np.int64) for p in range(num_partitions)
                ]
            except ValueError as exc:
                raise FedLookaheadError(
                    f"cannot make {num_partitions} {config.partitioning} partitions: {exc}"
                ) from exc
        return _PARTITIONS[key][partition_id]


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


def feature_cache_dir(config: FedConfig, node_config: dict) -> Path:
    """Where this client's base features live: under its state folder when it has one (device data
    stays with the device), else the FedLookahead cache."""
    if node_config.get("state-dir"):
        return Path(str(node_config["state-dir"])).expanduser() / "features"
    if config.client_state_dir:
        return Path(config.client_state_dir).expanduser() / "features"
    return cache_root() / "features"


def client_features(
    config: FedConfig, base: BaseModel, chunks: torch.Tensor, node_config: dict, progress: bool = False
) -> Features:
    """Base features of this client's chunks, computed once and reused across rounds (common/data/features.py)."""
    return base_features(base, chunks, feature_cache_dir(config, node_config), progress=progress)


def client_data(config: FedConfig, base: BaseModel, node_config: dict, progress: bool = False) -> ClientData:
    """This node's data: its own folder (`data-dir` node config, a real device) or its simulation partition."""
    data_dir = str(node_config.get("data-dir", "") or "")
    partition_id = 0
    if data_dir:
        chunks = load_corpus(data_dir, base, config.chunk_len, chunk_cache_dir(node_config), progress=progress).chunks
    else:
        partition_id = int(node_config.get("partition-id", 0))
        num_partitions = int(node_config.get("num-partitions", 1))
        corpus = load_corpus(config.data_source, base, config.chunk_len, progress=progress)
        chunks = corpus.chunks[torch.from_numpy(partition_indices(corpus, config, num_partitions, partition_id))]
    train, heldout = split_local(chunks, config, salt=partition_id)
    return ClientData(train, heldout)
