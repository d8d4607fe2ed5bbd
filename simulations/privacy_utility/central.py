"""Centrally trained heads: the server's public heads (stdlib, trained once and cached) and the
non-private central fine-tuning on the pooled private chunks (the upper reference)."""

from __future__ import annotations

from pathlib import Path

import torch

from simulations.privacy_utility.configs import Scale
from simulations.privacy_utility.corpus import ClientSplit


def ensure_public_heads(path: Path | None, base, scale: Scale, cache: Path) -> Path:
    """The server's public heads: the given folder, else (trained once, cached) on the stdlib train split."""
    if path is not None:
        return path
    budget = f"{scale.chunk_len}-{scale.public_files}f-{scale.public_chunks}c-{scale.public_seconds:g}s"
    target = cache / f"public-heads-{base.fingerprint[:12]}-{budget}"  # a quick run's heads never stand in
    if (target / "heads_config.json").exists():
        return target
    from common.data.chunks import chunk_files, stdlib_files
    from common.training.loop import fit_heads

    files = stdlib_files("train")
    chunks = chunk_files(files[: scale.public_files], base.tokenizer, scale.chunk_len)
    heldout = chunk_files(stdlib_files("heldout")[:10], base.tokenizer, scale.chunk_len)
    heads, _ = fit_heads(
        base,
        chunks[: scale.public_chunks],
        heldout[:32],
        draft_vocab_size=min(8192, base.vocab_size // 2),
        epochs=2,
        max_seconds=scale.public_seconds,
        show_progress=False,
    )
    heads.save(target)
    return target


def central_finetune(public_dir: Path, base, splits: list[ClientSplit], run_config: dict):
    """Non-private central fine-tuning on the pooled training chunks: the clients' own optimiser and
    batch (client.training.local_round.train_round with dp=false), one pass per federated round."""
    from client.training.local_round import train_round
    from common.data.features import Features
    from common.federation.config import FedConfig
    from common.heads.lookahead import DraftHeads

    pooled = Features(
        torch.cat([s.train.tokens for s in splits]),
        torch.cat([s.train.hidden for s in splits]),
        torch.cat([s.train.greedy for s in splits]),
    )
    config = FedConfig.from_mapping(dict(run_config, **{"dp": False, "local-epochs": run_config["num-server-rounds"]}))
    heads = DraftHeads.load(public_dir, base)
    heads.train()
    train_round(heads, pooled, config, None)
    return heads, len(pooled)
