"""The draft vocabulary: the heads score only the N tokens the base actually tends to emit.

Built from public data only (never a client's private text, whose token frequencies would leak
through the heads' config, which every client receives): the base's greedy choices over public
chunks, ranked by frequency. The end-of-sequence tokens are always included, so the heads can
draft the end of an answer. Coverage (the share of greedy choices inside the vocabulary) says how
often the draft vocabulary alone rules out a correct draft.
"""

from __future__ import annotations

import torch

from common.data.features import Features
from common.decoding.core import eos_ids
from common.errors import FedLookaheadError
from common.model.base import BaseModel

PUBLIC_FILES_PER_BATCH = 32


def build_draft_vocab(base: BaseModel, public: Features, size: int) -> list[int]:
    """The `size` most frequent greedy tokens of the base on public features (ties: lower id first)."""
    if size < 1:
        raise FedLookaheadError(f"draft vocabulary size must be positive, got {size}")
    if size >= base.vocab_size:
        return []  # the whole vocabulary: nothing to restrict
    counts = torch.bincount(public.greedy.flatten(), minlength=base.vocab_size).double()
    for token in eos_ids(base):
        counts[token] = float("inf")
    # Stable ranking: by count, then by id (argsort of -count is stable with stable=True).
    order = torch.argsort(-counts, stable=True)
    return sorted(order[:size].tolist())


def coverage(draft_vocab: list[int], features: Features) -> float:
    """Share of the base's greedy choices in `features` that the draft vocabulary contains."""
    if not draft_vocab:
        return 1.0
    inside = torch.zeros(int(features.greedy.max()) + 1 if features.greedy.numel() else 1, dtype=torch.bool)
    ids = torch.tensor([t for t in draft_vocab if t < len(inside)], dtype=torch.long)
    inside[ids] = True
    return float(inside[features.greedy.flatten()].float().mean()) if features.greedy.numel() else 1.0


def public_draft_vocab(base: BaseModel, size: int, chunks: int = 256, chunk_len: int = 128, seed: int = 0) -> list[int]:
    """The draft vocabulary from a seeded sample of public code (the stdlib train split), for heads that
    start without one (a federation with no init-heads): every client gets the same public table.

    Files are drawn in a seeded order and tokenized only until twice `chunks` chunks are in hand (the
    whole split took most of a small federation's start-up), and the chunks are drawn from those."""
    from common.data.chunks import drawn_chunks, stdlib_files
    from common.data.features import base_features

    generator = torch.Generator().manual_seed(seed)
    files = stdlib_files("train")
    shuffled = [files[i] for i in torch.randperm(len(files), generator=generator).tolist()]
    sample = drawn_chunks(shuffled, base.tokenizer, chunk_len, chunks, generator, PUBLIC_FILES_PER_BATCH)
    return build_draft_vocab(base, base_features(base, sample), size)
