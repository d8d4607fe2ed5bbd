"""The heads a federation starts from: trained once, centrally, on public code (the stdlib training split).

DP fine-tuning from untrained heads does not learn in a run of a few clients and rounds (issue 30: 2
clients, 2 rounds ended at head-1 accuracy 0.04), so `flwr run .` starts from these by default
(`init-heads = "public"`), as `make demo` does. They are built once per base, head count, chunk length
and training budget, and kept under <cache>/heads/public-*; a later run loads them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from common.data.chunks import chunk_files, stdlib_files
from common.heads.lookahead import CONFIG_FILE, WEIGHTS_FILE, DraftHeads
from common.model.base import BaseModel
from common.paths import cache_root
from common.training.loop import fit_heads

PUBLIC_CHUNKS = 640  # public training chunks (82k tokens at 128): base features take ~1.5 min on 2 cores
HELDOUT_CHUNKS = 64
REPORT_FILE = "train_report.json"


def train_public_heads(base: BaseModel, out: Path, minutes: float, num_heads: int, chunk_len: int) -> DraftHeads:
    """Heads trained centrally on the public stdlib training split, within `minutes`; saved to `out`."""
    generator = torch.Generator().manual_seed(0)
    chunks = chunk_files(stdlib_files("train"), base.tokenizer, chunk_len)
    heldout = chunk_files(stdlib_files("heldout"), base.tokenizer, chunk_len)
    chunks = chunks[torch.randperm(len(chunks), generator=generator)[:PUBLIC_CHUNKS]]
    heldout = heldout[torch.randperm(len(heldout), generator=generator)[:HELDOUT_CHUNKS]]
    heads, report = fit_heads(base, chunks, heldout, num_heads, epochs=4, max_seconds=minutes * 60)
    heads.save(out)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    accuracy = " / ".join(f"{a:.2f}" for a in report["heldout"]["head_accuracy"])
    print(
        f"public heads: {report['train_tokens']:,} training tokens in {report['train_seconds']:.0f}s "
        f"({report['train_tokens_per_s']:.0f} tokens/s; base features {report['feature_seconds']:.0f}s), "
        f"held-out top-1 per head {accuracy}, draft vocabulary {report['draft_vocab']:,} tokens -> {out}",
        flush=True,
    )
    return heads


def public_heads_dir(base: BaseModel, num_heads: int, chunk_len: int, minutes: float) -> Path:
    return cache_root() / "heads" / f"public-{base.fingerprint[:16]}-k{num_heads}-c{chunk_len}-m{minutes:g}"


def ensure_public_heads(base: BaseModel, num_heads: int, chunk_len: int, minutes: float) -> Path:
    """The folder of the public heads for this base and setting, trained now if it has none (atomically:
    built aside and renamed, so a killed build or a second builder never leaves half a folder)."""
    folder = public_heads_dir(base, num_heads, chunk_len, minutes)
    if (folder / WEIGHTS_FILE).is_file() and (folder / CONFIG_FILE).is_file():
        return folder
    print(f"no public heads for this base in {folder} yet: training them once ({minutes:g} min budget)", flush=True)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    train_public_heads(base, tmp, minutes, num_heads, chunk_len)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished first: keep its heads
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
