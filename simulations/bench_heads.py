"""Draft-head training variants on the real base, side by side: cost per training token and what they buy.

    python -m simulations.bench_heads [--chunks 800] [--minutes 1.5] [--json runs/bench-heads.json]

Every variant trains fresh heads on the same public chunks (stdlib train split) for the same wall-clock
budget and is measured on the same held-out chunks and prompts (held-out stdlib packages):

* `uncached_full_vocab_parallel`: what `train-heads` did before the feature cache: a base forward for
  every batch of every epoch, all 49,152 LM-head rows, Medusa-style parallel heads. Only its cost is
  measured (a few batches), since at about 100 tokens/s it learns nothing in the budget.
* `cached_full_vocab_parallel`, `cached_8192_parallel`, `cached_8192_recurrent`, `cached_4096_recurrent`,
  `cached_8192_eagle`: the base features computed once per chunk (common/data/features.py), then the draft
  vocabulary size and the head architecture varied one at a time (eagle: the fusion head followed by one
  decoder layer shaped like the base's, common/heads/eagle.py).
* `dp_8192_recurrent`, `dp_8192_eagle`: the same under Opacus DP-SGD (client/training/local_round.py's train_round,
  sigma for eps 8 over the rounds), for the DP / non-DP rate ratio.

Per variant: training tokens/s, held-out top-1 accuracy of each head against the base's greedy choices,
and heads-only AMS-LD on held-out prompts: accepted length tau (tokens per base forward, bonus included)
and decoding tokens/s against plain greedy decoding run on the same prompts, interleaved. `--variants`
picks some. `--curve-minutes M` also trains `--curve-arch` heads for M minutes and reports held-out
accuracy against training tokens (where it flattens). Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from client.training.dp import PrivacyState
from client.training.local_round import train_round
from common.data.chunks import chunk_files, prompts_from_files, stdlib_files
from common.data.features import Features, base_features, compute_features, extractor_for
from common.decoding import AmsPolicy, generate
from common.federation.config import FedConfig
from common.heads.draft_vocab import build_draft_vocab
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel, load_base
from common.model.default import ensure_default_base
from common.training.loop import evaluate_heads, feature_loader, train_epoch, train_heads

VARIANTS = {  # name -> (draft vocabulary size, 0 = all; architecture)
    "cached_full_vocab_parallel": (0, "parallel"),
    "cached_8192_parallel": (8192, "parallel"),
    "cached_8192_recurrent": (8192, "recurrent"),
    "cached_4096_recurrent": (4096, "recurrent"),
    "cached_8192_eagle": (8192, "eagle"),
}
DP_VARIANTS = {"dp_8192_recurrent": "recurrent", "dp_8192_eagle": "eagle"}
UNCACHED = "uncached_full_vocab_parallel"


def heads_only_decoding(
    base: BaseModel, heads: DraftHeads, prompts: list[torch.Tensor], max_new_tokens: int
) -> dict[str, float]:
    """AMS-LD with the heads as the only drafter (no n-gram source) against greedy, prompt by prompt:
    tau and the tokens/s ratio (side by side, so machine noise hits both)."""
    totals = {mode: {"tokens": 0, "seconds": 0.0, "forwards": 0} for mode in ("greedy", "ams")}
    for prompt in prompts:
        for mode, total in totals.items():
            result = generate(
                base,
                prompt,
                mode=mode,
                heads=heads,
                max_new_tokens=max_new_tokens,
                degeneration_guard=False,
                policy=AmsPolicy(ngram=False),
            )
            total["tokens"] += len(result.tokens)
            total["seconds"] += result.seconds
            total["forwards"] += result.base_forwards
    rates = {mode: total["tokens"] / total["seconds"] for mode, total in totals.items()}
    return {
        "tau_heads_only": round(totals["ams"]["tokens"] / max(1, totals["ams"]["forwards"]), 3),
        "heads_only_tokens_per_s": round(rates["ams"], 2),
        "greedy_tokens_per_s": round(rates["greedy"], 2),
        "heads_only_speedup": round(rates["ams"] / rates["greedy"], 3),
    }


def uncached_rate(base: BaseModel, chunks: torch.Tensor, batches: int = 3, batch_size: int = 16) -> float:
    """Training tokens/s when every batch pays a base forward and the full-vocabulary heads."""
    heads = DraftHeads.fresh(base, 4, arch="parallel")
    optimizer = torch.optim.AdamW(heads.parameters(), lr=2e-3)
    started = time.perf_counter()
    for i in range(batches):
        batch = chunks[i * batch_size : (i + 1) * batch_size]
        features = compute_features(base, batch, batch_size=batch_size, progress=False)
        train_epoch(heads, feature_loader(features, batch_size, shuffle=False), optimizer, 4, show_progress=False)
    return batches * batch_size * chunks.shape[1] / (time.perf_counter() - started)


def dp_variant(
    base: BaseModel, features: Features, vocab: list[int], seconds: float, arch: str
) -> tuple[DraftHeads, float]:
    """Opacus DP-SGD rounds (eps 8 planned over them) until the budget is spent; returns heads and tokens/s."""
    heads = DraftHeads.fresh(base, 4, arch=arch, draft_vocab=vocab)
    config = FedConfig.from_mapping(
        {"dp": True, "dp-target-epsilon": 8.0, "batch-size": 64, "lr": 2e-3, "num-server-rounds": 4, "local-epochs": 1}
    )
    state = PrivacyState(run_key="bench")
    tokens, spent, rounds = 0, 0.0, 0
    while spent < seconds and rounds < config.num_server_rounds:
        result = train_round(heads, features, config, state)
        tokens += result.metrics.tokens
        spent += result.seconds
        rounds += 1
    return heads, tokens / spent if spent else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=800, help="Public training chunks of 128 tokens.")
    parser.add_argument("--minutes", type=float, default=1.5, help="Training budget of every variant.")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--curve-minutes", type=float, default=0.0)
    parser.add_argument("--curve-arch", default="recurrent", choices=["recurrent", "parallel", "eagle"])
    parser.add_argument(
        "--variants",
        default=",".join([UNCACHED, *VARIANTS, *DP_VARIANTS]),
        help="Comma-separated variants to run (default: all; empty: only the --curve-minutes curve).",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("runs/bench-heads.json"))
    parser.add_argument("--save-heads", type=Path, default=None, help="Save each variant's heads in DIR/<variant>.")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    chosen = [name for name in args.variants.split(",") if name]  # "": only the curve
    known = [UNCACHED, *VARIANTS, *DP_VARIANTS]
    if set(chosen) - set(known):
        parser.error(f"unknown variants {sorted(set(chosen) - set(known))}: use {', '.join(known)}")

    base = load_base(ensure_default_base(), device="auto")
    generator = torch.Generator().manual_seed(0)
    chunks = chunk_files(stdlib_files("train"), base.tokenizer, 128)
    chunks = chunks[torch.randperm(len(chunks), generator=generator)[: args.chunks]]
    heldout = chunk_files(stdlib_files("heldout"), base.tokenizer, 128)
    heldout = heldout[torch.randperm(len(heldout), generator=generator)[:128]]
    prompts = prompts_from_files(stdlib_files("heldout"), base.tokenizer, args.prompts, 64)

    results: dict = {"base": str(base.path), "train_chunks": len(chunks), "minutes_per_variant": args.minutes}
    if UNCACHED in chosen:
        results[UNCACHED] = {"train_tokens_per_s": round(uncached_rate(base, chunks), 1)}
    sample = chunks[:32]
    started = time.perf_counter()
    compute_features(extractor_for(base), sample, progress=False)  # uncached, in the dtype training uses
    results["feature_tokens_per_s"] = round(sample.numel() / (time.perf_counter() - started), 1)
    features = base_features(base, chunks, progress=True)  # once per chunk; later runs read the cache
    heldout_features = base_features(base, heldout, progress=True)
    vocabs = {size: build_draft_vocab(base, features, size) for size in (4096, 8192)}

    def measure(name: str, heads: DraftHeads, rate: float) -> None:
        if args.save_heads is not None:
            heads.save(args.save_heads / name)
        accuracy = evaluate_heads(heads, heldout_features)["head_accuracy"]
        results[name] = {
            "train_tokens_per_s": round(rate, 1),
            "heldout_acc": [round(a, 4) for a in accuracy],
            "trainable_parameters": heads.num_trainable(),
            **heads_only_decoding(base, heads, prompts, args.max_new_tokens),
        }
        print(name, results[name], flush=True)

    for name, (size, arch) in VARIANTS.items():
        if name not in chosen:
            continue
        torch.manual_seed(0)
        heads = DraftHeads.fresh(base, 4, arch=arch, draft_vocab=vocabs[size] if size else [])
        began = time.perf_counter()
        history = train_heads(heads, features, epochs=100, lr=2e-3, max_seconds=args.minutes * 60, show_progress=False)
        measure(name, heads, sum(h["tokens"] for h in history) / (time.perf_counter() - began))
    for name, arch in DP_VARIANTS.items():
        if name not in chosen:
            continue
        heads, rate = dp_variant(base, features, vocabs[8192], args.minutes * 60, arch)
        measure(name, heads, rate)
        if f"cached_8192_{arch}" in results:
            results[name]["dp_over_nodp_rate"] = round(rate / results[f"cached_8192_{arch}"]["train_tokens_per_s"], 3)

    if args.curve_minutes > 0:
        torch.manual_seed(0)
        heads = DraftHeads.fresh(base, 4, arch=args.curve_arch, draft_vocab=vocabs[8192])
        optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-3)  # constant: the curve is not bent by a schedule
        curve, trained, epoch = [], 0, 0
        deadline = time.perf_counter() + args.curve_minutes * 60
        while time.perf_counter() < deadline:
            loader = feature_loader(features, 16, shuffle=True, seed=epoch)
            trained += train_epoch(heads, loader, optimizer, 4, show_progress=False, deadline=deadline).tokens
            epoch += 1
            curve.append(
                {
                    "train_tokens": trained,
                    "heldout_acc": [round(a, 4) for a in evaluate_heads(heads, heldout_features)["head_accuracy"]],
                }
            )
            print("curve", curve[-1], flush=True)
        results["curve"] = {"arch": args.curve_arch, "lr": 1e-3, "points": curve}
        if args.save_heads is not None:
            heads.save(args.save_heads / f"curve_{args.curve_arch}")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(
        f"\n{'variant':<28}{'train tok/s':>12}{'DP/non-DP':>10}{'tau':>7}{'decode x greedy':>16}  held-out top-1 per head"
    )
    for name in [UNCACHED, *VARIANTS, *DP_VARIANTS]:
        row = results.get(name)
        if row is None:
            continue
        accuracy = " / ".join(f"{a:.3f}" for a in row.get("heldout_acc", []))
        tau = f"{row['tau_heads_only']:.2f}" if "tau_heads_only" in row else "-"
        speed = f"{row['heads_only_speedup']:.2f}x" if "heads_only_speedup" in row else "-"
        ratio = f"{row['dp_over_nodp_rate']:.2f}" if "dp_over_nodp_rate" in row else "-"
        print(f"{name:<28}{row['train_tokens_per_s']:>12.1f}{ratio:>10}{tau:>7}{speed:>16}  {accuracy}")
    print(f"base features: {results['feature_tokens_per_s']:.0f} tokens/s (once per chunk); JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
