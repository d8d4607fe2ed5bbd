"""The main job (`make demo`): embedded base -> federated DP + SecAgg+ heads -> AMS-LD -> speedup -> dashboard.

    python -m simulations.demo [--rounds N] [--prompts N] [--max-new-tokens N]

1. builds the embedded default base model on first use (`fedla bootstrap`),
2. runs the `demo` scenario (simulations/scenarios/demo.toml) through `flwr run` on a private local
   SuperLink: Flower ClientApps train the heads with Opacus DP-SGD, the ServerApp aggregates them with
   SecAgg+ and pushes them back every round; the run is written to runs/<run-id>/ and runs/fedla.db,
3. generates a continuation of held-out code with AMS-LD and the federated heads,
4. measures, side by side in one process, AMS-LD against transformers' greedy `generate` on held-out
   prompts and prints the speedup, and
5. says how to open the aggregation dashboard on that run.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from common.base import load_base
from common.bench import decode_benchmark, format_table
from common.data import prompts_from_files, stdlib_files
from common.decoding import generate
from common.default_model import ensure_default_base
from common.heads import DraftHeads
from simulations import run as scenario_runner

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="Federated rounds (default: the scenario's).")
    parser.add_argument("--prompts", type=int, default=8, help="Held-out prompts in the speed comparison.")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    print("== 1/5 embedded default base model", flush=True)
    base = load_base(ensure_default_base(), device="auto")
    build = base.path / "fedla_build.json"
    if build.is_file():
        report = json.loads(build.read_text())
        print(f"{base.path}: {report['parameters']:,} parameters, held-out loss {report['heldout_loss']}")

    print("\n== 2/5 federated training: Flower simulation, Opacus DP-SGD, SecAgg+", flush=True)
    run_id = f"demo-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    runner_args = ["demo", "--run-id", run_id] + (["--rounds", str(args.rounds)] if args.rounds else [])
    if scenario_runner.main(runner_args) != 0:
        print(f"error: the federated run failed; see runs/{run_id}/flwr.log", file=sys.stderr)
        return 1
    summary = json.loads((REPO / "runs" / run_id / "summary.json").read_text())
    checkpoint = Path(summary["checkpoints"][-1]["path"])
    heads = DraftHeads.load(checkpoint, base)
    print(f"global heads v{heads.config.version} from {checkpoint}")

    print("\n== 3/5 AMS-LD generation with the federated heads", flush=True)
    prompts = prompts_from_files(stdlib_files("heldout"), base.tokenizer, args.prompts, 64)
    result = generate(base, prompts[0], mode="ams", heads=heads, max_new_tokens=args.max_new_tokens)
    print(base.tokenizer.decode(prompts[0]) + "\033[1m" + result.text + "\033[0m")
    print(f"[{len(result.tokens)} tokens, {result.tokens_per_s:.0f} tokens/s, tau {result.tau:.2f}]")

    print("\n== 4/5 speed, side by side in one process (held-out stdlib code)", flush=True)
    bench = decode_benchmark(base, heads, prompts, args.max_new_tokens)
    print(format_table(bench))
    (REPO / "runs" / run_id / "bench_decode.json").write_text(json.dumps(bench, indent=2))
    speedup = bench["speedup_vs_hf_greedy"]["ams"]
    identical = bench["modes"]["ams"]["identical_to_hf_greedy"]
    print(f"\nAMS-LD with federated heads: {speedup:.2f}x transformers greedy generate, "
          f"tau {bench['modes']['ams']['tau']:.2f}, output identical to greedy: {identical}")

    print("\n== 5/5 aggregation dashboard", flush=True)
    print(f"fedla dashboard --db {REPO / 'runs' / 'fedla.db'}   # then open http://127.0.0.1:8080/runs/{run_id}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
