"""The population grid's run (simulations/privacy_utility/population_grid.py has its parts): public heads, the
non-private federation, every (eps, cohort, population) point judged against the plan's forecast, the true
run, and example-level DP-SGD as a row."""

from __future__ import annotations

import math
import resource
import time
from typing import Any

from common.federation import user_dp
from common.federation.config import FedConfig
from common.heads.lookahead import DraftHeads
from common.training.preconditioner import Preconditioner
from simulations.privacy_utility.population_grid import (
    Grid,
    example_level_step,
    federate,
    grid_point,
    load_users,
    run_config,
)
from simulations.privacy_utility.tau import chain_acceptance
from simulations.privacy_utility.true_run import checked_true_run


def judged(
    entry: dict[str, Any],
    cohort: int,
    z: float,
    population: int,
    num_parameters: int,
    alignment: float,
    public: float,
    nodp: float,
) -> dict[str, Any]:
    """`entry` with the share of the non-private gain it kept, the plan's forecast for its settings (what
    `fedla server` says before such a run) and whether the forecast's outcome is the measured one."""
    snr = user_dp.signal_to_noise(cohort, z, num_parameters, alignment)
    gain = nodp - public
    kept = (entry["tau_heads_only"] - public) / gain if gain > 0 else math.nan
    expected, got = user_dp.expected_outcome(snr), user_dp.outcome_of(kept)
    return {
        **entry,
        "kept_share_of_gain": kept,
        "signal_to_noise": snr,
        "verdict": user_dp.verdict(snr, cohort, population),
        "forecast": expected,
        "outcome": got,
        "verdict_agrees": expected == got,
    }


def run_grid(grid: Grid, save) -> dict[str, Any]:  # noqa: ANN001 - save(result) writes the JSON so far
    """The whole benchmark (module docstring); `save` is called after every measured point."""
    from client.base_cache import cached_base
    from client.training.local_round import train_plainly
    from common.training.preconditioner import stdlib_preconditioner
    from common.training.public_heads import ensure_public_heads

    config_map = run_config(grid)
    config = FedConfig.from_mapping(config_map)
    base = cached_base(config, body=False)
    public = DraftHeads.load(
        ensure_public_heads(base, config.num_heads, config.chunk_len, config.public_heads_minutes), base
    )
    timings: dict[str, float] = {}
    started = time.perf_counter()
    users = load_users(grid, config)
    timings["users"] = time.perf_counter() - started
    t = time.perf_counter()
    preconditioner = Preconditioner.from_bytes(
        stdlib_preconditioner(public, base, config.chunk_len, config.seed).to_bytes(), public
    )  # through bytes, as a client receives it
    timings["preconditioner"] = time.perf_counter() - t
    scale = preconditioner.update_scale()
    num_parameters = sum(p.numel() for p in public.parameters())
    alignment = config.user_dp_alignment
    result: dict[str, Any] = {
        "population_real": grid.population,
        "rounds": grid.rounds,
        "signal_clients": grid.signal_clients,
        "recipe": {
            "client": f"public-sgd lr {grid.lr:g}, {grid.local_epochs} steps over the user's train chunks",
            "clip": grid.clip,
            "server": f"fedavgm momentum {grid.server_momentum:g}, lr {config.server_lr:g}",
            "alignment_assumed": alignment,
            "head_parameters": num_parameters,
        },
        "eval": {"users": grid.eval_users, "chunks": len(users.heldout)},
        "timings": timings,
    }

    def public_sgd(heads: DraftHeads, user: int) -> bool:
        train_plainly(heads, users.train[user], config, preconditioner)
        return True

    def federated(noise_std: float, seed: int, desc: str, rounds: int = grid.rounds) -> dict[str, Any]:
        t = time.perf_counter()
        heads, rejected = federate(
            public, users, config, public_sgd, scale, rounds, grid.signal_clients, noise_std, seed, desc
        )
        return {
            **chain_acceptance(heads, users.heldout),
            "rejected_steps": rejected,
            "seconds": time.perf_counter() - t,
        }

    result["public_only"] = chain_acceptance(public, users.heldout)
    result["federated_nodp"] = federated(0.0, 0, "non-private")
    save(result)
    low, high = result["public_only"]["tau_heads_only"], result["federated_nodp"]["tau_heads_only"]
    result["user_dp"] = {}
    for epsilon in grid.epsilons:
        for cohort in grid.cohorts:
            for population in (grid.population, grid.emulated_population):
                if cohort > population:
                    continue
                z, delta, std = grid_point(epsilon, cohort, population, grid.rounds, config)
                entry = federated(std, 0, f"eps {epsilon:g}, cohort {cohort}, population {population}")
                entry.update(
                    {
                        "noise_multiplier": z,
                        "delta": delta,
                        "noise_std_on_mean": std,
                        "emulated": cohort > grid.signal_clients or population != grid.population,
                    }
                )
                point = result["user_dp"].setdefault(f"{epsilon:g}", {}).setdefault(str(cohort), {})
                point[str(population)] = judged(entry, cohort, z, population, num_parameters, alignment, low, high)
                save(result)
    if grid.true_run_rounds:
        result["true_run"] = checked_true_run(grid, config_map, config, base, users, federated)
        save(result)
    t = time.perf_counter()
    example, rejected = federate(
        public,
        users,
        config,
        example_level_step(grid, config_map, users),
        None,
        grid.rounds,
        grid.signal_clients,
        0.0,
        0,
        f"example-level DP-SGD eps {grid.example_epsilon:g}",
    )
    result["example_dp"] = {
        f"{grid.example_epsilon:g}": {
            **chain_acceptance(example, users.heldout),
            "rejected_steps": rejected,
            "seconds": time.perf_counter() - t,
        }
    }
    result["verdict_agrees_everywhere"] = all(
        entry["verdict_agrees"]
        for by_cohort in result["user_dp"].values()
        for by_pop in by_cohort.values()
        for entry in by_pop.values()
    )
    timings["total"] = time.perf_counter() - started
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    save(result)
    return result
