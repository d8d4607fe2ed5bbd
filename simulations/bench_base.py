"""What the embedded default base costs on this machine: the figures the README's base table quotes.

    python -m simulations.bench_base [--json runs/bench-base.json]

Reports the one-off conversion time (from the base folder's fedla_build.json), the process's resident
memory with the base loaded, transformers' greedy `generate` tokens/s at 1 and 2 CPU threads (4
held-out prompts x 64 new tokens), and the verify cost curve c(n)/c(1) (one base forward over n new
tokens after a 256-token KV cache, LM head over one row) at 1 and 2 threads.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from common.base import load_base
from common.data import prompts_from_files, stdlib_files
from common.decoding.calibration import measure_cost_curve
from common.default_model import ensure_default_base


def generate_tokens_per_s(base, prompts: list[torch.Tensor], max_new_tokens: int) -> float:
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        ids = prompt.view(1, -1)
        started = time.perf_counter()
        out = base.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                  pad_token_id=base.tokenizer.pad_token_id)
        seconds += time.perf_counter() - started
        tokens += out.shape[1] - ids.shape[1]
    return tokens / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("runs/bench-base.json"))
    args = parser.parse_args(argv)
    base = load_base(ensure_default_base(), device="cpu")
    build = json.loads((base.path / "fedla_build.json").read_text())
    prompts = prompts_from_files(stdlib_files("heldout"), base.tokenizer, 4, 64)
    generate_tokens_per_s(base, prompts[:1], 8)  # warm-up
    result = {"base": str(base.path), "parameters": build["parameters"], "convert_seconds": build["convert_seconds"],
              "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), "threads": {}}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        curve = measure_cost_curve(base)
        result["threads"][threads] = {
            "generate_tokens_per_s": round(generate_tokens_per_s(base, prompts, 64), 1),
            "one_token_ms": round(curve.verify(1, 1) * 1000, 1),
            "cost_relative": curve.relative(),
        }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"{build['parameters']:,} parameters; converted in {build['convert_seconds']:.0f}s; "
          f"resident memory {result['max_rss_mib']} MiB")
    sizes = list(result["threads"][1]["cost_relative"])
    print(f"{'threads':<8}{'generate tok/s':>15}{'1 token ms':>11}  " + "".join(f"{'c(' + str(n) + ')':>8}" for n in sizes))
    for threads, row in result["threads"].items():
        print(f"{threads:<8}{row['generate_tokens_per_s']:>15.1f}{row['one_token_ms']:>11.1f}  "
              + "".join(f"{row['cost_relative'][n]:>8.2f}" for n in sizes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
