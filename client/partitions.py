"""A simulated client's share of the corpus: flwr-datasets partitioners over its chunks.

Partitions use flwr-datasets partitioners over a Hugging Face `datasets.Dataset` with one row per
chunk (its index and its group, the top-level package/module it comes from):

* ``iid``        IidPartitioner over the shuffled chunks;
* ``dirichlet``  DirichletPartitioner over the group label (alpha = dirichlet-alpha);
* ``package``    PackagePartitioner (below): whole top-level packages per client, balanced by size;
* ``user``       UserPartitioner (below): one user per client, `user-chunks` consecutive chunks of one
                 package (a few of its files), users in a seeded order: a population of small non-IID users.
"""

from __future__ import annotations

import threading

import datasets
import numpy as np
from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, Partitioner

from client.corpus import Corpus
from common.errors import FedLookaheadError
from common.federation.config import FedConfig

_LOCK = threading.Lock()
_PARTITIONS: dict[tuple, list[np.ndarray]] = {}


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


class UserPartitioner(Partitioner):
    """One user per partition: each group's rows (a package's chunks, in file order) cut into consecutive
    users of `user_chunks` rows (a shorter tail is dropped), every user in a seeded order. Partition p is the
    p-th user, so a simulation of N clients is N users drawn from every package, and the users one package
    holds stay with that package (non-IID by construction)."""

    def __init__(self, num_partitions: int, user_chunks: int, seed: int, partition_by: str = "group") -> None:
        super().__init__()
        self._num_partitions = num_partitions
        self._user_chunks = user_chunks
        self._seed = seed
        self._partition_by = partition_by
        self._users: list[list[int]] | None = None

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    def users(self) -> list[list[int]]:
        if self._users is None:
            by_group: dict[str, list[int]] = {}
            for row, label in enumerate(self.dataset[self._partition_by]):
                by_group.setdefault(label, []).append(row)
            size = self._user_chunks
            users = [
                rows[start : start + size]
                for _, rows in sorted(by_group.items())
                for start in range(0, len(rows) - size + 1, size)
            ]
            order = np.random.default_rng(self._seed).permutation(len(users))
            self._users = [users[i] for i in order]
            if len(self._users) < self._num_partitions:
                raise FedLookaheadError(
                    f"the data holds {len(self._users)} users of {size} chunks, fewer than the {self._num_partitions} "
                    "clients asked for (lower num-supernodes or user-chunks)"
                )
        return self._users

    def load_partition(self, partition_id: int) -> datasets.Dataset:
        return self.dataset.select(self.users()[partition_id])


def make_partitioner(config: FedConfig, num_partitions: int) -> Partitioner:
    if config.partitioning == "user":
        return UserPartitioner(num_partitions, config.user_chunks, config.seed)
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
    key = (
        id(corpus),
        len(corpus.groups),
        config.partitioning,
        config.dirichlet_alpha,
        config.user_chunks,
        config.seed,
        num_partitions,
    )
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
