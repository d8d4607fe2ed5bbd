"""Decoding with the frozen base: AMS-LD (adaptive multi-step lookahead, lossless) and its baselines.

    generate(base, prompt_ids, mode="ams" | "greedy" | "beam" | "fused", heads=..., ...) -> GenerationResult

- "ams": lossless speculative decoding. The lookahead heads, prompt lookup and (when one is given) a
  datastore of the device's own files draft a tree of continuations; the base scores the whole tree in
  one forward with a tree attention mask; the longest prefix the base agrees with is kept, plus the
  base's own next token. Greedy output equals
  `model.generate(do_sample=False)` token for token (checked in fp32); with temperature / top-p the
  output distribution equals the base's (tree speculative sampling).
- "greedy": plain decoding with the KV cache, one token per forward (samples when temperature > 0).
- "beam": beam search via transformers' generate (AmsPolicy.beam_width beams).
- "fused": the seed article's fused lookahead re-ranking; it changes the output (see fused_decode).

Missing heads, or heads trained for another base, fall back to "greedy" with a warning.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import torch

from common.decoding.calibration import CostCurve, cost_curve
from common.decoding.core import (
    DegenerationGuard,
    GenerationResult,
    Stopper,
    Timer,
    check_prompt,
    check_sampling,
    make_generator,
    sampling_probs,
)
from common.decoding.datastore import Datastore
from common.decoding.decoders import UnsupportedCache, ams_decode, beam_decode, fused_decode, greedy_decode
from common.decoding.drafting import AmsPolicy, HeadsTreeDrafter
from common.decoding.prompt_lookup import NgramIndex
from common.errors import FedLookaheadError
from common.heads.lookahead import DraftHeads, base_mismatch
from common.model.attention import EXACT_ATTENTION, GQA_ATTENTION
from common.model.base import BaseModel
from common.paths import default_heads_dir

MODES = ("ams", "greedy", "beam", "fused")
# attention implementations that accept the tree's 4D additive mask
TREE_ATTENTION = ("eager", "sdpa", GQA_ATTENTION, EXACT_ATTENTION)

__all__ = [
    "MODES",
    "AmsPolicy",
    "CostCurve",
    "Datastore",
    "DecodingFallbackWarning",
    "DegenerationGuard",
    "GenerationResult",
    "HeadsTreeDrafter",
    "NgramIndex",
    "generate",
    "load_heads",
    "sampling_probs",
]


class DecodingFallbackWarning(UserWarning):
    """AMS-LD or fused decoding could not run as asked and plain decoding was used instead."""


def load_heads(directory: str | Path | None, base: BaseModel) -> DraftHeads | None:
    """Heads from `directory` (default: default_heads_dir()), or None with a warning if none fit the base."""
    directory = Path(directory).expanduser() if directory is not None else default_heads_dir()
    try:
        return DraftHeads.load(directory, base)
    except FedLookaheadError as exc:
        warnings.warn(f"{exc}; falling back to plain decoding", DecodingFallbackWarning, stacklevel=2)
        return None


def _usable_heads(heads: DraftHeads | None, base: BaseModel, mode: str) -> DraftHeads | None:
    """The heads bound to this base instance, or None (with a warning) when they are missing or do not fit."""
    if heads is None:
        warnings.warn(
            f"mode {mode!r} needs lookahead heads and none were given; using greedy decoding",
            DecodingFallbackWarning,
            stacklevel=3,
        )
        return None
    config = heads.config
    reason = base_mismatch(config.base_fingerprint, config.hidden_size, config.vocab_size, base)
    if reason:
        warnings.warn(f"heads were {reason}; using greedy decoding", DecodingFallbackWarning, stacklevel=3)
        return None
    if heads.base_lm_head is not base.model.get_output_embeddings():  # same checkpoint, another loaded instance
        rebound = DraftHeads(config, base)
        rebound.load_state_dict_checked({k: v.detach() for k, v in heads.state_dict().items()})
        heads = rebound
    return heads.eval()


def generate(
    base: BaseModel,
    prompt_ids: torch.Tensor,
    *,
    mode: str = "ams",
    heads: DraftHeads | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_strings: Sequence[str] = (),
    degeneration_guard: bool = True,
    policy: AmsPolicy | None = None,
    seed: int | None = None,
    curve: CostCurve | None = None,
    stopper: Stopper | None = None,
    compiled: bool = False,
    datastore: Datastore | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids` (batch size 1); see the module docstring.

    `curve`: the device's verify cost curve for the cost-aware tree (default: measured once per
    device and cached, see calibration.py); unused unless `policy.cost_aware`.
    `stopper`: a caller's Stopper (the endpoint's streaming one, which sees every accepted step) in
    place of the one built from max_new_tokens, stop_strings and degeneration_guard.
    `datastore`: an index of the device's own files (datastore.py), drafted from beside the heads.
    """
    if mode not in MODES:
        raise FedLookaheadError(f"unknown decoding mode {mode!r}: use one of {', '.join(MODES)}")
    check_sampling(temperature, top_p, max_new_tokens, seed)
    ids = check_prompt(base, prompt_ids)
    policy = policy or AmsPolicy()
    if mode in ("ams", "fused"):
        heads = _usable_heads(heads, base, mode)
        if heads is None:
            mode = "greedy"
    attention = getattr(base.model.config, "_attn_implementation", "eager")
    if mode == "ams" and attention not in TREE_ATTENTION:
        warnings.warn(
            f"AMS-LD needs an attention implementation that takes a 4D float mask ({', '.join(TREE_ATTENTION)}), "
            f"not {attention!r}; using greedy decoding",
            DecodingFallbackWarning,
            stacklevel=2,
        )
        mode = "greedy"
    room = base.max_positions - ids.shape[1]
    stopper = stopper or Stopper(base, max_new_tokens, stop_strings, degeneration_guard, room)
    generator = make_generator(base.device, seed)
    if max_new_tokens == 0:
        return GenerationResult([], "", 0, 0.0, "max_new_tokens", mode)
    if mode == "ams" and policy.cost_aware and curve is None:
        curve = cost_curve(base)  # measured once per device (seconds), outside the timed decoding
    with Timer(base.device) as timer:
        if mode == "ams":
            try:
                tokens, forwards, reason, stats = ams_decode(
                    base,
                    ids,
                    heads,
                    policy,
                    stopper,
                    temperature,
                    top_p,
                    generator,
                    curve,
                    reproducible=temperature > 0 and seed is not None,
                    compiled=compiled,
                    datastore=datastore,
                )
            except UnsupportedCache as exc:
                warnings.warn(
                    f"AMS-LD does not support this base's {exc}; using greedy decoding",
                    DecodingFallbackWarning,
                    stacklevel=2,
                )
                mode = "greedy"
                generator = make_generator(base.device, seed)
        if mode == "greedy":
            tokens, forwards, reason, stats = greedy_decode(base, ids, stopper, temperature, top_p, generator)
        elif mode == "fused":
            tokens, forwards, reason, stats = fused_decode(
                base, ids, heads, policy, stopper, temperature, top_p, generator
            )
        elif mode == "beam":
            tokens, forwards, reason, stats = beam_decode(
                base, ids, policy, stopper, temperature, top_p, generator, seed
            )
    text = base.tokenizer.decode(tokens, skip_special_tokens=True)
    return GenerationResult(tokens, text, forwards, timer.seconds, reason, mode, stats)
