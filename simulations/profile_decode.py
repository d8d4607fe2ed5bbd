"""Where an AMS-LD step spends its time on this device: base body, LM head, drafting, cache, the rest.

    python -m simulations.profile_decode --heads DIR [--prompts 8] [--max-new-tokens 128] [--dtype fp32]
        [--threads 1] [--heads-only] [--json runs/profile-decode.json]

Wall-clock timers wrap the decoder's parts for the duration of the run (no cProfile, whose per-call
overhead would inflate the Python-heavy parts): the base body's forward (BaseRunner.forward), the LM
head (a forward hook on the base's output embedding: verification and the first token), drafting
(HeadsTreeDrafter.draft_inputs and .propose: the heads and the tree choice), cache compaction
(the runner's keep_path), and everything else inside `generate` (masks, acceptance, bookkeeping). On CPU every
op is synchronous, so the split is exact; on CUDA the timers synchronise first. `--heads-only` profiles
AMS-LD without the n-gram source. The same prompts also run plain greedy decoding, whose ms per token is
the yardstick for a step: a step pays when it costs less than tau greedy tokens. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterator

import torch

from common.data.chunks import prompts_from_files, stdlib_files
from common.decoding import AmsPolicy, generate
from common.decoding.core import BaseRunner
from common.decoding.drafting import HeadsTreeDrafter
from common.errors import FedLookaheadError
from common.heads.lookahead import DraftHeads
from common.model.base import DTYPES, BaseModel, load_base
from common.model.default import resolve_base


def _timed(seconds: dict[str, float], part: str, fn: Callable, device: torch.device) -> Callable:
    def wrapper(*args, **kwargs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[part] += time.perf_counter() - started

    return wrapper


@contextlib.contextmanager
def phase_timers(base: BaseModel) -> Iterator[dict[str, float]]:
    """Accumulate seconds per part while the block runs; every patch is undone on exit."""
    seconds: dict[str, float] = defaultdict(float)
    patches = [
        (BaseRunner, "forward", "base body"),
        (HeadsTreeDrafter, "draft_inputs", "drafting"),
        (HeadsTreeDrafter, "propose", "drafting"),
        (BaseRunner, "keep_path", "cache compaction"),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    lm_head = base.model.get_output_embeddings()
    started: list[float] = []
    hooks = [
        lm_head.register_forward_pre_hook(lambda *_: started.append(time.perf_counter())),
        lm_head.register_forward_hook(
            lambda *_: seconds.__setitem__("lm head", seconds["lm head"] + time.perf_counter() - started.pop())
        ),
    ]
    try:
        for owner, name, part in patches:
            setattr(owner, name, _timed(seconds, part, getattr(owner, name), base.device))
        yield seconds
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        for hook in hooks:
            hook.remove()


def profile(
    base: BaseModel, heads: DraftHeads, prompts: list[torch.Tensor], max_new_tokens: int, policy: AmsPolicy
) -> dict:
    run = dict(heads=heads, max_new_tokens=max_new_tokens, degeneration_guard=False, policy=policy)
    generate(base, prompts[0], **{**run, "max_new_tokens": 16})  # warm-up, calibration
    total = tokens = forwards = greedy_seconds = greedy_tokens = 0.0
    for prompt in prompts:  # the yardstick, outside the timers
        result = generate(base, prompt, mode="greedy", max_new_tokens=max_new_tokens, degeneration_guard=False)
        greedy_seconds, greedy_tokens = greedy_seconds + result.seconds, greedy_tokens + len(result.tokens)
    with phase_timers(base) as seconds:
        for prompt in prompts:
            result = generate(base, prompt, **run)
            total += result.seconds
            tokens += len(result.tokens)
            forwards += result.base_forwards
    parts = dict(seconds)
    parts["other (masks, acceptance, bookkeeping)"] = max(0.0, total - sum(parts.values()))
    return {
        "seconds": round(total, 3),
        "tokens_per_s": round(tokens / total, 2),
        "tau": round(tokens / max(1, forwards), 3),
        "greedy_tokens_per_s": round(greedy_tokens / greedy_seconds, 2),
        "greedy_ms_per_token": round(1000 * greedy_seconds / greedy_tokens, 2),
        "share": {part: round(value / total, 4) for part, value in parts.items()},
        "ms_per_step": {part: round(1000 * value / max(1, forwards), 2) for part, value in parts.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=None, help="Base folder, or smollm2 (default) / toy.")
    parser.add_argument("--heads", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads-only", action="store_true", help="AMS-LD without the n-gram source.")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        base = load_base(resolve_base(args.base), dtype=DTYPES[args.dtype])
        heads = DraftHeads.load(args.heads, base)
    except FedLookaheadError as exc:
        parser.error(str(exc))  # one line, exit 2
    prompts = prompts_from_files(stdlib_files("heldout"), base.tokenizer, args.prompts, args.prompt_tokens)
    report = {
        "dtype": args.dtype,
        "threads": args.threads,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "heads_only": args.heads_only,
        **profile(base, heads, prompts, args.max_new_tokens, AmsPolicy(ngram=not args.heads_only)),
    }
    print(
        f"AMS-LD{' (heads only)' if args.heads_only else ''}, {report['prompts']} prompts x {args.max_new_tokens} "
        f"tokens, {args.dtype}, {args.threads} thread(s): {report['tokens_per_s']} tok/s, tau {report['tau']}; "
        f"greedy {report['greedy_tokens_per_s']} tok/s ({report['greedy_ms_per_token']} ms/token)"
    )
    print(f"{'part':<42} {'share':>7} {'ms/step':>8}")
    for part, share in sorted(report["share"].items(), key=lambda item: -item[1]):
        print(f"{part:<42} {100 * share:>6.1f}% {report['ms_per_step'][part]:>8.2f}")
    step = sum(report["ms_per_step"].values())
    print(f"a step: {step:.1f} ms = {step / report['greedy_ms_per_token']:.2f} greedy tokens, for tau {report['tau']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
