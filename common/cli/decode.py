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


def _datastore(folder: Optional[Path], model: BaseModel):
    """The cached index of every text file under `folder` (None: no datastore)."""
    if folder is None:
        return None
    from common.data.chunks import text_files
    from common.decoding.datastore import datastore_for
    from common.paths import datastore_cache_dir

    return datastore_for(text_files(folder), model.tokenizer, datastore_cache_dir())


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
    datastore: Optional[Path] = typer.Option(
        None,
        help="A folder of your own files for AMS-LD to draft from as well (indexed once, cached; ams mode).",
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
    store = None
    try:
        model = open_base(base, device, dtype)
        ids = prompt_ids(model, prompt, chat)
        draft_heads = _decoding_heads(heads, model, mode, state_dir)
        store = _datastore(datastore, model) if mode == "ams" else None
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
                datastore=store,
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
        + (f"; {plain} of {result.stats.get('steps', 0)} steps drafted nothing (no tree paid)" if plain else "")
        + (f"; {result.stats.get('store_steps', 0)} steps drafted from the datastore" if store is not None else ""),
        err=True,
    )


def bench_decode_cmd(
    data: Optional[Path] = typer.Option(
        None, help="Folder of text/code files to take prompts from (in place of --set)."
    ),
    benchmark: str = typer.Option(
        "third-party",
        "--set",
        help="The held-out prompt set when --data is not given: third-party (installed packages no training "
        "path reads, chosen by rule; the JSON lists them) | stdlib (the standard library's held-out split).",
    ),
    datastore: Optional[Path] = typer.Option(
        None,
        help="A folder to draft from (the device's own files): adds the modes ams_datastore and "
        "ams_datastore_only. The prompts' own files are left out of its index.",
    ),
    base: Optional[str] = typer.Option(None, help=BASE_HELP),
    heads: Optional[Path] = typer.Option(
        None, help="Heads directory (default: $FEDLA_HEADS or the cache's heads/latest)."
    ),
    prompts: int = typer.Option(20, min=1, help="Number of prompts."),
    prompt_tokens: int = typer.Option(64, min=1, help="Tokens per prompt."),
    max_new_tokens: int = typer.Option(128, min=1),
    temperature: float = typer.Option(
        0.0,
        min=0.0,
        help="0: greedy, every output checked against generate's. > 0: sampling from the full distribution, "
        "against transformers' sampling generate (seeded per prompt; outputs not compared).",
    ),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the summary JSON here."),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", help=BENCH_DTYPE_HELP),
    threads: int = typer.Option(2, min=0, help="CPU threads for every mode (0: torch's default)."),
    modes: Optional[str] = typer.Option(
        None,
        help="Comma-separated (default: hf_greedy,hf_prompt_lookup,greedy,ams,ams_heads_only; with --temperature: "
        "hf_sample,hf_prompt_lookup_sample,ams,ams_heads_only; --datastore adds its modes). Ablations: "
        "ams_heads_only, ams_ngram_only, ams_fixed_tree; hf_compiled: transformers' static cache + "
        "torch.compile, and ams_compiled: AMS-LD under the same settings (CUDA graphs on CUDA; minutes of "
        "compilation first on a CPU).",
    ),
    calibrate: bool = typer.Option(
        False, "--calibrate", help="Re-measure this device's verify cost curve c(n) and show it."
    ),
) -> None:
    """Side by side, one process, interleaved per prompt: transformers' generate (greedy and prompt lookup, or
    sampling) against AMS-LD and its ablations, on held-out code."""
    from common.data.chunks import prompt_sources, text_files
    from common.data.packages import benchmark_set
    from common.decoding import cost_curve
    from common.decoding.bench import DATASTORE_MODES, SAMPLING_MODES, Setting, decode_benchmark, format_table
    from common.decoding.datastore import datastore_for
    from common.decoding.fidelity import int8_quality
    from common.paths import datastore_cache_dir

    if threads:
        torch.set_num_threads(threads)
    if json_out is not None:
        check_output_path(json_out, "file")
    if modes is None:
        chosen_modes = (
            SAMPLING_MODES if temperature > 0 else ("hf_greedy", "hf_prompt_lookup", "greedy", "ams", "ams_heads_only")
        )
        chosen_modes += DATASTORE_MODES if datastore is not None else ()
    else:
        chosen_modes = tuple(mode.strip() for mode in modes.split(",") if mode.strip())
    try:
        model = open_base(base, device, dtype)
        curve = cost_curve(model, remeasure=calibrate)
        typer.echo(
            "verify cost c(n)/c(1) on this device: "
            + ", ".join(f"{n}: {c:.2f}" for n, c in curve.relative().items())
            + f" (one token: {curve.verify(1, 1) * 1000:.1f} ms)"
        )
        if data is not None:
            files, described = text_files(data), {"name": f"files under {data}", "folder": str(data)}
        else:
            files, described = benchmark_set(benchmark)
        sources = prompt_sources(files, model.tokenizer, prompts, prompt_tokens)
        if not sources:
            raise FedLookaheadError(f"no file is long enough for a {prompt_tokens}-token prompt")
        described["prompt_files"] = sorted({str(path) for path, _ in sources})
        store = None
        if datastore is not None:
            prompt_files = {path.resolve() for path, _ in sources}
            indexed = [path for path in text_files(datastore) if path.resolve() not in prompt_files]
            store = datastore_for(indexed, model.tokenizer, datastore_cache_dir())
        draft_heads = _decoding_heads(heads, model, "ams")
        if draft_heads is None:
            typer.echo("warning: no usable heads: the ams row is plain greedy decoding", err=True)
        quality = int8_quality(model, files) if model.int8 else None  # first: a bad sample fails in seconds
        setting = Setting(model, draft_heads, curve=curve, datastore=store, temperature=temperature)
        summary = decode_benchmark(setting, [prompt for _, prompt in sources], max_new_tokens, modes=chosen_modes)
        summary["benchmark_set"] = described
        if store is not None:
            summary["datastore"] = {"folder": str(datastore), "files": store.files, "stream_length": len(store)}
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
