"""Side-by-side decoding benchmark: transformers' greedy and prompt-lookup generate vs our greedy and AMS-LD.

All modes run in one process, interleaved per prompt (the order rotates from prompt to prompt so
no mode always runs first), after a warm-up of every mode. Per mode: tokens/s over all prompts
(total new tokens / total seconds, prefill included), tau (new tokens per base forward after the
prefill) and whether every prompt's output equals transformers' greedy output token for token.
Speed-ups are medians over prompts of per-prompt tokens/s ratios against `hf_greedy`.

Our modes run with the degeneration guard off and no stop strings, so they produce exactly the
tokens `generate` produces (both stop at EOS or max_new_tokens).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import CompileConfig, PreTrainedTokenizerBase

from common.data.chunks import chunk_files
from common.decoding import AmsPolicy, CostCurve, DegenerationGuard, generate
from common.decoding.decoders import ForwardCounter
from common.errors import FedLookaheadError
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel, load_base
from common.model.int8_kernels import cpu_info, describe_cpu

BENCH_MODES = ("hf_greedy", "hf_prompt_lookup", "greedy", "ams")
# transformers' fastest greedy configuration: a static KV cache and its torch.compile'd decoding step,
# and AMS-LD under the same settings. Not in the default set: compiling costs minutes on a CPU.
HF_COMPILED = "hf_compiled"
AMS_COMPILED = "ams_compiled"
# Ablations of AMS-LD that can be added with `modes`: each source of candidates on its own.
ABLATIONS = {
    "ams_heads_only": {"ngram": False},
    "ams_ngram_only": {"heads": False},
    "ams_fixed_tree": {"cost_aware": False, "min_path_prob": 0.05},  # the hand-set budget the cost model replaced
}
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value for prompt_lookup_num_tokens


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    forwards: int


@dataclass
class ModeTotals:
    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    identical: bool = True
    mismatches: int = 0
    divergences: list[dict] = field(default_factory=list)
    per_prompt_speed: list[float] = field(default_factory=list)


def compiled_generation() -> dict:
    """generate's arguments for a static cache with a compiled decoding step. transformers compiles it by
    itself on CUDA; on a CPU only when CompileConfig's `_compile_all_devices` switch (private) asks it to."""
    config = CompileConfig()
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


def hf_generate(
    base: BaseModel, ids: torch.Tensor, max_new_tokens: int, prompt_lookup: int | None = None, compiled: bool = False
) -> Run:
    """transformers' own generate, greedy (with prompt lookup, or a compiled static-cache step), timed and
    with forwards counted."""
    eos = base.model.generation_config.eos_token_id
    pad = (
        base.tokenizer.pad_token_id if base.tokenizer.pad_token_id is not None else (eos if isinstance(eos, int) else 0)
    )
    kwargs = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    if compiled:
        kwargs.update(compiled_generation())
    with torch.no_grad(), ForwardCounter(base.model) as counter:
        started = time.perf_counter()
        out = base.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            **kwargs,
        )
        if base.device.type == "cuda":
            torch.cuda.synchronize(base.device)
        seconds = time.perf_counter() - started
    return Run(out[0, ids.shape[1] :].tolist(), seconds, max(1, counter.calls - 1))


def run_mode(
    mode: str,
    base: BaseModel,
    heads: DraftHeads | None,
    ids: torch.Tensor,
    max_new_tokens: int,
    policy: AmsPolicy | None,
    curve: CostCurve | None = None,
) -> Run:
    if mode == "hf_greedy":
        return hf_generate(base, ids, max_new_tokens)
    if mode == "hf_prompt_lookup":
        return hf_generate(base, ids, max_new_tokens, PROMPT_LOOKUP_TOKENS)
    if mode == HF_COMPILED:
        return hf_generate(base, ids, max_new_tokens, compiled=True)
    compiled = mode == AMS_COMPILED
    if mode in ABLATIONS:
        policy = dataclasses.replace(policy or AmsPolicy(), **ABLATIONS[mode])
    if mode in ABLATIONS or compiled:
        mode = "ams"
    result = generate(
        base,
        ids,
        mode=mode,
        heads=heads,
        max_new_tokens=max_new_tokens,
        degeneration_guard=False,
        policy=policy,
        curve=curve,
        compiled=compiled,
    )
    return Run(result.tokens, result.seconds, max(1, result.base_forwards))


def decode_benchmark(
    base: BaseModel,
    heads: DraftHeads | None,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    policy: AmsPolicy | None = None,
    modes: tuple[str, ...] = BENCH_MODES,
    progress: bool = True,
    curve: CostCurve | None = None,
) -> dict:
    """Run every mode on every prompt; returns the JSON-ready summary (see the module docstring)."""
    if "hf_greedy" not in modes:
        raise ValueError("the benchmark needs the hf_greedy reference mode")
    known = BENCH_MODES + (HF_COMPILED, AMS_COMPILED) + tuple(ABLATIONS)
    unknown = set(modes) - set(known)
    if unknown:
        raise ValueError(f"unknown benchmark modes {sorted(unknown)}: use {', '.join(known)}")
    ids_list = [p.view(1, -1).to(base.device) for p in prompts]
    longest = max(ids_list, key=lambda ids: ids.shape[1])
    for mode in modes:  # warm-up: first calls pay for lazy initialisation and allocator growth
        # the compiled step is warmed up at full length: its static cache is sized by the longest call
        length = max_new_tokens if mode in (HF_COMPILED, AMS_COMPILED) else min(16, max_new_tokens)
        run_mode(mode, base, heads, longest, length, policy, curve)
    totals = {mode: ModeTotals() for mode in modes}
    judge = DivergenceJudge(base)
    looping = 0  # prompts whose greedy output ends in a repetition loop, which prompt lookup drafts for free
    for index, ids in enumerate(tqdm(ids_list, desc="bench-decode", unit="prompt", disable=not progress)):
        order = modes[index % len(modes) :] + modes[: index % len(modes)]
        runs = {mode: run_mode(mode, base, heads, ids, max_new_tokens, policy, curve) for mode in order}
        reference = runs["hf_greedy"]
        looping += DegenerationGuard().looping(reference.tokens)
        for mode, run in runs.items():
            total = totals[mode]
            total.tokens += len(run.tokens)
            total.seconds += run.seconds
            total.forwards += run.forwards
            if run.tokens != reference.tokens:
                total.identical = False
                total.mismatches += 1
                total.divergences.append({"prompt": index, **judge(ids, reference.tokens, run.tokens)})
            total.per_prompt_speed.append(len(run.tokens) / run.seconds if run.seconds > 0 else 0.0)
    reference_speed = totals["hf_greedy"].per_prompt_speed
    summary = {
        "modes": {
            mode: {
                "tokens_per_s": round(t.tokens / t.seconds, 2) if t.seconds > 0 else 0.0,
                "tau": round(t.tokens / max(1, t.forwards), 3),
                "identical_to_hf_greedy": t.identical,
                "mismatches": t.mismatches,
                "divergences": t.divergences,
            }
            for mode, t in totals.items()
        },
        "speedup_vs_hf_greedy": {
            mode: round(statistics.median(s / r for s, r in zip(t.per_prompt_speed, reference_speed) if r > 0), 3)
            for mode, t in totals.items()
        },
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "greedy_outputs_ending_in_a_loop": looping,
        "hardware": hardware(base),
    }
    return summary


def hardware(base: BaseModel) -> dict:
    """Where figures were measured: the CPU (and GPU), the base's number format, and the int8 kernel in use."""
    out = {"cpu": cpu_info(), "device": str(base.device), "precision": base.precision}
    if base.device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(base.device)
    if base.int8:
        out["int8_kernel"] = {"name": base.int8_kernel.in_use, "exact": base.int8_kernel.exact}
    return out


def describe_hardware(hardware: dict) -> str:
    """One line: 'on <CPU> (<flags>)[, <GPU>], <precision>[ (kernel <name>, checked exact here)]'."""
    line = f"on {describe_cpu(hardware['cpu'])}" + (f", {hardware['gpu']}" if "gpu" in hardware else "")
    line += f", {hardware['precision']}"
    if kernel := hardware.get("int8_kernel"):
        line += f" (kernel {kernel['name']}, {'checked exact here' if kernel['exact'] else 'NOT checked exact'})"
    return line


NEAR_TIE = 1e-4  # fp32 logit gap below which two choices are a rounding tie, not a decoding bug
TIE_ULPS = 2  # in a lower precision, a gap of this many units in the last place of the top logit is a tie


def near_tie_gap(top_logit: float, dtype: torch.dtype) -> float:
    """The largest top-2 logit gap that rounding alone explains: 1e-4 in fp32; in bf16/fp16, whose
    logits are rounded to 8/11 significant bits, two ulps of the top logit (a tree forward and a
    one-token forward run differently blocked matrix products, as transformers' own prompt lookup
    does: its bf16 output differs from bf16 `generate` at such gaps too)."""
    return max(NEAR_TIE, TIE_ULPS * torch.finfo(dtype).eps * abs(top_logit))


class DivergenceJudge:
    """Finds where an output first differs from greedy and says whether rounding alone explains it.

    A tree forward and a one-token forward need not round identically; a difference is acceptable
    only at a near-tie. In fp32 that is a top-2 gap below 1e-4. In bf16/fp16 a gap within two ulps of
    the top logit is a tie; a larger one is checked against exact arithmetic: the same weights run
    in fp32 give the exact gap between greedy's token and ours, and the plain low-precision forward's
    distance from those exact logits measures this position's rounding error. Two roundings can swap
    the tokens only when the exact gap is within twice that error. Anything else is a decoding bug.
    """

    def __init__(self, base: BaseModel) -> None:
        self.base = base
        self._exact: torch.nn.Module | None = None  # the fp32 twin, built on the first unexplained gap

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, reference: list[int], tokens: list[int]) -> dict:
        pairs = list(zip(reference, tokens))
        position = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        agreed = torch.tensor(reference[:position], dtype=torch.long, device=ids.device)
        prefix = torch.cat([ids[0], agreed]).view(1, -1)
        logits = self.base.model(input_ids=prefix).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        gap = float(top[0] - top[1])
        verdict = {
            "position": position,
            "top2_logit_gap": gap,
            "near_tie": gap <= near_tie_gap(float(top[0]), self.base.dtype),
        }
        if verdict["near_tie"] or self.base.dtype == torch.float32 or position == len(pairs):
            return verdict  # (an output that stops early, at EOS, differs at a token only one side has)
        exact = self._exact_model()(input_ids=prefix).logits[0, -1]
        chosen = torch.tensor(pairs[position], device=logits.device)  # greedy's token, then ours
        exact_gap = float(exact[chosen[0]] - exact[chosen[1]])
        error = float((logits[chosen] - exact[chosen]).abs().max())
        return {**verdict, "exact_gap": exact_gap, "rounding_error": error, "near_tie": abs(exact_gap) <= 2 * error}

    def _exact_model(self) -> torch.nn.Module:
        if self._exact is None:
            self._exact = copy.deepcopy(self.base.model).float()  # bf16/fp16 weights are exact in fp32
        return self._exact


QUALITY_CHUNKS, QUALITY_CHUNK_LEN = 32, 128


def quality_chunks(files: list[Path], tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """The held-out sample every quality figure uses: 32 chunks of 128 tokens, drawn with a fixed seed."""
    chunks = chunk_files(files, tokenizer, QUALITY_CHUNK_LEN)
    if len(chunks) == 0:
        raise FedLookaheadError(f"no held-out file is {QUALITY_CHUNK_LEN} tokens long: quality not measured")
    return chunks[torch.randperm(len(chunks), generator=torch.Generator().manual_seed(0))[:QUALITY_CHUNKS]]


@torch.inference_mode()
def heldout_quality(base: BaseModel, chunks: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Mean next-token cross-entropy (nats) over `chunks`, and the greedy choice at every position."""
    losses, greedy = [], []
    for chunk in chunks:
        logits = base.model(input_ids=chunk.view(1, -1)).logits[0].float()
        losses.append(torch.nn.functional.cross_entropy(logits[:-1], chunk[1:]))
        greedy.append(logits.argmax(-1))
    return float(torch.stack(losses).mean()), torch.stack(greedy)


def int8_quality(base: BaseModel, files: list[Path]) -> dict:
    """What int8 weights cost in quality: held-out loss of this int8 base against its fp32 original, and
    how often their greedy choices agree."""
    chunks = quality_chunks(files, base.tokenizer)
    int8, int8_greedy = heldout_quality(base, chunks)
    fp32, fp32_greedy = heldout_quality(load_base(base.path, device="cpu"), chunks)
    return {
        "heldout_loss_int8": round(int8, 4),
        "heldout_loss_fp32": round(fp32, 4),
        "perplexity_ratio": round(math.exp(int8 - fp32), 4),
        "greedy_agreement_with_fp32": round(float((int8_greedy == fp32_greedy).float().mean()), 4),
        "heldout_tokens": chunks.numel(),
    }


def format_table(summary: dict) -> str:
    lines = [f"{'mode':<18}{'tokens/s':>10}{'tau':>8}{'speedup':>9}  identical to hf_greedy"]
    for mode, row in summary["modes"].items():
        lines.append(
            f"{mode:<18}{row['tokens_per_s']:>10.1f}{row['tau']:>8.2f}"
            f"{summary['speedup_vs_hf_greedy'][mode]:>8.2f}x  {_identity(row)}"
        )
    lines.append(
        f"{summary['prompts']} prompts, up to {summary['max_new_tokens']} new tokens, batch size 1; "
        f"{summary['greedy_outputs_ending_in_a_loop']} greedy outputs end in a repetition loop"
    )
    if "hardware" in summary:
        lines.append(describe_hardware(summary["hardware"]))
    if "int8_quality" in summary:
        quality = summary["int8_quality"]
        lines.append(
            f"int8 quality: held-out loss {quality['heldout_loss_int8']:.4f} against fp32 "
            f"{quality['heldout_loss_fp32']:.4f} nats (perplexity x{quality['perplexity_ratio']:.3f}), greedy "
            f"choice as fp32's at {quality['greedy_agreement_with_fp32']:.1%} of {quality['heldout_tokens']} tokens"
        )
    return "\n".join(lines)


def _identity(row: dict) -> str:
    if row["identical_to_hf_greedy"]:
        return "yes"
    ties = sum(d["near_tie"] for d in row["divergences"])
    return (
        f"NO: {row['mismatches']} differ ({ties} at near-ties, gaps "
        + ", ".join(f"{d['top2_logit_gap']:.1e}" for d in row["divergences"][:4])
        + ")"
    )
