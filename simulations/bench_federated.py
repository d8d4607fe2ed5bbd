"""Federated benchmark, side by side in one run: `python -m simulations.bench_federated`.

1. Local training time of one client, with and without Opacus (same data, same initial heads, the
   noise multiplier calibrated beforehand so only training is timed).
2. Round time with and without SecAgg+ at 10 clients (after a warm-up round, order alternated,
   medians of --reps): the real ServerApp loop and ClientApp over
   the in-process grid (clients run one after another in this process, so the numbers are the
   sum of client work plus protocol cost, without simulation-runtime noise), for the scenario's
   workload and for a near-empty local workload that exposes the protocol overhead alone.
3. Bytes per client per round for the heads (measured on the wire: heads-codec down, the SecAgg+
   masked update up) versus the full base model (computed from its parameter count at the bytes per
   weight the heads took each way).

Prints JSON and a table; writes runs/bench-federated.json. Options: --clients, --reps, --scenario.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from client.node_config import NUM_PARTITIONS_KEY, PARTITION_ID_KEY

REPO = Path(__file__).resolve().parents[1]


def local_training(config_overrides: dict, reps: int) -> dict:
    from client.base_cache import cached_base
    from client.local_data import client_data
    from client.training.dp import PrivacyState, choose_noise_multiplier, plan
    from client.training.local_round import train_round
    from common.data.features import base_features
    from common.federation.config import FedConfig
    from common.heads.lookahead import DraftHeads

    times: dict[str, list[float]] = {"dp": [], "plain": []}
    cpu_times: dict[str, list[float]] = {"dp": [], "plain": []}  # process CPU time: robust to other load
    for rep in range(reps):
        for mode in ("plain", "dp") if rep % 2 == 0 else ("dp", "plain"):
            config = FedConfig.from_mapping(dict(config_overrides, dp=(mode == "dp")))
            base = cached_base(config)
            data = client_data(config, base, {PARTITION_ID_KEY: 0, NUM_PARTITIONS_KEY: 10})
            features = base_features(base, data.train)  # computed once, as a device caches them across rounds
            q, steps = plan(config, len(data.train))
            choose_noise_multiplier(config, q, steps)  # calibrated (and cached) outside the timing
            torch.manual_seed(rep)
            heads = DraftHeads.fresh(base, config.num_heads)
            cpu = time.process_time()
            result = train_round(heads, features, config, PrivacyState(f"bench-{rep}"))
            times[mode].append(result.seconds)
            cpu_times[mode].append(time.process_time() - cpu)
    return {
        "chunks": int(len(data.train)),
        "chunk_len": config.chunk_len,
        "batch_size": config.batch_size,
        "q": q,
        "steps": steps,
        "plain_seconds": times["plain"],
        "dp_seconds": times["dp"],  # the first (cold) pair is included
        "ratio_dp_over_plain_median": statistics.median(times["dp"]) / statistics.median(times["plain"]),
        "plain_cpu_seconds": cpu_times["plain"],
        "dp_cpu_seconds": cpu_times["dp"],
        "ratio_dp_over_plain_cpu_median": statistics.median(cpu_times["dp"]) / statistics.median(cpu_times["plain"]),
        # the least-disturbed repetition of each (other jobs on a shared machine only ever add time)
        "ratio_dp_over_plain_min": min(times["dp"]) / min(times["plain"]),
    }


def federated_round(config_overrides: dict, clients: int, secagg: bool) -> dict:
    from flwr.app import Context, RecordDict

    from client.client_app import app as client_app
    from common.federation.config import FedConfig
    from server.federation import run_federation
    from server.run.folder import RunFolder
    from simulations.inprocess import InProcessGrid

    with tempfile.TemporaryDirectory(prefix="fedla-bench-") as tmp:
        run_config = dict(
            config_overrides,
            secagg=secagg,
            **{
                "num-server-rounds": 1,
                "run-dir": tmp,
                "run-id": f"bench-{'secagg' if secagg else 'plain'}",
                "min-train-clients": clients,
                "min-available-clients": clients,
                "fraction-evaluate": 0.0,
                "eval-max-new-tokens": 0,
                "server-eval-chunks": 8,
                "node-wait-seconds": 0.0,
            },
        )
        grid = InProcessGrid(client_app, clients, run_config)
        context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
        cpu = time.process_time()
        run_dir = run_federation(grid, context, FedConfig.from_mapping(run_config))
        cpu = time.process_time() - cpu
        record = json.loads(RunFolder(run_dir).round_file(1).read_text())
        run_info = json.loads(RunFolder(run_dir).run_file.read_text())
    return {
        "fit_seconds": record["seconds"]["fit"],
        "round_seconds": record["wall_seconds"],
        "cpu_seconds": cpu,
        "client_train_seconds": record["seconds"]["client_train_sum"],
        "overhead_seconds": record["seconds"]["fit"] - record["seconds"]["client_train_sum"],
        "client_seconds_sum": sum(grid.client_seconds.values()),
        "aggregated": record["aggregated"],
        "succeeded": record["participation"]["succeeded"],
        "bytes": record["bytes"],
        "head_bytes": run_info["head_bytes"],
        "head_parameters": run_info["head_parameters"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--scenario", default="iid-10")
    parser.add_argument("--local-reps", type=int, help="repetitions of the local training timing (default --reps)")
    parser.add_argument("--local-only", action="store_true", help="only time local training (prints JSON)")
    parser.add_argument("--out", default=str(REPO / "runs" / "bench-federated.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from simulations.run import load_scenario

    workload = {
        k: v
        for k, v in load_scenario(args.scenario)["run-config"].items()
        if k
        in (
            "chunk-len",
            "max-chunks-per-client",
            "batch-size",
            "lr",
            "num-heads",
            "partitioning",
            "dp-target-epsilon",
            "dp-delta",
            "num-server-rounds",
            "local-epochs",
        )
    }
    started = time.perf_counter()
    report: dict = {
        "scenario": args.scenario,
        "workload": workload,
        "clients": args.clients,
        "torch_threads": torch.get_num_threads(),
    }
    report["local_training"] = local_training(workload, args.local_reps or args.reps)
    if args.local_only:
        print(json.dumps(report, indent=2))
        return 0
    light = dict(workload, **{"max-chunks-per-client": 16})
    federated_round(workload, args.clients, secagg=True)  # warm-up: every partition, cache and sigma loaded
    rounds = {}
    for name, overrides in (("workload", workload), ("light", light)):
        runs: dict[str, list[dict]] = {"plain": [], "secagg": []}
        for rep in range(args.reps):  # alternate the order so drifting machine load hits both alike
            for mode in ("plain", "secagg") if rep % 2 == 0 else ("secagg", "plain"):
                runs[mode].append(federated_round(overrides, args.clients, secagg=mode == "secagg"))

        def med(mode: str, key: str, runs: dict = runs) -> float:
            return statistics.median(r[key] for r in runs[mode])

        rounds[name] = {
            mode: {
                "all": runs[mode],
                **{
                    key: med(mode, key)
                    for key in ("fit_seconds", "cpu_seconds", "client_train_seconds", "overhead_seconds")
                },
                "bytes": runs[mode][-1]["bytes"],
                "head_bytes": runs[mode][-1]["head_bytes"],
                "head_parameters": runs[mode][-1]["head_parameters"],
            }
            for mode in ("plain", "secagg")
        }
        rounds[name]["ratio_fit_secagg_over_plain"] = med("secagg", "fit_seconds") / med("plain", "fit_seconds")
        rounds[name]["ratio_cpu_secagg_over_plain"] = med("secagg", "cpu_seconds") / med("plain", "cpu_seconds")
        # same training work in both modes: the protocol's own cost is what differs
        rounds[name]["overhead_seconds"] = {
            "plain": med("plain", "overhead_seconds"),
            "secagg": med("secagg", "overhead_seconds"),
        }
        # local training differs run to run (Poisson batch sizes, machine load) by more than the protocol costs:
        # the ratio for the same training work is (T + overhead with SecAgg+) / (T + overhead without)
        train = statistics.median(r["client_train_seconds"] for r in runs["plain"] + runs["secagg"])
        rounds[name]["ratio_equal_training"] = (train + rounds[name]["overhead_seconds"]["secagg"]) / (
            train + rounds[name]["overhead_seconds"]["plain"]
        )
    report["rounds"] = rounds

    from client.base_cache import base_dir
    from common.federation.config import FedConfig
    from common.model.base import load_base

    base = load_base(base_dir(FedConfig.from_mapping(workload)), device="cpu")
    base_params = sum(p.numel() for p in base.model.parameters())
    secure_bytes = rounds["workload"]["secagg"]["bytes"]  # measured by the guarded grid
    head_params = rounds["workload"]["secagg"]["head_parameters"]
    # the full base in the same encodings: the bytes a head weight costs each way, per base weight
    down = round(base_params * secure_bytes["down_per_client"] / head_params)
    up = round(base_params * secure_bytes["up_per_client"] / head_params)
    report["bytes_per_client_per_round"] = {
        "heads_measured": {
            "down": secure_bytes["down_per_client"],
            "up_secagg": secure_bytes["up_per_client"],
            "total": secure_bytes["down_per_client"] + secure_bytes["up_per_client"],
        },
        "full_base_computed": {"parameters": base_params, "down": down, "up_secagg": up, "total": down + up},
        "head_parameters": head_params,
    }
    heads_total = report["bytes_per_client_per_round"]["heads_measured"]["total"]
    report["bytes_per_client_per_round"]["ratio_full_over_heads"] = (down + up) / heads_total
    report["seconds"] = time.perf_counter() - started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    lt, b = report["local_training"], report["bytes_per_client_per_round"]
    print("\nmeasurement (medians)                              wall s    CPU s")
    print(
        f"local training, plain                            {statistics.median(lt['plain_seconds']):7.1f}  "
        f"{statistics.median(lt['plain_cpu_seconds']):7.1f}"
    )
    print(
        f"local training, Opacus DP                        {statistics.median(lt['dp_seconds']):7.1f}  "
        f"{statistics.median(lt['dp_cpu_seconds']):7.1f}"
    )
    print(
        f"  ratio DP / plain (goal <= 2.5)                 {lt['ratio_dp_over_plain_median']:7.2f}  "
        f"{lt['ratio_dp_over_plain_cpu_median']:7.2f}   (fastest of each: {lt['ratio_dp_over_plain_min']:.2f})"
    )
    for name in ("workload", "light"):
        r = rounds[name]
        for mode, label in (("plain", "plain FedAvg"), ("secagg", "SecAgg+")):
            print(
                f"round ({name}, {args.clients} clients), {label:<13}      {r[mode]['fit_seconds']:7.1f}  "
                f"{r[mode]['cpu_seconds']:7.1f}   (not client training: {r[mode]['overhead_seconds']:.1f} s)"
            )
        print(
            f"  ratio SecAgg+ / plain{' (goal <= 1.5)' if name == 'workload' else ' (protocol cost)'}"
            f"{'':<12}{r['ratio_fit_secagg_over_plain']:7.2f}  {r['ratio_cpu_secagg_over_plain']:7.2f}"
            f"   (same training work: {r['ratio_equal_training']:.3f})"
        )
    print(f"bytes/client/round, heads (down+up)           {b['heads_measured']['total']:,}")
    print(f"bytes/client/round, full base (down+up)       {b['full_base_computed']['total']:,}")
    print(f"  ratio full / heads                          {b['ratio_full_over_heads']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
