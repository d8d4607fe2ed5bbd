"""The privacy-utility benchmark at population scale (issue 28): user-level DP-FedAvg with noise shares
added on the devices, over eps x cohort x accounted population, on the population-1k users.

    python -m simulations.privacy_utility --json out.json            # the grid, on the real base
    python -m simulations.privacy_utility --quick --base TINY --json out.json

Users are the `population-1k` scenario's (simulations/scenarios/population-1k.toml: private package code,
2 chunks to train and 1 held out each), their features cached as a device caches them
(simulations/population.py). Every number is heads-only tau and per-head accuracy
(simulations/privacy_utility/tau.py) on the held-out chunks of the first `eval_users` users.

Each round `signal_clients` users are sampled from the real population; each takes the product's own client
step (client.training.local_round.train_plainly with the public preconditioner the server sends,
common/training/preconditioner.py), its update is clipped at update-max-norm by Flower's
`compute_clip_model_update` (what `fixedclipping_mod` applies), and the clipped mean is noised for the
*accounted* cohort M and population P: Gaussian noise of std z C / M, which is what M devices' shares of
N(0, (z C)^2 / M) (client/noise_share.py) add to the mean, with z from common.federation.user_dp
(Opacus RDP, q = M / P, delta 1/P, all rounds). The server's FedAvgM (server/server_optimizer.py) steps
the heads. A cohort larger than `signal_clients` is therefore *emulated*, as DP-FL papers emulate
populations they cannot simulate: its signal is the mean of fewer real clients (more sampling noise than a
true cohort: pessimistic), its noise the true cohort's. Every such point says "emulated": true. One point
is checked against a true run through the product's ServerApp and ClientApp (`true_run`: SecAgg+, the
devices' noise shares, every sampled client real), against the spread of that point's emulation over seeds.
"""

from __future__ import annotations

import copy
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from flwr.supercore.differential_privacy import compute_clip_model_update
from tqdm import tqdm

from common.data.features import Features
from common.federation import user_dp
from common.federation.config import FedConfig
from common.federation.records import heads_to_ndarrays, load_ndarrays
from common.heads.lookahead import DraftHeads
from common.training.preconditioner import unwhitened, whitened
from server.server_optimizer import ServerOptimizer

SCENARIO = Path(__file__).parents[1] / "scenarios" / "population-1k.toml"


@dataclass(frozen=True)
class Grid:
    population: int = 2000  # real users (their features are cached by simulations/population.py)
    rounds: int = 25  # non-private: +0.102 tau after 20 rounds, +0.138 after 30 (16 clients a round)
    signal_clients: int = 16  # real clients per round whose clipped mean is the signal
    local_epochs: int = 4  # client steps per round (each over the user's 2 train chunks)
    lr: float = 1e-4  # the public-sgd step (issue 28's probe: stable at 1e-4, diverges at 3e-4)
    clip: float = 0.5  # update-max-norm: about the median update norm of this recipe
    server_momentum: float = 0.9
    max_dropout: float = 0.1  # the shares are sized to survive 10% dropouts (a full cohort adds 5% more noise)
    eval_users: int = 300
    epsilons: tuple[float, ...] = (2.0, 4.0, 8.0)
    cohorts: tuple[int, ...] = (64, 256, 1024)
    emulated_population: int = 100_000
    seeds: int = 3  # the true run's point is emulated with this many seeds (its spread)
    true_run_rounds: int = 3
    true_run_cohort: int = 256
    example_epsilon: float = 8.0
    base: str = ""
    run_overrides: dict[str, Any] = field(default_factory=dict)


QUICK = Grid(
    population=24,
    rounds=2,
    signal_clients=4,
    local_epochs=1,
    lr=1e-3,
    eval_users=8,
    epsilons=(8.0,),
    cohorts=(4, 8),
    seeds=2,
    true_run_rounds=1,
    true_run_cohort=8,
    run_overrides={"chunk-len": 32, "num-heads": 2, "public-heads-minutes": 0.1},
)


def run_config(grid: Grid) -> dict[str, Any]:
    """The population-1k run config with the grid's client recipe (the true run uses it as is)."""
    config = dict(tomllib.loads(SCENARIO.read_text())["run-config"])
    config.update(
        {
            "local-epochs": grid.local_epochs,
            "lr": grid.lr,
            "client-optimizer": "public-sgd",
            "update-max-norm": grid.clip,
            "server-optimizer": "fedavgm",
            "server-momentum": grid.server_momentum,
            "secagg-max-dropout": grid.max_dropout,
            "min-available-clients": grid.population,
            "clients-per-round": grid.true_run_cohort,
            "min-train-clients": grid.true_run_cohort,
            **({"base-model-dir": grid.base} if grid.base else {}),
            **grid.run_overrides,
        }
    )
    return config


@dataclass
class Users:
    train: list[Features]
    heldout: Features  # the first eval_users users' held-out chunks


def load_users(grid: Grid, config: FedConfig) -> Users:
    """Every user's cached train features and the evaluation users' held-out ones (computed when missing)."""
    from client.base_cache import cached_base
    from client.local_data import client_data, client_features
    from client.node_config import NUM_PARTITIONS_KEY, PARTITION_ID_KEY

    base = cached_base(config, body=False)
    train, heldout = [], []
    for user in tqdm(range(grid.population), desc="users' features", unit="user"):
        node = {PARTITION_ID_KEY: user, NUM_PARTITIONS_KEY: grid.population}
        data = client_data(config, base, node)
        train.append(client_features(config, base, data.train, node))
        if user < grid.eval_users and len(data.heldout):
            heldout.append(client_features(config, base, data.heldout, node))
    return Users(train, sum(heldout[1:], heldout[0]))


def federate(
    start: DraftHeads,
    users: Users,
    config: FedConfig,
    client_step: Callable[[DraftHeads, int], bool],
    scale: list[np.ndarray] | None,
    rounds: int,
    signal_clients: int,
    noise_std: float,
    seed: int,
    desc: str,
) -> tuple[DraftHeads, int]:
    """`rounds` of the emulated DP-FedAvg of the module docstring, and how many of its steps the server rejected; `client_step(heads, user)` trains a sampled
    user's copy in place (False: it declined), its update clipped and noised in the coordinates `scale` gives (public-sgd's,
    common/training/preconditioner.py; None: the heads' own); `noise_std` 0: non-private."""
    heads, work = copy.deepcopy(start), copy.deepcopy(start)
    server = ServerOptimizer("fedavgm", config.server_lr, config.server_momentum)
    rng = np.random.default_rng(seed)
    rejected = 0
    for _ in tqdm(range(rounds), desc=desc, unit="round", leave=False):
        current = heads_to_ndarrays(heads)
        total, trained = [np.zeros_like(a) for a in current], 0
        for user in rng.choice(len(users.train), size=signal_clients, replace=False):
            load_ndarrays(work, current)
            if not client_step(work, int(user)):  # it declined (its budget): weight 0, as in the ServerApp
                continue
            trained += 1
            new = heads_to_ndarrays(work)
            if scale is not None:
                new = whitened(current, new, scale)
            compute_clip_model_update(new, current, config.update_max_norm)
            total = [t + n - c for t, n, c in zip(total, new, current)]
        if not trained:
            continue
        mean = [c + t / trained for c, t in zip(current, total)]
        if noise_std > 0:
            mean = [m + rng.normal(0.0, noise_std, size=m.shape).astype(np.float32) for m in mean]
        if scale is not None:
            mean = unwhitened(current, mean, scale)
        stepped = server.checked_step(current, mean, config.secagg_clipping_range)  # as the ServerApp does
        if stepped is None:
            rejected += 1
        else:
            load_ndarrays(heads, stepped)
    return heads, rejected


def grid_point(
    epsilon: float, cohort: int, population: int, rounds: int, config: FedConfig
) -> tuple[float, float, float]:
    """(z, delta, noise std on the mean) of one accounted point: q = cohort / population, delta 1/population,
    and the noise the devices' shares really add (each sized for the dropout-tolerant cohort, so a full
    cohort adds a little more than z C)."""
    delta = 1.0 / population
    z = user_dp.noise_multiplier(epsilon, delta, cohort / population, rounds)
    shares = user_dp.noise_cohort(cohort, config.secagg_max_dropout)
    return z, delta, user_dp.mean_noise_std(z, config.update_max_norm, cohort, shares)


def example_level_step(grid: Grid, config_map: dict[str, Any], users: Users) -> Callable[[DraftHeads, int], bool]:
    """A sampled user's round of example-level Opacus DP-SGD (today's device floor): AdamW, each chunk a
    privacy unit, its accountant kept across the rounds it joins, calibrated to the grid's example epsilon."""
    from client.training.dp import PrivacyState
    from client.training.local_round import train_round

    joins = max(1, math.ceil(grid.rounds * grid.signal_clients / grid.population))  # rounds a user expects to join
    config = FedConfig.from_mapping(
        {
            **config_map,
            "dp": True,
            "dp-level": "example",
            "client-optimizer": "adamw",
            "lr": 1e-3,
            "dp-target-epsilon": grid.example_epsilon,
            "dp-delta": 1.0 / grid.population,
            "dp-planned-rounds": joins,
        }
    )
    states: dict[int, PrivacyState] = {}

    def step(heads: DraftHeads, user: int) -> bool:
        state = states.setdefault(user, PrivacyState(f"example-dp-user-{user}"))
        return not train_round(heads, users.train[user], config, state).skipped

    return step
