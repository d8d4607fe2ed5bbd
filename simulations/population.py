"""A population of simulated users, made ready before a run: their base features, computed once and cached.

The users are `partitioning = "user"` partitions (client/partitions.py) of `data-source = "private-packages"`:
each holds `user-chunks` consecutive chunks of one private package, trains on all but its held-out chunk(s),
and keeps nothing in memory between rounds. A device computes its features at its first round; here every
user's are computed up front, through the ClientApp's own data path (client/local_data.py), so each round's
clients find them in the cache and train without the base's decoder layers. Memory stays flat whatever the
population: one user's chunks at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm import tqdm

from client.base_cache import cached_base
from client.local_data import client_data, feature_cache_dir
from client.node_config import NUM_PARTITIONS_KEY, PARTITION_ID_KEY
from common.data.features import features_of_sets
from common.federation.config import FedConfig

USERS_PER_BATCH = 32  # users whose missing features are computed in one pass (full batches, flat memory)


@dataclass
class Prepared:
    users: int
    train_chunks: int
    heldout_chunks: int
    seconds: float


def prepare_population(run_config: dict, num_users: int, progress: bool = True) -> Prepared:
    """Compute (or find cached) the features of users 0..num_users-1, where their ClientApps will read them."""
    config = FedConfig.from_mapping(run_config)
    base = cached_base(config, body=False)
    started = time.perf_counter()
    train = heldout = 0
    with tqdm(total=num_users, desc="population features", unit="user", disable=not progress) as bar:
        for first in range(0, num_users, USERS_PER_BATCH):
            sets = []
            for user in range(first, min(first + USERS_PER_BATCH, num_users)):
                data = client_data(config, base, {PARTITION_ID_KEY: user, NUM_PARTITIONS_KEY: num_users})
                sets += [chunks for chunks in (data.train, data.heldout) if len(chunks)]
                train, heldout = train + len(data.train), heldout + len(data.heldout)
            features_of_sets(base, sets, feature_cache_dir({}), progress=False)
            bar.update(min(USERS_PER_BATCH, num_users - first))
    return Prepared(num_users, train, heldout, time.perf_counter() - started)
