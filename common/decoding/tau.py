"""Evaluation shared by the federated server and clients: AMS-LD tau of a set of heads on prompts."""

from __future__ import annotations

import logging

import torch

from common.decoding import AmsPolicy, generate
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel

log = logging.getLogger(__name__)


def decode_tau(
    base: BaseModel, heads: DraftHeads, prompts: list[torch.Tensor], max_new_tokens: int, ngram: bool = True
) -> float | None:
    """Mean AMS-LD tau (tokens accepted per base forward, bonus token included) over `prompts`.

    `ngram=False` switches off the decoder's prompt-lookup drafter, so tau measures the heads alone.
    None when there is nothing to decode.
    """
    if not prompts or max_new_tokens <= 0:
        return None
    try:
        policy = AmsPolicy() if ngram else AmsPolicy(ngram=False)
        taus = [
            float(generate(base, p, mode="ams", heads=heads, max_new_tokens=max_new_tokens, policy=policy).tau)
            for p in prompts
        ]
    except Exception:  # noqa: BLE001 - a decoder failure costs this measurement, never the federated run
        log.exception("AMS-LD decoding failed: tau not measured this time")
        return None
    return sum(taus) / len(taus)


def chunk_prompts(chunks: torch.Tensor, count: int, length: int) -> list[torch.Tensor]:
    """The first `length` tokens of the first `count` chunks (1-D tensors)."""
    if not len(chunks):
        return []
    length = max(1, min(length, chunks.shape[1] - 1))
    return [chunks[i, :length].clone() for i in range(min(count, len(chunks)))]
