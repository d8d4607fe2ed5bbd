"""One benchmark run's shared state (the base, the clients' splits, the shared run config, the result
being filled in) and what every stage does with it: run one federated configuration and evaluate its
heads, save the JSON (with the PNG beside it)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from server.run.folder import RunFolder
from simulations.privacy_utility.central import ensure_public_heads
from simulations.privacy_utility.configs import DELTA, Scale, base_run_config
from simulations.privacy_utility.corpus import ClientSplit, client_splits, private_corpus
from simulations.privacy_utility.federated import federate, final_heads
from simulations.privacy_utility.plot import plot
from simulations.privacy_utility.results import curve_for_run, federated_run_dirs, round_floats
from simulations.privacy_utility.tau import evaluate

# The run-config keys a federated entry reports under "config" (those its configuration sets).
REPORTED_KEYS = (
    "batch-size",
    "lr",
    "dp",
    "dp-target-epsilon",
    "dp-max-grad-norm",
    "server-optimizer",
    "server-lr",
    "server-momentum",
    "dp-trainable",
    "dp-rank",
    "dp-level",
    "update-max-norm",
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Session:
    scale: Scale
    base: object  # the base loaded here: every run's final heads are loaded against it
    client_base: object  # the instance the ClientApps use (client.base_cache.cached_base)
    public_dir: Path
    splits: list[ClientSplit]
    run_config: dict
    out_json: Path
    started: float
    result: dict
    meta: dict
    timings: dict[str, float]

    @classmethod
    def open(cls, scale: Scale, json_path: str, base_path: str, public_heads: str, threads: int) -> Session:
        """Load the base, the public heads (trained when absent), the private corpus and every client's
        features; the result starts with the scale and the meta block."""
        started = time.perf_counter()

        from common.model.base import load_base
        from common.model.default import ensure_default_base
        from common.paths import cache_root

        out_json = Path(json_path).resolve()
        out_dir = out_json.with_suffix("")
        out_dir = out_dir.parent / f"{out_dir.name}-runs"
        out_dir.mkdir(parents=True, exist_ok=True)
        cache = cache_root() / "privacy_utility"
        base_dir = Path(base_path).expanduser().resolve() if base_path else ensure_default_base()
        base = load_base(base_dir)
        public_dir = ensure_public_heads(
            Path(public_heads).expanduser().resolve() if public_heads else None, base, scale, cache
        )
        data_dir = private_corpus(scale.packages, scale.max_files_per_package, cache)
        run_config = base_run_config(scale, base_dir, data_dir, public_dir, out_dir)
        timings: dict[str, float] = {}

        t = time.perf_counter()
        from client.base_cache import cached_base
        from common.federation.config import FedConfig

        client_base = cached_base(FedConfig.from_mapping(run_config))  # the instance the ClientApps will use
        splits = client_splits(run_config, client_base, scale.clients)
        timings["features"] = time.perf_counter() - t
        log(
            f"{scale.clients} clients: train chunks {[len(s.train) for s in splits]}, "
            f"val {[len(s.val) for s in splits]}, test {[len(s.test) for s in splits]} ({timings['features']:.0f}s)"
        )

        result: dict = {"clients": scale.clients, "rounds": scale.rounds}
        meta: dict = {
            "delta": DELTA,
            "scale": dataclasses.asdict(scale),
            "base": str(base_dir),
            "public_heads": str(public_dir),
            "private_data": str(data_dir),
            "train_chunks": [len(s.train) for s in splits],
            "test_chunks": [len(s.test) for s in splits],
            "val_chunks": [len(s.val) for s in splits],
            "threads": threads,
            "tau_method": "teacher-forced chain estimate: 1 + mean over positions of the number of leading heads "
            "whose top-1 equals the base's greedy token (greedy chain verification)",
            "evaluated_on": "each client's held-out test half; mean over clients",
            "selection": "DP tricks kept by tau on the held-out validation half (disjoint from test)",
        }
        return cls(scale, base, client_base, public_dir, splits, run_config, out_json, started, result, meta, timings)

    def save(self) -> None:
        """Write the JSON so far (and a copy into each federated run's folder), and the PNG once there is a curve."""
        payload = round_floats(
            {
                **self.result,
                "meta": {**self.meta, "seconds": self.timings, "total_seconds": time.perf_counter() - self.started},
            }
        )
        self.out_json.write_text(json.dumps(payload, indent=1))
        for run_dir in federated_run_dirs(payload):  # so the dashboard shows the curve on each run's page
            curve_for_run(payload, run_dir).write(RunFolder(run_dir).privacy_utility)
        try:
            if self.result.get("dp"):
                plot(payload, self.out_json.with_suffix(".png"))
        except Exception as exc:  # noqa: BLE001 - a plot never loses the numbers
            log(f"could not plot: {exc}")

    def run(self, name: str, config: dict) -> dict:
        """One federated configuration, its heads evaluated on every client's test (and validation) half;
        the entry keeps its heads under "_heads" (`strip` drops them before it goes into the JSON)."""
        t = time.perf_counter()
        run_dir, privacy = federate(config, self.scale.clients, name)
        heads = final_heads(run_dir, self.base)
        entry = {
            **evaluate(heads, self.splits),
            "val_tau_heads_only": evaluate(heads, self.splits, "val")["tau_heads_only"],
            "privacy": privacy,
            "run_dir": str(run_dir),
            "config": {k: config[k] for k in REPORTED_KEYS if k in config},
        }
        self.timings[name] = time.perf_counter() - t
        log(
            f"{name}: tau {entry['tau_heads_only']:.3f} (val {entry['val_tau_heads_only']:.3f}) acc "
            f"{[round(a, 3) for a in entry['acc']]} eps {privacy['epsilon_max']} ({self.timings[name]:.0f}s)"
        )
        entry["_heads"] = heads
        return entry


def strip(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "_heads"}
