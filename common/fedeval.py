"""Evaluation shared by the federated server and clients: AMS-LD tau of a set of heads on prompts."""

from __future__ import annotations

import logging

import torch

from common.base import BaseModel
from common.heads import DraftHeads

log = logging.getLogger(__name__)


def decode_tau(base: BaseModel, heads: DraftHeads, prompts: list[torch.Tensor], max_new_tokens: int) -> float | None:
    """Mean AMS-LD tau (tokens accepted per base forward, bonus token included) over `prompts`.

    None when there is nothing to decode or the decoder (`common.decoding`) is not available.
    """
    if not prompts or max_new_tokens <= 0:
        return None
    try:
        from common.decoding import generate
    except ImportError:
        log.warning("common.decoding is not available yet: tau not measured")
        return None
    try:
        taus = [float(generate(base, p, mode="ams", heads=heads, max_new_tokens=max_new_tokens).tau) for p in prompts]
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
