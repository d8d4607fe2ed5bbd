"""Side-by-side decoding benchmark: transformers' generate (greedy, prompt lookup; or sampling) vs AMS-LD.

All modes run in one process, interleaved per prompt (the order rotates from prompt to prompt so
no mode always runs first), after a warm-up of every mode. Per mode: tokens/s over all prompts
(total new tokens / total seconds, prefill included), tau (new tokens per base forward after the
prefill) and, when greedy, whether every prompt's output equals transformers' greedy output token for
token. Speed-ups are medians over prompts of per-prompt tokens/s ratios against the reference
(`hf_greedy`, or `hf_sample` at a temperature), over all prompts and over those whose reference output
does not end in a repetition loop (loops are what prompt lookup drafts for free). Sampling runs are
seeded per prompt; their outputs are not compared (the distribution test in the suite covers them).

Our modes run with the degeneration guard off and no stop strings, so they produce exactly the
tokens `generate` produces (both stop at EOS or max_new_tokens).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import CompileConfig

from common.decoding import AmsPolicy, CostCurve, DegenerationGuard, generate
from common.decoding.datastore import Datastore
from common.decoding.decoders import ForwardCounter
from common.decoding.fidelity import DivergenceJudge
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel
from common.model.int8_kernels import cpu_info, describe_cpu

BENCH_MODES = ("hf_greedy", "hf_prompt_lookup", "greedy", "ams")
# transformers' fastest greedy configuration: a static KV cache and its torch.compile'd decoding step,
# and AMS-LD under the same settings. Not in the default set: compiling costs minutes on a CPU.
HF_COMPILED = "hf_compiled"
AMS_COMPILED = "ams_compiled"
# Sampling (a benchmark's temperature > 0): transformers' sampling generate, with and without prompt lookup.
HF_SAMPLE = "hf_sample"
HF_PROMPT_LOOKUP_SAMPLE = "hf_prompt_lookup_sample"
SAMPLING_MODES = (HF_SAMPLE, HF_PROMPT_LOOKUP_SAMPLE, "ams", "ams_heads_only")
GREEDY_ONLY = ("hf_greedy", "hf_prompt_lookup", HF_COMPILED, "greedy", AMS_COMPILED)
# Ablations of AMS-LD that can be added with `modes`: each source of candidates on its own, and the
# device's datastore in the tree or alone.
ABLATIONS = {
    "ams_heads_only": {"ngram": False},
    "ams_ngram_only": {"heads": False},
    "ams_fixed_tree": {"cost_aware": False, "min_path_prob": 0.05},  # the hand-set budget the cost model replaced
    "ams_datastore": {},
    "ams_datastore_only": {"heads": False, "ngram": False},
}
DATASTORE_MODES = ("ams_datastore", "ams_datastore_only")
KNOWN_MODES = BENCH_MODES + (HF_COMPILED, AMS_COMPILED, HF_SAMPLE, HF_PROMPT_LOOKUP_SAMPLE) + tuple(ABLATIONS)
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


@dataclass(frozen=True)
class Setting:
    """What every mode of one benchmark shares."""

    base: BaseModel
    heads: DraftHeads | None
    policy: AmsPolicy | None = None
    curve: CostCurve | None = None
    datastore: Datastore | None = None
    temperature: float = 0.0

    @property
    def reference(self) -> str:
        return "hf_greedy" if self.temperature == 0 else HF_SAMPLE


def compiled_generation() -> dict:
    """generate's arguments for a static cache with a compiled decoding step. transformers compiles it by
    itself on CUDA; on a CPU only when CompileConfig's `_compile_all_devices` switch (private) asks it to."""
    config = CompileConfig()
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


def hf_generate(
    base: BaseModel,
    ids: torch.Tensor,
    max_new_tokens: int,
    prompt_lookup: int | None = None,
    compiled: bool = False,
    temperature: float = 0.0,
    seed: int = 0,
) -> Run:
    """transformers' own generate, greedy (with prompt lookup, or a compiled static-cache step) or sampling
    at `temperature` from the full distribution (seeded), timed and with forwards counted."""
    eos = base.model.generation_config.eos_token_id
    pad = (
        base.tokenizer.pad_token_id if base.tokenizer.pad_token_id is not None else (eos if isinstance(eos, int) else 0)
    )
    kwargs: dict = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    if compiled:
        kwargs.update(compiled_generation())
    if temperature > 0:  # no top-k or top-p cut: the distribution AMS-LD samples from
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    else:
        kwargs.update(do_sample=False)
    with torch.no_grad(), ForwardCounter(base.model) as counter:
        started = time.perf_counter()
        out = base.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, pad_token_id=pad, **kwargs
        )
        if base.device.type == "cuda":
            torch.cuda.synchronize(base.device)
        seconds = time.perf_counter() - started
    return Run(out[0, ids.shape[1] :].tolist(), seconds, max(1, counter.calls - 1))


def run_mode(mode: str, setting: Setting, ids: torch.Tensor, max_new_tokens: int, seed: int = 0) -> Run:
    base, temperature = setting.base, setting.temperature
    if mode in ("hf_greedy", HF_SAMPLE):
        return hf_generate(base, ids, max_new_tokens, temperature=temperature, seed=seed)
    if mode in ("hf_prompt_lookup", HF_PROMPT_LOOKUP_SAMPLE):
        return hf_generate(base, ids, max_new_tokens, PROMPT_LOOKUP_TOKENS, temperature=temperature, seed=seed)
    if mode == HF_COMPILED:
        return hf_generate(base, ids, max_new_tokens, compiled=True)
    policy = setting.policy
    if mode in ABLATIONS:
        policy = dataclasses.replace(policy or AmsPolicy(), **ABLATIONS[mode])
    result = generate(
        base,
        ids,
        mode="greedy" if mode == "greedy" else "ams",
        heads=setting.heads,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        degeneration_guard=False,
        policy=policy,
        curve=setting.curve,
        compiled=mode == AMS_COMPILED,
        datastore=setting.datastore if mode in DATASTORE_MODES else None,
    )
    return Run(result.tokens, result.seconds, max(1, result.base_forwards))


def check_modes(modes: tuple[str, ...], setting: Setting) -> None:
    unknown = set(modes) - set(KNOWN_MODES)
    if unknown:
        raise ValueError(f"unknown benchmark modes {sorted(unknown)}: use {', '.join(KNOWN_MODES)}")
    if setting.reference not in modes:
        raise ValueError(f"the benchmark needs the {setting.reference} reference mode")
    sampled_only = {HF_SAMPLE, HF_PROMPT_LOOKUP_SAMPLE}
    wrong = set(modes) & (set(GREEDY_ONLY) if setting.temperature > 0 else sampled_only)
    if wrong:
        kind = "greedy" if setting.temperature > 0 else "sampling"
        raise ValueError(f"modes {sorted(wrong)} are {kind}-only: not at temperature {setting.temperature}")
    if setting.datastore is None and set(modes) & set(DATASTORE_MODES):
        raise ValueError(f"modes {', '.join(DATASTORE_MODES)} need a datastore")


def decode_benchmark(
    setting: Setting,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    modes: tuple[str, ...] = BENCH_MODES,
    progress: bool = True,
) -> dict:
    """Run every mode on every prompt; returns the JSON-ready summary (see the module docstring)."""
    check_modes(modes, setting)
    base, reference_mode = setting.base, setting.reference
    ids_list = [p.view(1, -1).to(base.device) for p in prompts]
    longest = max(ids_list, key=lambda ids: ids.shape[1])
    for mode in modes:  # warm-up: first calls pay for lazy initialisation and allocator growth
        # the compiled step is warmed up at full length: its static cache is sized by the longest call
        length = max_new_tokens if mode in (HF_COMPILED, AMS_COMPILED) else min(16, max_new_tokens)
        run_mode(mode, setting, longest, length)
    totals = {mode: ModeTotals() for mode in modes}
    judge = DivergenceJudge(base)
    loops = []  # per prompt: the reference output ends in a repetition loop, which prompt lookup drafts for free
    for index, ids in enumerate(tqdm(ids_list, desc="bench-decode", unit="prompt", disable=not progress)):
        order = modes[index % len(modes) :] + modes[: index % len(modes)]
        runs = {mode: run_mode(mode, setting, ids, max_new_tokens, seed=index) for mode in order}
        reference = runs[reference_mode]
        loops.append(DegenerationGuard().looping(reference.tokens))
        for mode, run in runs.items():
            total = totals[mode]
            total.tokens += len(run.tokens)
            total.seconds += run.seconds
            total.forwards += run.forwards
            if setting.temperature == 0 and run.tokens != reference.tokens:
                total.identical = False
                total.mismatches += 1
                total.divergences.append({"prompt": index, **judge(ids, reference.tokens, run.tokens)})
            total.per_prompt_speed.append(len(run.tokens) / run.seconds if run.seconds > 0 else 0.0)
    reference_speed = totals[reference_mode].per_prompt_speed

    def median_speedup(speeds: list[float], keep: list[bool]) -> float | None:
        ratios = [s / r for s, r, k in zip(speeds, reference_speed, keep) if k and r > 0]
        return round(statistics.median(ratios), 3) if ratios else None

    summary = {
        "modes": {
            mode: {
                "tokens_per_s": round(t.tokens / t.seconds, 2) if t.seconds > 0 else 0.0,
                "tau": round(t.tokens / max(1, t.forwards), 3),
                **(
                    {"identical_to_hf_greedy": t.identical, "mismatches": t.mismatches, "divergences": t.divergences}
                    if setting.temperature == 0
                    else {}
                ),
            }
            for mode, t in totals.items()
        },
        "reference": reference_mode,
        "temperature": setting.temperature,
        "speedup": {mode: median_speedup(t.per_prompt_speed, [True] * len(loops)) for mode, t in totals.items()},
        "speedup_without_loops": {
            mode: median_speedup(t.per_prompt_speed, [not loop for loop in loops]) for mode, t in totals.items()
        },
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "max_new_tokens": max_new_tokens,
        "outputs_ending_in_a_loop": sum(loops),
        "loop_share": round(sum(loops) / len(loops), 3),
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


def format_table(summary: dict) -> str:
    """The summary as the table a person reads: per mode tokens/s, tau, speed-up over the reference (all
    prompts, and those whose output does not end in a loop) and whether its outputs are greedy's."""
    sampled = summary["temperature"] > 0
    last = f"sampled at temperature {summary['temperature']:g}" if sampled else "identical to hf_greedy"
    lines = [f"{'mode':<24}{'tokens/s':>10}{'tau':>8}{'speedup':>9}{'no loops':>10}  {last}"]
    for mode, row in summary["modes"].items():
        without = summary["speedup_without_loops"][mode]
        lines.append(
            f"{mode:<24}{row['tokens_per_s']:>10.1f}{row['tau']:>8.2f}{summary['speedup'][mode]:>8.2f}x"
            + (f"{without:>9.2f}x" if without is not None else f"{'-':>10}")
            + f"  {'(not compared)' if sampled else _identity(row)}"
        )
    if "benchmark_set" in summary:
        lines.append(f"set: {summary['benchmark_set']['name']}")
    lines.append(
        f"{summary['prompts']} prompts of {min(summary['prompt_tokens'])}-{max(summary['prompt_tokens'])} tokens, "
        f"up to {summary['max_new_tokens']} new tokens, batch size 1, speed-ups against {summary['reference']}; "
        f"{summary['outputs_ending_in_a_loop']} of its outputs end in a repetition loop"
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
