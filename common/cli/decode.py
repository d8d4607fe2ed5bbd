"""`fedla generate` and `fedla bench-decode`: AMS-LD on a prompt, and side by side with transformers' `generate`;
and which heads they decode with."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

import torch
import typer

from common.cli.shared import BASE_HELP, BENCH_DTYPE_HELP, DTYPE_HELP, check_output_path, fail, open_base
from common.errors import FedLookaheadError
from common.model.base import BaseModel, prompt_ids

log = logging.getLogger("fedla")


def _heads_candidates() -> list[Path]:
    """Where a device's newest heads are, in order: $FEDLA_HEADS (or <cache>/heads/latest, where the daemon
    publishes them), then the daemon's default state folder, <cache>/client/heads/latest."""
    from common.paths import LATEST_HEADS, default_heads_dir, default_state_dir

    return [default_heads_dir(), default_state_dir() / LATEST_HEADS]


def _decoding_heads(heads: Optional[Path], model: BaseModel, mode: str, state_dir: Optional[Path] = None):
    """Heads for ams/fused: --heads, else <--state-dir>/heads/latest (either must load: a FedLookaheadError
    otherwise), else the first of _heads_candidates() that exists, or None (warned) when none fit.
    Says on stderr which heads it uses."""
    import warnings

    from common.decoding import load_heads
    from common.heads.lookahead import DraftHeads

    if mode not in ("ams", "fused"):
        return None
    if heads is None and state_dir is not None:
        from common.paths import LATEST_HEADS

        heads = state_dir.expanduser() / LATEST_HEADS
        if not heads.exists():
            raise FedLookaheadError(
                f"no heads in {state_dir} yet ({heads} does not exist): a round's evaluation "
                "delivers them; `fedla client status` shows the device's state"
            )
    if heads is not None:  # asked for by name: never a silent fallback to plain decoding
        loaded = DraftHeads.load(heads, model)
    else:
        found = next((path for path in _heads_candidates() if path.exists()), None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = load_heads(found, model)
        for warning in caught:
            typer.echo(f"warning: {warning.message}", err=True)
        heads = found
    if loaded is not None:
        where = Path(heads).expanduser()
        shown = f"{where} -> {where.resolve()}" if where.is_symlink() else str(where)
        typer.echo(f"heads: {shown} (v{loaded.config.version}, {loaded.num_heads} heads)", err=True)
    return loaded


def generate_cmd(
    prompt: Optional[str] = typer.Option(None, help="Prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, help="Read the prompt from this file."),
    chat: bool = typer.Option(
        False,
        "--chat",
        help="Wrap the prompt in the tokenizer's chat template (instruct models); default: raw completion.",
    ),
    base: Optional[str] = typer.Option(None, help=BASE_HELP),
    heads: Optional[Path] = typer.Option(
        None,
        help="Heads directory (default: $FEDLA_HEADS, else the cache's heads/latest, "
        "else the daemon's <cache>/client/heads/latest).",
    ),
    state_dir: Optional[Path] = typer.Option(
        None, help="A device's state folder (fedla client --state-dir): use its newest global heads."
    ),
    mode: str = typer.Option(
        "ams",
        help="ams: AMS-LD, lossless (heads and prompt lookup draft a tree, the base verifies it in one forward) | "
        "greedy: the base alone | beam: beam search (transformers' generate; not the greedy text) | fused: the "
        "seed article's fused lookahead re-ranking (changes the text).",
    ),
    max_new_tokens: int = typer.Option(128, min=1),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy; > 0 samples (lossless in ams mode)."),
    top_p: float = typer.Option(
        1.0,
        min=0.0,
        max=1.0,
        help="Nucleus sampling: keep the smallest set of tokens with this much probability (with --temperature > 0).",
    ),
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    no_guard: bool = typer.Option(False, "--no-guard", help="Switch off the repetition (degeneration) guard."),
    seed: Optional[int] = typer.Option(None, help="Seed of sampling: the same seed gives the same text."),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    compiled: bool = typer.Option(
        False,
        "--compiled",
        help="AMS-LD on a static cache, every tree verified in one torch.compile'd graph (CUDA graphs): "
        "pays on a GPU, not on a CPU; the first call compiles (a minute or more).",
    ),
) -> None:
    """Generate text with AMS-LD (or a baseline mode): prints the text as it is accepted, then tokens/s and tau
    on stderr. Ctrl-C stops it and keeps the text printed so far."""
    import threading
    import warnings

    from common.decoding import MODES, generate
    from common.decoding.streaming import StreamingStopper, TextStream

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

    def show(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    shown: TextStream | None = None
    try:
        model = open_base(base, device, dtype)
        ids = prompt_ids(model, prompt, chat)
        draft_heads = _decoding_heads(heads, model, mode, state_dir)
        shown = TextStream(model.tokenizer, (), show)  # the stop string stays in the text, as in transformers
        room = model.max_positions - len(ids)
        stopper = StreamingStopper(
            model, max_new_tokens, stop, not no_guard, room, on_tokens=shown.update, cancelled=threading.Event()
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = generate(
                model,
                ids,
                mode=mode,
                heads=draft_heads,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                compiled=compiled,
                stopper=stopper,
            )
        for warning in caught:
            if draft_heads is not None or mode not in ("ams", "fused"):
                typer.echo(f"warning: {warning.message}", err=True)
    except FedLookaheadError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        typer.echo("")
        kept = len(shown.sent) if shown is not None else 0
        typer.echo(f"interrupted: the {kept} characters above are what was generated", err=True)
        raise typer.Exit(code=130) from None
    shown.finish(result.text)
    typer.echo("")  # the text's own end, then the stats
    plain = result.stats.get("plain_steps", 0)
    typer.echo(
        f"[{result.mode}] {len(result.tokens)} tokens in {result.seconds:.2f}s: "
        f"{result.tokens_per_s:.1f} tokens/s, tau {result.tau:.2f} (stop: {result.stop_reason})"
        + (f"; {plain} of {result.stats.get('steps', 0)} steps drafted nothing (no tree paid)" if plain else ""),
        err=True,
    )


def bench_decode_cmd(
    data: Optional[Path] = typer.Option(None, help="Folder of text/code files (default: stdlib held-out split)."),
    base: Optional[str] = typer.Option(None, help=BASE_HELP),
    heads: Optional[Path] = typer.Option(
        None, help="Heads directory (default: $FEDLA_HEADS or the cache's heads/latest)."
    ),
    prompts: int = typer.Option(20, min=1, help="Number of prompts."),
    prompt_tokens: int = typer.Option(64, min=1, help="Tokens per prompt."),
    max_new_tokens: int = typer.Option(128, min=1),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the summary JSON here."),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", help=BENCH_DTYPE_HELP),
    threads: int = typer.Option(2, min=0, help="CPU threads for every mode (0: torch's default)."),
    modes: str = typer.Option(
        "hf_greedy,hf_prompt_lookup,greedy,ams,ams_heads_only",
        help="Comma-separated; ablations: ams_heads_only, ams_ngram_only, ams_fixed_tree; hf_compiled: "
        "transformers' static cache + torch.compile, and ams_compiled: AMS-LD under the same settings "
        "(CUDA graphs on CUDA; minutes of compilation first on a CPU).",
    ),
    calibrate: bool = typer.Option(
        False, "--calibrate", help="Re-measure this device's verify cost curve c(n) and show it."
    ),
) -> None:
    """Side by side, one process, interleaved per prompt: hf_greedy, hf_prompt_lookup, greedy (ours), ams (ours)."""
    from common.data.chunks import prompts_from_files, stdlib_files, text_files
    from common.decoding import cost_curve
    from common.decoding.bench import decode_benchmark, format_table, int8_quality

    if threads:
        torch.set_num_threads(threads)
    if json_out is not None:
        check_output_path(json_out, "file")
    try:
        model = open_base(base, device, dtype)
        curve = cost_curve(model, remeasure=calibrate)
        typer.echo(
            "verify cost c(n)/c(1) on this device: "
            + ", ".join(f"{n}: {c:.2f}" for n, c in curve.relative().items())
            + f" (one token: {curve.verify(1, 1) * 1000:.1f} ms)"
        )
        files = text_files(data) if data else stdlib_files("heldout")
        chosen = prompts_from_files(files, model.tokenizer, prompts, prompt_tokens)
        if not chosen:
            raise FedLookaheadError(f"no file is long enough for a {prompt_tokens}-token prompt")
        draft_heads = _decoding_heads(heads, model, "ams")
        if draft_heads is None:
            typer.echo("warning: no usable heads: the ams row is plain greedy decoding", err=True)
        quality = int8_quality(model, files) if model.int8 else None  # first: a bad sample fails in seconds
        summary = decode_benchmark(
            model, draft_heads, chosen, max_new_tokens, modes=tuple(modes.split(",")), curve=curve
        )
        if quality is not None:
            summary["int8_quality"] = quality
    except (FedLookaheadError, ValueError) as exc:
        fail(str(exc))
    summary["cost_curve"] = curve.relative()
    typer.echo(format_table(summary))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(summary, indent=2))
        typer.echo(f"wrote {json_out}")
