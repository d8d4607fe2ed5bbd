"""Population-scale federation on this machine: `python -m simulations.bench_population --json out.json`.

A population of `--population` users (simulations/population.py: the private installed packages, a few
chunks of one package per user) has its features cached first. Each setting (clients per round, SecAgg+,
dropout rate) is then one run of the product's ServerApp loop and ClientApp over the in-process grid
(simulations/inprocess.py; clients one after another in one process), in a process of its own, so that
its peak resident memory is its own. Every figure is measured, none emulated.

A run has `--rounds` rounds; the figures are its first round's (the last round also pushes the final
heads to every user, which is the run's end, not a round's cost). Where a round's time goes:
  client compute      the sampled clients' own training (what the goals compare against)
  client app, rest    the rest of the ClientApp: reading a user's chunks and features, Flower's mods,
                      SecAgg+'s client side (key agreement, masks)
  server              the train exchange minus the ClientApps: Flower's workflow, the guard, SecAgg+'s
                      unmasking, aggregation
  evaluation          the server's fixed held-out evaluation and the sampled clients' evaluation

Bytes are per client per round as they travel (the heads down in heads-codec, the update up). The
codec's cost: head-1 accuracy and heads-only tau on the users' held-out code of the SecAgg+ run's final
heads in float32 and as a client decodes them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCENARIO = REPO / "simulations" / "scenarios" / "population-1k.toml"
SETTINGS = ((64, False, 0.0), (256, False, 0.0), (1024, False, 0.0), (256, True, 0.1), (256, True, 0.3))
TAU_PROMPTS = 32  # held-out users whose chunk opens a heads-only decode
TAU_NEW_TOKENS = 64
ACCURACY_USERS = 256  # held-out users whose chunks measure head accuracy


def scenario_config(population: int, clients: int, secagg: bool, rounds: int, run_dir: Path) -> dict:
    config = dict(tomllib.loads(SCENARIO.read_text())["run-config"])
    config.update(
        {
            "num-server-rounds": rounds,
            "clients-per-round": clients,
            "min-train-clients": clients,
            "min-available-clients": population,
            "secagg": secagg,
            "fraction-evaluate": 32 / population,
            "node-wait-seconds": 0.0,
            "run-dir": str(run_dir),
            "run-id": f"population-{clients}-{'secagg' if secagg else 'plain'}",
        }
    )
    return config


def run_setting(population: int, clients: int, secagg: bool, dropout: float, rounds: int, run_dir: Path) -> dict:
    """One run in this process: its first round's figures (module docstring)."""
    from flwr.app import Context, RecordDict

    from client.client_app import app
    from common.federation.config import FedConfig
    from server.federation import run_federation
    from simulations.faults import FaultPlan, faulty_client_app
    from simulations.inprocess import InProcessGrid

    class TimedGrid(InProcessGrid):
        """The in-process grid, adding up the ClientApps' time per message group (a round's train exchange)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.app_seconds: dict[str, float] = {}

        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            before = sum(self.client_seconds.values())
            replies = super().send_and_receive(messages, timeout=timeout)
            group = messages[0].metadata.group_id if messages else ""
            self.app_seconds[group] = self.app_seconds.get(group, 0.0) + sum(self.client_seconds.values()) - before
            return replies

    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower logs every client's clip at INFO
    config = scenario_config(population, clients, secagg, rounds, run_dir)
    config["run-id"] += f"-{dropout:g}"
    client = faulty_client_app(FaultPlan(dropout_rate=dropout, seed=1)) if dropout else app
    grid = TimedGrid(client, population, config)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    started = time.perf_counter()
    folder = run_federation(grid, context, FedConfig.from_mapping(config))
    total = time.perf_counter() - started
    first = json.loads((folder / "rounds" / "round-1.json").read_text())
    plan = json.loads((folder / "run.json").read_text())["plan"]
    timing = first["seconds"]
    train_app = grid.app_seconds.get("1", 0.0)  # Flower's workflows send a round's train messages in group "<round>"
    compute = timing["client_train_sum"]
    return {
        "clients": clients,
        "secagg": secagg,
        "dropout": dropout,
        "seconds": first["wall_seconds"],
        "client_compute_seconds": compute,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "ratio": first["wall_seconds"] / compute if compute else None,
        "breakdown": {
            "client_compute": compute,
            "client_app_rest": train_app - compute,
            "server": timing["fit"] - train_app,
            "server_eval": timing["server_eval"],
            "client_eval": timing["client_eval"],
        },
        "participation": {k: first["participation"][k] for k in ("sampled", "succeeded", "dropped")},
        "aggregated": first["aggregated"],
        "bytes": first["bytes"],
        "secagg_plan": plan.get("secagg"),
        "run_seconds": total,
        "run_dir": str(folder),
    }


def codec_cost(run_config: dict, heads_dir: Path, population: int) -> dict:
    """Head-1 accuracy and heads-only tau on users' held-out chunks: the public heads the run started from, and
    its final heads as trained and as a client decodes them."""
    import torch

    from client.base_cache import cached_base
    from client.local_data import client_data, client_features
    from client.node_config import NUM_PARTITIONS_KEY, PARTITION_ID_KEY
    from common.decoding.tau import chunk_prompts, decode_tau
    from common.federation.config import FedConfig
    from common.federation.records import heads_to_ndarrays, load_ndarrays
    from common.federation.wire import as_received
    from common.heads.lookahead import DraftHeads
    from common.training.loop import evaluate_heads

    config = FedConfig.from_mapping(run_config)
    base = cached_base(config)
    heldout = [
        client_data(config, base, {PARTITION_ID_KEY: u, NUM_PARTITIONS_KEY: population}).heldout
        for u in range(min(ACCURACY_USERS, population))
    ]
    features = client_features(config, base, torch.cat(heldout), {})
    prompts = chunk_prompts(torch.cat(heldout[:TAU_PROMPTS]), TAU_PROMPTS, config.eval_prompt_len)
    from common.training.public_heads import ensure_public_heads

    public = ensure_public_heads(base, config.num_heads, config.chunk_len, config.public_heads_minutes)
    out = {}
    for name, folder, codec in (
        ("starting_heads", public, "float32"),
        ("full_precision", heads_dir, "float32"),
        ("cut", heads_dir, config.heads_codec),
    ):
        heads = DraftHeads.load(folder, base)
        load_ndarrays(heads, as_received(heads_to_ndarrays(heads), codec))
        summary = evaluate_heads(heads, features, batch_size=config.batch_size)
        tau = decode_tau(base, heads, prompts, TAU_NEW_TOKENS, ngram=False)
        out[name] = {"codec": codec, "head_accuracy": [float(a) for a in summary["head_accuracy"]], "tau": tau}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--population", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--settings", default=",".join(f"{m}:{int(s)}:{d:g}" for m, s, d in SETTINGS), help="clients:secagg:dropout,..."
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one setting, JSON on stdout
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.one:
        clients, secagg, dropout, run_dir = json.loads(args.one)
        result = run_setting(args.population, clients, bool(secagg), dropout, args.rounds, Path(run_dir))
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    from simulations.population import prepare_population

    run_dir = Path(tempfile.mkdtemp(prefix="bench-population-"))
    base_config = scenario_config(args.population, 2, False, args.rounds, run_dir)
    prepared = prepare_population(base_config, args.population)
    print(f"population: {prepared.users} users, features ready in {prepared.seconds:.0f}s", flush=True)
    rows = []
    for item in args.settings.split(","):
        clients, secagg, dropout = item.split(":")
        one = json.dumps([int(clients), int(secagg), float(dropout), str(run_dir)])
        command = [sys.executable, "-m", "simulations.bench_population", "--population", str(args.population)]
        command += ["--rounds", str(args.rounds), "--one", one]
        print(f"setting {item} ...", flush=True)
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            print(done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"error: setting {item} failed (exit {done.returncode})")
        rows.append(json.loads(lines[-1].removeprefix("RESULT ")))
        print_row(rows[-1])
    secure = next((r for r in rows if r["secagg"]), rows[-1])
    heads_dir = Path(secure["run_dir"]) / "checkpoints" / f"round-{args.rounds}"
    cost = codec_cost(base_config, heads_dir, args.population)
    result = {
        "population": args.population,
        "emulated": False,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "features_cold_seconds": prepared.seconds,
        "rounds": rows,
        "bytes_per_client_round": {"up": secure["bytes"]["up_per_client"], "down": secure["bytes"]["down_per_client"]},
        "bytes_by_setting": {f"{r['clients']}:{int(r['secagg'])}:{r['dropout']:g}": r["bytes"] for r in rows},
        "tau_heads_only": {"full_precision": cost["full_precision"]["tau"], "cut": cost["cut"]["tau"]},
        "codec_cost": cost,
    }
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


def print_row(row: dict) -> None:
    b = row["breakdown"]
    print(
        f"{row['clients']:>6} {'yes' if row['secagg'] else 'no':>6} {row['dropout']:>5.0%} {row['seconds']:>8.1f} "
        f"{row['client_compute_seconds']:>8.1f} {row['ratio'] or 0:>6.2f} {b['client_app_rest']:>8.1f} "
        f"{b['server']:>7.1f} {b['server_eval'] + b['client_eval']:>6.1f} {row['peak_rss_mb']:>7.0f} "
        f"{(row['bytes']['up_per_client'] + row['bytes']['down_per_client']) / 1e6:>6.2f}",
        flush=True,
    )


def print_table(result: dict) -> None:
    print(f"\npopulation {result['population']} users; first round of each run (module docstring)")
    print(
        f"{'M':>6} {'secagg':>6} {'drop':>5} {'round s':>8} {'compute':>8} {'ratio':>6} {'app rest':>8} "
        f"{'server':>7} {'eval':>6} {'RSS MB':>7} {'MB/cl':>6}"
    )
    for row in result["rounds"]:
        print_row(row)
    cost = result["codec_cost"]
    for name in ("starting_heads", "full_precision", "cut"):
        c = cost[name]
        accuracy = " ".join(f"{a:.3f}" for a in c["head_accuracy"])
        print(f"{name:>14} ({c['codec']}): head-1..K {accuracy}, heads-only tau {c['tau']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
