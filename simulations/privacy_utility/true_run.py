"""The population grid's check against a true run (simulations/privacy_utility/population_grid.py): one point
run through the product's ServerApp and ClientApp, set against that point's emulation over several seeds."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from common.federation.config import FedConfig
from common.heads.lookahead import DraftHeads
from server.run.folder import RunFolder
from simulations.privacy_utility.population_grid import Grid, Users, grid_point
from simulations.privacy_utility.tau import chain_acceptance


def true_run(grid: Grid, config_map: dict[str, Any], epsilon: float, out_dir: Path) -> dict[str, Any]:
    """`true_run_rounds` rounds of `true_run_cohort` clients through the product's ServerApp and ClientApp over
    the in-process grid: SecAgg+, every client's noise share, the public preconditioner; the final heads."""
    import json
    import logging

    from flwr.app import Context, RecordDict

    from client.client_app import app
    from server.federation import run_federation
    from simulations.inprocess import InProcessGrid

    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower logs every client's clip at INFO
    cohort = grid.true_run_cohort
    config = {
        **config_map,
        "dp": True,
        "dp-level": "user",
        "user-dp-noise": "device",
        "dp-target-epsilon": epsilon,
        "dp-delta": 1.0 / grid.population,
        "secagg": True,
        "num-server-rounds": grid.true_run_rounds,
        "fraction-evaluate": 0.0,
        "server-eval-chunks": 0,  # measured here on the users' held-out chunks, not the server's stdlib split
        "eval-max-new-tokens": 0,
        "node-wait-seconds": 0.0,
        "run-dir": str(out_dir),
        "run-id": f"true-run-{cohort}",
    }
    started = time.perf_counter()
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    folder = run_federation(InProcessGrid(app, grid.population, config), context, FedConfig.from_mapping(config))
    plan = json.loads(RunFolder(folder).run_file.read_text())["plan"]
    return {"folder": folder, "seconds": time.perf_counter() - started, "plan_user_dp": plan.get("user_dp")}


def checked_true_run(
    grid: Grid,
    config_map: dict[str, Any],
    config: FedConfig,
    base,
    users: Users,  # noqa: ANN001
    federated: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """The true run at `true_run_cohort` (eps = the grid's largest, the real population), and the same point
    emulated with `seeds` seeds: the true run should lie within their spread."""
    epsilon = max(grid.epsilons)
    cohort, rounds = grid.true_run_cohort, grid.true_run_rounds
    z, delta, std = grid_point(epsilon, cohort, grid.population, rounds, config)
    emulated = [
        federated(std, seed, f"emulated true-run point, seed {seed}", rounds)["tau_heads_only"]
        for seed in range(grid.seeds)
    ]
    with tempfile.TemporaryDirectory(prefix="fedla-true-run-") as out_dir:
        run = true_run(grid, config_map, epsilon, Path(out_dir))
        _, checkpoint = RunFolder(run["folder"]).latest_checkpoint()
        measured = chain_acceptance(DraftHeads.load(checkpoint, base), users.heldout)
    planned = run["plan_user_dp"] or {}
    return {
        "cohort": cohort,
        "rounds": rounds,
        "epsilon": epsilon,
        "noise_multiplier": planned.get("noise_multiplier"),
        "emulated_noise_multiplier": z,
        "tau_heads_only": measured["tau_heads_only"],
        "acc": measured["acc"],
        "emulated_tau_heads_only": sum(emulated) / len(emulated),
        "emulated_seeds": emulated,
        "within_spread": min(emulated) <= measured["tau_heads_only"] <= max(emulated),
        "seconds": run["seconds"],
    }
