"""The server side's commands, plugged into `fedla` (entry point `fedlookahead.cli`): the deployment
SuperLink (`fedla server`) and the read-only dashboard."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from common.cli.shared import exit_cleanly_on_sigterm, fail
from common.errors import FedLookaheadError

# Registered on the root `fedla` app as top-level commands (not a sub-group): their names stay as they were.
app = typer.Typer(pretty_exceptions_show_locals=False)


@app.command("dashboard")
def dashboard_cmd(
    db: Optional[str] = typer.Option(
        None, help="Run store: SQLAlchemy URL or SQLite path (default: $FEDLA_DB or runs/fedla.db)."
    ),
    host: str = typer.Option("127.0.0.1", help="Bind address; anything but loopback requires a token."),
    port: int = typer.Option(8080, min=1, max=65535),
    token: Optional[str] = typer.Option(
        None, envvar="FEDLA_DASHBOARD_TOKEN", help="Require this token on every request."
    ),
    run_dir: Optional[Path] = typer.Option(
        None,
        help="Folder holding the runs' <run-id>/ folders, when the store "
        "is kept elsewhere (default: the store's own folder).",
    ),
) -> None:
    """Read-only web dashboard of federated runs: live plots, SecAgg+ settings, checkpoint download."""
    from server.dashboard.serve import serve

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


@app.command("server")
def server_cmd(
    certs: Optional[Path] = typer.Option(
        None, help="Folder with ca.crt, server.pem, server.key (simulations/make_certs.py)."
    ),
    ssl_ca_certfile: Optional[Path] = typer.Option(None, help="CA certificate (instead of --certs)."),
    ssl_certfile: Optional[Path] = typer.Option(None, help="SuperLink TLS certificate (instead of --certs)."),
    ssl_keyfile: Optional[Path] = typer.Option(None, help="SuperLink TLS private key (instead of --certs)."),
    host: str = typer.Option("127.0.0.1", help="Bind address; 0.0.0.0 to serve devices on the network."),
    port: int = typer.Option(
        9092, min=1, max=65535, help="The one HTTPS port for Fleet, Control and ServerAppIo APIs."
    ),
    register: list[Path] = typer.Option(
        [], help="SuperNode public key (.pub) or folder of them to authorise (repeatable)."
    ),
    run_config: str = typer.Option(
        "", help="Run config overrides, `k=v ...` (keys of the app config in pyproject.toml)."
    ),
    state_dir: Optional[Path] = typer.Option(
        None, help="SuperLink database, FLWR_HOME, logs (default: <cache>/server)."
    ),
    app_dir: Optional[Path] = typer.Option(None, "--app", help="Flower app folder (default: this checkout)."),
    run: bool = typer.Option(True, "--run/--no-run", help="Submit the FedLookahead run (or only serve)."),
    keep_running: bool = typer.Option(False, help="Keep serving after the run ends (Ctrl-C stops)."),
    run_timeout: Optional[float] = typer.Option(None, help="Stop waiting for the run after this many seconds."),
) -> None:
    """Deployment SuperLink with TLS + SuperNode authentication, then the FedLookahead run on it."""
    from common.paths import cache_root
    from server.deploy import repo_app_dir, serve
    from server.superlink import TlsFiles

    if certs is not None:
        tls = TlsFiles.from_dir(certs)
    elif ssl_ca_certfile and ssl_certfile and ssl_keyfile:
        tls = TlsFiles(ssl_ca_certfile, ssl_certfile, ssl_keyfile)
    else:
        fail("TLS is required: give --certs DIR or all of --ssl-ca-certfile, --ssl-certfile, --ssl-keyfile")
    exit_cleanly_on_sigterm()
    try:
        code = serve(
            tls,
            host=host,
            port=port,
            state_dir=state_dir or cache_root() / "server",
            register=register,
            run_config=run_config,
            app_dir=(app_dir or repo_app_dir()).resolve(),
            run=run,
            keep_running=keep_running,
            run_timeout=run_timeout,
        )
    except FedLookaheadError as exc:
        fail(str(exc))
    raise typer.Exit(code=code)


def register(root: typer.Typer) -> None:
    """Add the server's commands to the `fedla` app."""
    root.registered_commands.extend(app.registered_commands)
