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
    from common.data import chunk_files, load_chunks, stdlib_files, text_files
    from common.heads import DraftHeads
    from common.training import evaluate_heads, train_heads

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


@app.command("client")
def client_cmd(
    superlink: str = typer.Option(..., help="SuperLink address HOST:PORT."),
    data: Path = typer.Option(..., help="This device's private folder of text/code files."),
    base: Optional[Path] = typer.Option(None, help="Base model directory (default: embedded default)."),
    device: str = typer.Option("auto", help="auto | cpu | cuda (training and evaluation on this device)."),
    budget_eps: Optional[float] = typer.Option(None, help="This device's privacy budget (epsilon); it declines training beyond it."),
    root_certificates: Optional[Path] = typer.Option(None, help="CA certificate that signed the SuperLink's (default: system CAs)."),
    auth_key: Optional[Path] = typer.Option(None, help="This node's ECDSA private key (OpenSSH) for node authentication."),
    state_dir: Optional[Path] = typer.Option(None, help="Private state: accountant, global heads, logs (default: <cache>/client)."),
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
) -> None:
    """Long-running device daemon: a Flower SuperNode running the FedLookahead ClientApp."""
    from client.daemon import DaemonOptions, run_daemon

    opts = DaemonOptions(superlink=superlink, data=data, base=base, device=device, budget_eps=budget_eps,
                         root_certificates=root_certificates, auth_key=auth_key, state_dir=state_dir,
                         heads_dir=heads_dir, publish_heads=not no_publish, insecure=insecure,
                         max_retries=max_retries, max_wait_time=max_wait_time, restarts=restarts,
                         refused_patience=refused_patience,
                         runtime_port=runtime_port, node_config=node_config)
    raise typer.Exit(code=run_daemon(opts))
