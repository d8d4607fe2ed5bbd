"""`fedla train-heads`: heads from public code, the recipe every run starts from."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import torch
import typer

from common.cli.shared import BASE_HELP, check_output_path, fail, open_base
from common.errors import FedLookaheadError
from common.training.loop import DEFAULT_DRAFT_VOCAB

log = logging.getLogger("fedla")


def train_heads_cmd(
    out: Path = typer.Option(..., help="Directory to save the trained heads."),
    data: Optional[Path] = typer.Option(None, help="Folder of text/code files (in place of --public)."),
    public: str = typer.Option(
        "stdlib+packages",
        help="The public data when --data is not given: stdlib+packages (half the stdlib's train split, half "
        "the installed packages that no benchmark holds out and no simulation treats as private) | stdlib.",
    ),
    base: Optional[str] = typer.Option(None, help=BASE_HELP),
    epochs: int = typer.Option(4, min=1, help="Passes over the data (training stops at --max-minutes in any case)."),
    num_heads: int = typer.Option(4, min=1, max=16, help="K lookahead heads."),
    arch: str = typer.Option(
        "recurrent",
        help="recurrent (each step fuses the token drafted before) | parallel (Medusa) | "
        "eagle (fusion + one decoder layer shaped like the base's, drafting on its own features).",
    ),
    draft_vocab: int = typer.Option(
        DEFAULT_DRAFT_VOCAB, min=0, help="Heads score only this many most frequent greedy tokens (0: all)."
    ),
    chunk_len: int = typer.Option(128, min=8, help="Tokens per training chunk."),
    batch_size: int = typer.Option(16, min=1),
    lr: float = typer.Option(2e-3),
    max_chunks: int = typer.Option(2000, min=0, help="Use at most this many chunks (0: all)."),
    max_minutes: float = typer.Option(
        8.0,
        min=0.0,
        help="Stop training after this long (features excluded; with the defaults the whole command takes "
        "at most 15 minutes on a 2-core CPU); 0: no limit.",
    ),
    distill_chunks: int = typer.Option(
        0,
        min=0,
        help="Add this many self-distilled chunks: half a public chunk, then "
        "the base's own greedy continuation (what the heads see while decoding).",
    ),
    eval_data: Optional[Path] = typer.Option(
        None, help="Held-out folder (default: the stdlib's held-out split, and the third-party held-out packages)."
    ),
    eval_chunks: int = typer.Option(256, min=1, help="Held-out chunks to evaluate on (per held-out set)."),
    device: str = typer.Option("auto"),
) -> None:
    """Centralised head training on cached base features; prints per-head top-1 accuracy on held-out code.
    On a GPU (--device auto finds one) the feature pass, the CPU's bottleneck, runs there."""
    from common.data.chunks import chunk_files, drawn_chunks, load_chunks, stdlib_files, text_files
    from common.data.packages import PACKAGE_FILES_PER_BATCH, benchmark_set, public_chunks
    from common.heads.lookahead import ARCHITECTURES
    from common.training.loop import fit_heads

    if arch not in ARCHITECTURES:
        fail(f"unknown --arch {arch!r}: use one of {', '.join(ARCHITECTURES)}")
    check_output_path(out, "dir")
    try:
        for folder in (data, eval_data):
            if folder is not None:
                text_files(folder)  # fail on a bad folder before loading any model
        model = open_base(base, device)
        tokenizer = model.tokenizer
        generator = torch.Generator().manual_seed(0)
        if data:
            chunks = load_chunks(data, tokenizer, chunk_len)
            chunks = chunks[torch.randperm(len(chunks), generator=generator)[: max_chunks or len(chunks)]]
        else:
            chunks = public_chunks(public, tokenizer, chunk_len, max_chunks, generator)
        heldout = (
            load_chunks(eval_data, tokenizer, chunk_len)
            if eval_data
            else chunk_files(stdlib_files("heldout"), tokenizer, chunk_len)
        )
        heldout = heldout[torch.randperm(len(heldout), generator=generator)[:eval_chunks]]
        other_heldout = {}
        if not eval_data:  # the honest test of transfer: third-party code no training path reads
            third_party = benchmark_set("third-party")[0]
            other_heldout["third_party"] = drawn_chunks(
                third_party, tokenizer, chunk_len, eval_chunks, generator, PACKAGE_FILES_PER_BATCH
            )
    except FedLookaheadError as exc:
        fail(str(exc))
    heads, report = fit_heads(
        model,
        chunks,
        heldout,
        num_heads,
        arch,
        draft_vocab,
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        max_seconds=max_minutes * 60 or float("inf"),
        distill_chunks=distill_chunks,
        other_heldout=other_heldout,
    )
    report["public"] = str(data) if data else public
    heads.save(out)
    report["heads"] = str(out)
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    typer.echo(json.dumps(report, indent=2))
