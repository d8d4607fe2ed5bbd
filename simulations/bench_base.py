"""What the embedded default base costs on this machine: the figures docs/benchmarks.md quotes ("Base model by dtype").

    python -m simulations.bench_base [--json runs/bench-base.json]

Reports the one-off conversion time (from the base folder's fedla_build.json), the process's resident
memory with the base loaded, transformers' greedy `generate` tokens/s at 1 and 2 CPU threads (4
held-out prompts x 64 new tokens), and the verify cost curve c(n)/c(1) (one base forward over n new
tokens after a 256-token KV cache, LM head over one row) at 1 and 2 threads, for each dtype asked
for (`--dtypes fp32,bf16,int8`; int8: see common/model/quant.py). The quality cost of a dtype is its mean next-token loss on 32 held-out
chunks of 128 tokens, and how often its greedy choice agrees with fp32's there.

The JSON names the CPU (`cpu`: model and int8-relevant ISA flags) and, under `dtypes.int8`, the int8
kernel in use (`kernel`), whether it was checked bit-exact here (`exact`) and what the kernel choice
measured (`kernel_report`; see common/model/int8_kernels.py). `FEDLA_INT8_KERNEL=int_mm` (or `onednn`)
forces a kernel to compare them.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from common.data.chunks import prompts_from_files, stdlib_files
from common.decoding.calibration import measure_cost_curve
from common.decoding.fidelity import heldout_quality, quality_chunks
from common.model.base import DTYPES, load_base
from common.model.default import ensure_default_base
from common.model.int8_kernels import cpu_info, describe_cpu


def generate_tokens_per_s(base, prompts: list[torch.Tensor], max_new_tokens: int) -> float:
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        ids = prompt.view(1, -1)
        started = time.perf_counter()
        out = base.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=base.tokenizer.pad_token_id,
        )
        seconds += time.perf_counter() - started
        tokens += out.shape[1] - ids.shape[1]
    return tokens / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("runs/bench-base.json"))
    parser.add_argument("--dtypes", default="fp32", help="Comma-separated: fp32, bf16, fp16, int8.")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if unknown := set(dtypes) - {*DTYPES, "int8"}:
        parser.error(f"unknown dtypes {sorted(unknown)}: use {', '.join(DTYPES)}, int8")
    path = ensure_default_base()
    build = json.loads((path / "fedla_build.json").read_text())
    result = {
        "base": str(path),
        "parameters": build["parameters"],
        "convert_seconds": build["convert_seconds"],
        "cpu": cpu_info(),
        "dtypes": {},
    }
    reference_greedy = None
    for name in dict.fromkeys(["fp32", *dtypes]):  # fp32 first: the reference for greedy agreement
        base = load_base(path, device="cpu", dtype=DTYPES.get(name), int8=name == "int8")
        prompts = prompts_from_files(stdlib_files("heldout"), base.tokenizer, 4, 64)
        loss, greedy = heldout_quality(base, quality_chunks(stdlib_files("heldout"), base.tokenizer))
        reference_greedy = greedy if reference_greedy is None else reference_greedy
        generate_tokens_per_s(base, prompts[:1], 8)  # warm-up
        row = {
            "heldout_loss": round(loss, 4),
            "greedy_agreement_with_fp32": round(float((greedy == reference_greedy).float().mean()), 4),
            "threads": {},
        }
        if base.int8:
            report = base.int8_kernel
            row.update(kernel=report.in_use, exact=report.exact, kernel_report=report.to_json())
            if note := report.slower_than_fp32():
                print(f"warning: {note}")
        for threads in (1, 2):
            torch.set_num_threads(threads)
            curve = measure_cost_curve(base)
            row["threads"][threads] = {
                "generate_tokens_per_s": round(generate_tokens_per_s(base, prompts, 64), 1),
                "one_token_ms": round(curve.verify(1, 1) * 1000, 1),
                "cost_relative": curve.relative(),
            }
        if name in dtypes:
            result["dtypes"][name] = row
        del base
    result["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(
        f"{build['parameters']:,} parameters; converted in {build['convert_seconds']:.0f}s; "
        f"peak resident memory {result['max_rss_mib']} MiB (every dtype loaded in turn); on {describe_cpu(result['cpu'])}"
    )
    sizes = list(next(iter(result["dtypes"].values()))["threads"][1]["cost_relative"])
    print(
        f"{'dtype':<12}{'held-out loss':>14}{'agree fp32':>11}{'threads':>8}{'generate tok/s':>15}{'1 token ms':>11}  "
        + "".join(f"{'c(' + str(n) + ')':>8}" for n in sizes)
    )
    for name, row in result["dtypes"].items():
        label = f"int8/{row['kernel']}" if "kernel" in row else name
        for threads, cost in row["threads"].items():
            print(
                f"{label:<12}{row['heldout_loss']:>14.4f}{row['greedy_agreement_with_fp32']:>11.4f}{threads:>8}"
                f"{cost['generate_tokens_per_s']:>15.1f}{cost['one_token_ms']:>11.1f}  "
                + "".join(f"{cost['cost_relative'][n]:>8.2f}" for n in sizes)
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
