"""One federated configuration through the product's own code path: the real ServerApp loop over an
in-process grid of real ClientApps, then the run's epsilons and its final heads."""

from __future__ import annotations

import json
import time
from pathlib import Path


def federate(run_config: dict, clients: int, name: str) -> tuple[Path, dict]:
    """One federated run through the product's server loop and ClientApp; (its run folder, its epsilons)."""
    from flwr.app import Context, RecordDict

    from client.client_app import app
    from common.federation.config import FedConfig
    from server.federation import run_federation
    from server.run.folder import RunFolder
    from simulations.inprocess import InProcessGrid

    config = dict(run_config, **{"run-id": f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"})
    grid = InProcessGrid(app, clients, config)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    run_dir = run_federation(grid, context, FedConfig.from_mapping(config))
    folder = RunFolder(run_dir)
    rounds = [
        json.loads(p.read_text())
        for p in sorted(folder.rounds_dir.glob("round-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    ]
    plan = json.loads(folder.run_file.read_text())["plan"]
    last = rounds[-1]
    privacy = {
        "epsilon_max": last["privacy"]["epsilon_max"],
        "epsilon_mean": last["privacy"]["epsilon_mean"],
        "noise_multiplier": last["privacy"]["noise_multiplier"],
        "q": last["privacy"]["q"],
        "aggregated_rounds": sum(int(r["aggregated"]) for r in rounds),
        "rounds": len(rounds),
        "skipped_budget": sum(len(r["participation"]["skipped_budget"]) for r in rounds),
    }
    if "user_dp" in plan:
        privacy["user_dp"] = plan["user_dp"]
    return run_dir, privacy


def final_heads(run_dir: Path, base):
    from common.heads.lookahead import DraftHeads
    from server.run.folder import RunFolder

    found = RunFolder(run_dir).latest_checkpoint()
    if found is None:
        raise RuntimeError(f"no checkpoint in {run_dir}")
    return DraftHeads.load(found[1], base)
