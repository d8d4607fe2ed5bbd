"""The device's commands, plugged into `fedla` as `fedla client ...` (entry point `fedlookahead.cli`):
the daemon, the local generation endpoint and the privacy ledger's reset."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from client.endpoint.defaults import DEFAULT_MAX_QUEUE, DEFAULT_PORT
from common.cli.shared import BASE_HELP, DTYPE_HELP, base_loading, fail
from common.errors import FedLookaheadError

app = typer.Typer(
    help="The device daemon (fedla client --superlink ... --data ...) and its privacy ledger.",
    pretty_exceptions_show_locals=False,
)


@app.callback(invoke_without_command=True)
def client_cmd(
    ctx: typer.Context,
    superlink: Optional[str] = typer.Option(None, help="SuperLink address HOST:PORT."),
    data: Optional[Path] = typer.Option(None, help="This device's private folder of text/code files."),
    base: Optional[str] = typer.Option(None, help=BASE_HELP + " Built or converted before joining."),
    device: str = typer.Option("auto", help="auto | cpu | cuda (training and evaluation on this device)."),
    budget_eps: Optional[float] = typer.Option(
        None,
        help="Lifetime privacy budget (epsilon) of this device over all "
        "runs (default 8); it declines training beyond it.",
    ),
    max_delta: Optional[float] = typer.Option(None, help="Largest DP delta this device accepts (default 1e-5)."),
    max_grad_norm: Optional[float] = typer.Option(None, help="Largest clipping norm it accepts (default 1.0)."),
    min_noise_multiplier: Optional[float] = typer.Option(
        None, help="Smallest noise multiplier it trains with (default 0.5)."
    ),
    min_chunk_len: Optional[int] = typer.Option(
        None, help="Fewest tokens per privacy unit (chunk) it trains on, whatever the run asks (default 32)."
    ),
    root_certificates: Optional[Path] = typer.Option(
        None, help="CA certificate that signed the SuperLink's (default: system CAs)."
    ),
    auth_key: Optional[Path] = typer.Option(
        None, help="This node's ECDSA private key (OpenSSH) for node authentication."
    ),
    state_dir: Optional[Path] = typer.Option(
        None,
        help="All of this device's data: privacy ledger, global heads, tokenised "
        "files, features, logs (default: <cache>/client).",
    ),
    heads_dir: Optional[Path] = typer.Option(
        None, help="Also publish the newest global heads here (default: $FEDLA_HEADS or <cache>/heads/latest)."
    ),
    no_publish: bool = typer.Option(False, "--no-publish", help="Keep heads only in the state folder."),
    insecure: bool = typer.Option(False, "--insecure", help="No TLS (tests only; incompatible with --auth-key)."),
    max_retries: int = typer.Option(10, min=0, help="flower-supernode's reconnection tries per start."),
    max_wait_time: float = typer.Option(
        60.0, min=0.0, help="flower-supernode's reconnection time limit per start (s)."
    ),
    restarts: int = typer.Option(5, min=0, help="Failed starts in a row before giving up (0: never give up)."),
    refused_patience: float = typer.Option(
        75.0,
        min=0.0,
        help="Seconds of refused activation before giving up "
        "(a node still marked online after a crash is refused for up to 60 s).",
    ),
    runtime_port: int = typer.Option(
        0, min=0, max=65535, help="Local port of the SuperNode's runtime API (0: a free one)."
    ),
    node_config: str = typer.Option("", help="Extra node config `k=v ...` (client-side run-config keys)."),
    serve_port: int = typer.Option(
        0,
        min=0,
        max=65535,
        help="Also serve the local OpenAI-compatible generation "
        "endpoint on 127.0.0.1:PORT, with the newest global heads (0: off).",
    ),
    no_prepare: bool = typer.Option(
        False,
        "--no-prepare",
        help="Join at once: tokenise the files (and compute features) in the first round instead of before joining.",
    ),
) -> None:
    """Long-running device daemon: a Flower SuperNode running the FedLookahead ClientApp."""
    if ctx.invoked_subcommand is not None:
        return
    if superlink is None or data is None:
        fail("fedla client needs --superlink and --data (or a subcommand: status, forget, serve, reset-ledger)")
    from client.daemon import DaemonOptions, run_daemon

    opts = DaemonOptions(
        superlink=superlink,
        data=data,
        base=base,
        device=device,
        budget_eps=budget_eps,
        max_delta=max_delta,
        max_grad_norm=max_grad_norm,
        min_noise_multiplier=min_noise_multiplier,
        min_chunk_len=min_chunk_len,
        root_certificates=root_certificates,
        auth_key=auth_key,
        state_dir=state_dir,
        heads_dir=heads_dir,
        publish_heads=not no_publish,
        insecure=insecure,
        max_retries=max_retries,
        max_wait_time=max_wait_time,
        restarts=restarts,
        refused_patience=refused_patience,
        runtime_port=runtime_port,
        node_config=node_config,
        serve_port=serve_port,
        prepare=not no_prepare,
    )
    raise typer.Exit(code=run_daemon(opts))


@app.command("serve")
def client_serve_cmd(
    base: Optional[str] = typer.Option(None, help=BASE_HELP),
    heads: Optional[Path] = typer.Option(None, help="Heads folder to watch (default: <state-dir>/heads/latest)."),
    state_dir: Optional[Path] = typer.Option(None, help="The device's state folder (default: <cache>/client)."),
    host: str = typer.Option("127.0.0.1", help="Loopback only: the endpoint is for apps on this device."),
    port: int = typer.Option(DEFAULT_PORT, min=1, max=65535),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    max_queue: int = typer.Option(
        DEFAULT_MAX_QUEUE, min=1, help="Requests waiting or running beyond this are answered 503."
    ),
    datastore: Optional[Path] = typer.Option(
        None,
        help="Your own files for AMS-LD to draft from as well, indexed once into <state-dir>/datastore "
        "(default: the data folder `fedla client` was last given on this state folder, if any).",
    ),
) -> None:
    """The OpenAI-compatible local endpoint alone (/v1/completions, /v1/chat/completions, streaming), AMS-LD
    with the newest global heads, swapped between requests when a round delivers new ones."""
    from client.endpoint.server import serve_endpoint, start_endpoint
    from client.node_config import DATA_DIR_KEY
    from client.state import StateDir, read_node_config
    from common.model.default import resolve_base
    from common.paths import default_state_dir

    state = StateDir((state_dir or default_state_dir()).expanduser())
    own_files = datastore or (Path(folder) if (folder := read_node_config(state.root).get(DATA_DIR_KEY)) else None)
    try:
        server = start_endpoint(
            resolve_base(base),
            heads or state.latest_heads,
            host=host,
            port=port,
            max_queue=max_queue,
            loading=base_loading(device, dtype),
            datastore_dir=own_files,
            datastore_cache=state.datastore,
        )
    except FedLookaheadError as exc:
        fail(str(exc))
    serve_endpoint(server)


@app.command("reset-ledger")
def reset_ledger_cmd(
    state_dir: Optional[Path] = typer.Option(None, help="The device's state folder (default: <cache>/client)."),
    yes: bool = typer.Option(False, "--yes", help="Really forget past privacy spending (the real privacy loss stays)."),
) -> None:
    """Start this device's privacy ledger over, on purpose: forgets past spending, not the privacy already lost."""
    from client.daemon import reset_ledger_command

    raise typer.Exit(code=reset_ledger_command(state_dir, yes))


@app.command("status")
def status_cmd(
    state_dir: Optional[Path] = typer.Option(None, help="The device's state folder (default: <cache>/client)."),
    json_out: bool = typer.Option(False, "--json", help="Print it as JSON."),
) -> None:
    """What this device has spent and kept, read from its state folder only: lifetime epsilon and budget,
    runs joined, last round, heads version, where everything is stored, and how to generate with the heads.
    Exit 1 when the privacy ledger cannot be trusted (the device does not train until it is reset)."""
    import json

    from client.status import device_status, format_status
    from common.paths import default_state_dir

    try:
        status = device_status(state_dir or default_state_dir())
    except FedLookaheadError as exc:
        fail(str(exc))
    typer.echo(json.dumps(status, indent=1, default=str) if json_out else format_status(status))
    raise typer.Exit(code=0 if status["privacy"]["trusted"] else 1)


@app.command("forget")
def forget_cmd(
    state_dir: Optional[Path] = typer.Option(None, help="The device's state folder (default: <cache>/client)."),
    yes: bool = typer.Option(False, "--yes", help="Really delete the tokenised files and their features."),
) -> None:
    """Delete this device's private text caches (<state>/chunks, <state>/features); the privacy ledger
    and the global heads stay. Stop `fedla client` first."""
    from client.status import forget
    from common.paths import default_state_dir

    try:
        typer.echo(forget(state_dir or default_state_dir(), yes=yes))
    except FedLookaheadError as exc:
        fail(str(exc))


def register(root: typer.Typer) -> None:
    """Add `fedla client ...` to the `fedla` app."""
    root.add_typer(app, name="client")
