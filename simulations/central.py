"""Centrally trained heads on the same data a scenario's clients hold: the reference for federated tau.

`python -m simulations.central iid-10` pools the training chunks of all the scenario's clients (same
partitioning, caps and local held-out split), trains fresh heads on them without DP for as many
passes as a client makes over its own data in the federated run (rounds x local epochs), and
evaluates them exactly as the ServerApp evaluates the global heads (same held-out stdlib chunks and
prompts, same decoder). Fresh (untrained) heads are evaluated too. Writes runs/central-<scenario>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from client.node_config import NUM_PARTITIONS_KEY, PARTITION_ID_KEY

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--epochs", type=int, help="default: rounds x local epochs of the scenario")
    parser.add_argument("--out")
    parser.add_argument("--reuse", metavar="HEADS_DIR", help="evaluate these saved central heads instead of training")
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="also evaluate the last checkpoint of these federated runs the same way",
    )
    args = parser.parse_args(argv)

    from client.base_cache import cached_base
    from client.local_data import client_data
    from common.data.features import base_features
    from common.federation.config import FedConfig
    from common.heads.lookahead import DraftHeads
    from common.training.loop import train_heads
    from server.evaluation import ServerEval
    from simulations.run import load_scenario, parse_sets

    scenario = load_scenario(args.scenario)
    overrides = dict(scenario.get("run-config", {}), **parse_sets(args.set))
    config = FedConfig.from_mapping(overrides)
    nodes = int(scenario.get("federation", {}).get("num-supernodes", 2))
    base = cached_base(config)
    chunks = torch.cat(
        [client_data(config, base, {PARTITION_ID_KEY: p, NUM_PARTITIONS_KEY: nodes}).train for p in range(nodes)]
    )
    epochs = args.epochs or config.num_server_rounds * config.local_epochs
    evaluation = ServerEval.build(base, config)
    torch.manual_seed(config.seed)
    fresh = DraftHeads.fresh(base, config.num_heads)
    report = {
        "scenario": args.scenario,
        "train_chunks": int(len(chunks)),
        "chunk_len": config.chunk_len,
        "epochs": epochs,
        "lr": config.lr,
        "batch_size": config.batch_size,
        "fresh": evaluation.run(fresh, base, config, heads_only=True),
    }
    if args.reuse:
        heads = DraftHeads.load(args.reuse, base)
        report["reused"] = args.reuse
    else:
        heads = DraftHeads.fresh(base, config.num_heads)
        started = time.perf_counter()
        history = train_heads(
            heads,
            base_features(base, chunks, progress=True),
            epochs=epochs,
            lr=config.lr,
            batch_size=config.batch_size,
            seed=config.seed,
        )
        report["train_seconds"] = time.perf_counter() - started
        report["train"] = history[-1]
    report["central"] = evaluation.run(heads, base, config, heads_only=True)
    from server.run.folder import RunFolder

    report["federated"] = {}
    for run_dir in args.compare:
        found = RunFolder(Path(run_dir)).latest_checkpoint()
        if found is None:
            continue
        federated = evaluation.run(DraftHeads.load(found[1], base), base, config, heads_only=True)
        ratios = {
            key: federated[key] / report["central"][key]
            for key in ("tau", "tau_heads_only")
            if federated.get(key) and report["central"].get(key)
        }
        report["federated"][str(run_dir)] = {"round": found[0], **federated, "ratio_to_central": ratios}
    out = Path(args.out or REPO / "runs" / f"central-{args.scenario}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.reuse:
        heads.save(out.with_suffix(""))
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
