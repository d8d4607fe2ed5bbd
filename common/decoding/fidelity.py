"""Is an output the base's own? The divergence judge that tells a rounding tie from a decoding bug, and what
int8 weights cost in held-out quality."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from common.data.chunks import chunk_files
from common.errors import FedLookaheadError
from common.model.base import BaseModel, load_base

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
