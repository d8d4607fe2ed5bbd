"""`fedla`: the one command-line entry point.

Commands that belong to the server or the client side import them lazily, inside the command, so
`common` never depends on `client` or `server` at import time.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

import torch
import typer

from common.base import BaseModel, FedLookaheadError, load_base

app = typer.Typer(help="FedLookahead: federated lookahead heads for fast lossless decoding.", no_args_is_help=True)
log = logging.getLogger("fedla")


def fail(message: str) -> None:
    """Print a one-line error and exit non-zero."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def open_base(base: Optional[Path], device: str = "auto") -> BaseModel:
    """The given base model directory, or the embedded default (built on first use)."""
    from common.default_model import ensure_default_base

    return load_base(base or ensure_default_base(), device=device)


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")


@app.command()
def bootstrap(
    out: Optional[Path] = typer.Option(None, help="Where to save it (default: the cache, see $FEDLA_HOME)."),
    force: bool = typer.Option(False, help="Rebuild even if it exists."),
) -> None:
    """Build the embedded default base model (tokenizer + small Llama pretrained on the stdlib)."""
    from common.default_model import build_default_base, default_base_dir

    target = out or default_base_dir()
    if (target / "config.json").is_file() and not force:
        typer.echo(f"default base already built: {target}")
    else:
        build_default_base(target)
    typer.echo((target / "fedla_build.json").read_text() if (target / "fedla_build.json").is_file() else str(target))


@app.command("train-heads")
def train_heads_cmd(
    out: Path = typer.Option(..., help="Directory to save the trained heads."),
    data: Optional[Path] = typer.Option(None, help="Folder of text/code files (default: stdlib train split)."),
    base: Optional[Path] = typer.Option(None, help="Base model directory (default: embedded default)."),
    epochs: int = typer.Option(1, min=1),
    num_heads: int = typer.Option(4, min=1, help="K lookahead heads."),
    chunk_len: int = typer.Option(128, min=8, help="Tokens per training chunk."),
    batch_size: int = typer.Option(16, min=1),
    lr: float = typer.Option(1e-3),
    max_chunks: int = typer.Option(0, min=0, help="Use at most this many chunks (0: all)."),
    eval_data: Optional[Path] = typer.Option(None, help="Held-out folder (default: stdlib held-out split)."),
    device: str = typer.Option("auto"),
) -> None:
    """Centralised head training with a progress bar; prints per-head top-1 accuracy on held-out code."""
    from common.data import chunk_files, load_chunks, stdlib_files
    from common.heads import DraftHeads
    from common.training import evaluate_heads, train_heads

    try:
        model = open_base(base, device)
        tokenizer = model.tokenizer
        chunks = load_chunks(data, tokenizer, chunk_len) if data else chunk_files(stdlib_files("train"), tokenizer, chunk_len)
        heldout = load_chunks(eval_data, tokenizer, chunk_len) if eval_data else chunk_files(stdlib_files("heldout"), tokenizer, chunk_len)
    except FedLookaheadError as exc:
        fail(str(exc))
    if max_chunks:
        chunks = chunks[torch.randperm(len(chunks), generator=torch.Generator().manual_seed(0))[:max_chunks]]
    heads = DraftHeads.fresh(model, num_heads)
    started = time.perf_counter()
    history = train_heads(heads, model, chunks, epochs=epochs, lr=lr, batch_size=batch_size)
    seconds = time.perf_counter() - started
    heads.save(out)
    report = {
        "train_chunks": len(chunks),
        "chunk_len": chunk_len,
        "train_seconds": round(seconds, 1),
        "train_tokens_per_s": round(len(chunks) * chunk_len * epochs / seconds, 1),
        "trainable_parameters": heads.num_trainable(),
        "train": history[-1],
        "heldout": evaluate_heads(heads, model, heldout[:256]),
        "heads": str(out),
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    typer.echo(json.dumps(report, indent=2))


def _decoding_heads(heads: Optional[Path], model: BaseModel, mode: str):
    """Heads for ams/fused: --heads, else the newest heads in default_heads_dir(); None (warned) if none fit."""
    import warnings

    from common.decoding import load_heads

    if mode not in ("ams", "fused"):
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_heads(heads, model)
    for warning in caught:
        typer.echo(f"warning: {warning.message}", err=True)
    return loaded


@app.command("generate")
def generate_cmd(
    prompt: Optional[str] = typer.Option(None, help="Prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, help="Read the prompt from this file."),
    base: Optional[Path] = typer.Option(None, help="Base model directory (default: embedded default)."),
    heads: Optional[Path] = typer.Option(None, help="Heads directory (default: $FEDLA_HEADS or the cache's heads/latest)."),
    mode: str = typer.Option("ams", help="ams | greedy | beam | fused"),
    max_new_tokens: int = typer.Option(128, min=1),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy; > 0 samples (lossless in ams mode)."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0),
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    no_guard: bool = typer.Option(False, "--no-guard", help="Switch off the repetition (degeneration) guard."),
    seed: Optional[int] = typer.Option(None),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
) -> None:
    """Generate text with AMS-LD (or a baseline mode); prints the text, then tokens/s and tau."""
    import warnings

    from common.decoding import MODES, generate

    if mode not in MODES:
        fail(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    if (prompt is None) == (prompt_file is None):
        fail("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None:
        if not prompt_file.is_file():
            fail(f"prompt file not found: {prompt_file}")
        prompt = prompt_file.read_text(errors="replace")
    if not prompt:
        fail("empty prompt")
    try:
        model = open_base(base, device)
        ids = torch.tensor(model.tokenizer(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long)
        draft_heads = _decoding_heads(heads, model, mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = generate(model, ids, mode=mode, heads=draft_heads, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_p=top_p, stop_strings=stop,
                              degeneration_guard=not no_guard, seed=seed)
        for warning in caught:
            if draft_heads is not None or mode not in ("ams", "fused"):
                typer.echo(f"warning: {warning.message}", err=True)
    except FedLookaheadError as exc:
        fail(str(exc))
    typer.echo(result.text)
    typer.echo(
        f"[{result.mode}] {len(result.tokens)} tokens in {result.seconds:.2f}s: "
        f"{result.tokens_per_s:.1f} tokens/s, tau {result.tau:.2f} (stop: {result.stop_reason})"
    )


@app.command("bench-decode")
def bench_decode_cmd(
    data: Optional[Path] = typer.Option(None, help="Folder of text/code files (default: stdlib held-out split)."),
    base: Optional[Path] = typer.Option(None, help="Base model directory (default: embedded default)."),
    heads: Optional[Path] = typer.Option(None, help="Heads directory (default: $FEDLA_HEADS or the cache's heads/latest)."),
    prompts: int = typer.Option(20, min=1, help="Number of prompts."),
    prompt_tokens: int = typer.Option(64, min=1, help="Tokens per prompt."),
    max_new_tokens: int = typer.Option(128, min=1),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the summary JSON here."),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    threads: int = typer.Option(1, min=0, help="CPU threads for every mode (0: torch's default). "
                                "One is fastest for small models and stable on a shared machine."),
    modes: str = typer.Option("hf_greedy,hf_prompt_lookup,greedy,ams",
                              help="Comma-separated; ablations: ams_heads_only, ams_ngram_only."),
) -> None:
    """Side by side, one process, interleaved per prompt: hf_greedy, hf_prompt_lookup, greedy (ours), ams (ours)."""
    from common.bench import decode_benchmark, format_table
    from common.data import prompts_from_files, stdlib_files, text_files

    if threads:
        torch.set_num_threads(threads)
    try:
        model = open_base(base, device)
        files = text_files(data) if data else stdlib_files("heldout")
        chosen = prompts_from_files(files, model.tokenizer, prompts, prompt_tokens)
        if not chosen:
            raise FedLookaheadError(f"no file is long enough for a {prompt_tokens}-token prompt")
        draft_heads = _decoding_heads(heads, model, "ams")
        if draft_heads is None:
            typer.echo("warning: no usable heads: the ams row is plain greedy decoding", err=True)
        summary = decode_benchmark(model, draft_heads, chosen, max_new_tokens, modes=tuple(modes.split(",")))
    except (FedLookaheadError, ValueError) as exc:
        fail(str(exc))
    typer.echo(format_table(summary))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(summary, indent=2))
        typer.echo(f"wrote {json_out}")


@app.command("dashboard")
def dashboard_cmd(
    db: Optional[str] = typer.Option(None, help="Run store: SQLAlchemy URL or SQLite path (default: $FEDLA_DB or runs/fedla.db)."),
    host: str = typer.Option("127.0.0.1", help="Bind address; anything but loopback requires a token."),
    port: int = typer.Option(8080, min=1, max=65535),
    token: Optional[str] = typer.Option(None, envvar="FEDLA_DASHBOARD_TOKEN", help="Require this token on every request."),
) -> None:
    """Read-only web dashboard of federated runs: live plots, SecAgg+ settings, checkpoint download."""
    from server.dashboard import serve

    try:
        serve(db, host=host, port=port, token=token)
    except ValueError as exc:
        fail(str(exc))


@app.command("dashboard-screenshot")
def dashboard_screenshot_cmd(
    run_id: str = typer.Option(..., help="Run to render."),
    out: Path = typer.Option(Path("docs/dashboard.png"), help="PNG to write."),
    db: Optional[str] = typer.Option(None, help="Run store URL or SQLite path (default: $FEDLA_DB or runs/fedla.db)."),
    width: int = typer.Option(1400, min=640),
) -> None:
    """Screenshot a run's dashboard page with headless Chromium (for the README)."""
    from server.dashboard.screenshot import screenshot_run

    try:
        typer.echo(screenshot_run(db, run_id, out, width=width))
    except (ValueError, RuntimeError) as exc:
        fail(str(exc))

