"""`fedla server`: a deployment SuperLink with TLS and SuperNode authentication, and the run on it.

What it does, with Flower 1.42's own tools only (the SuperLink's launcher is server/superlink.py):

1. starts `flower-superlink --ssl-certfile --ssl-keyfile --ssl-ca-certfile --enable-supernode-auth
   --isolation subprocess --disable-runtime-dependency-installation --host H --port P --database DB`
   (one HTTPS port serves the Fleet, Control and ServerAppIo APIs; the database keeps registered
   nodes across restarts);
2. writes a `$FLWR_HOME/config.toml` connection (`address`, `root-certificates`) for the `flwr` CLI;
3. registers every given SuperNode public key with `flwr supernode register KEY <connection>`
   (a key that is already registered is fine);
4. submits the FedLookahead app with `flwr run APP <connection> --run-config ... --stream`; the
   ServerApp (server.server_app) writes runs/<run-id>/ and the run store as in simulation;
5. stops the SuperLink and every process it started (by pid) unless asked to keep serving.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

from common.errors import FedLookaheadError
from server.run.folder import RunFolder
from server.superlink import SuperLink, TlsFiles


def repo_app_dir() -> Path:
    """The Flower app folder (pyproject.toml with [tool.flwr.app]) of this checkout."""
    return Path(__file__).resolve().parents[1]


def parse_run_config(text: str) -> dict:
    from flwr.common.config import parse_config_args

    try:
        return parse_config_args([text]) if text else {}
    except Exception as exc:  # noqa: BLE001 - click/tomli errors
        raise FedLookaheadError(f"--run-config {text!r} is not `k=v ...` with TOML values: {exc}") from exc


def resolve_run_config(text: str, cwd: Path) -> tuple[dict, Path]:
    """The run config with an absolute run-dir and a known run-id, and the run's folder.

    The ServerApp runs in a process of the SuperLink's, so a relative run-dir is made absolute here
    (relative to where `fedla server` runs); without a run-id the folder name is chosen here, so the
    command can report where the run store and checkpoints went.
    """
    from datetime import datetime, timezone

    values = parse_run_config(text)
    run_dir = Path(str(values.get("run-dir", "runs"))).expanduser()
    values["run-dir"] = str(run_dir if run_dir.is_absolute() else (cwd / run_dir).resolve())
    if not values.get("run-id") and not values.get("resume-from"):
        values["run-id"] = f"deploy-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    folder = (
        Path(str(values["resume-from"]))
        if values.get("resume-from")
        else Path(values["run-dir"]) / str(values["run-id"])
    )
    return values, folder


def serve(
    tls: TlsFiles,
    *,
    host: str,
    port: int,
    state_dir: Path,
    register: list[Path],
    run_config: str,
    app_dir: Path,
    run: bool = True,
    keep_running: bool = False,
    run_timeout: float | None = None,
    emit: Callable[[str], None] | None = None,
) -> int:
    """`fedla server`: returns 0 when the run finished (or, with run=False, when stopped)."""
    emit = emit or (lambda line: print(line, flush=True))
    keys: list[Path] = []
    for item in register:
        item = Path(item).expanduser()
        if item.is_dir():
            keys += sorted(item.glob("*.pub"))
        elif item.is_file():
            keys.append(item)
        else:
            raise FedLookaheadError(f"--register: no such key file or folder: {item}")
    if not (app_dir / "pyproject.toml").is_file():
        raise FedLookaheadError(f"--app {app_dir} has no pyproject.toml (the FedLookahead Flower app folder)")
    values, run_folder = resolve_run_config(run_config, Path.cwd())  # a malformed one fails before anything starts
    logging.getLogger("httpx").setLevel(logging.WARNING)
    state_dir = Path(state_dir).expanduser().resolve()
    link = SuperLink.for_deployment(tls, state_dir, host=host, port=port, emit=emit)
    with link:
        emit(
            f"SuperLink up on {host}:{port} (TLS, SuperNode authentication on); state {state_dir}; log {link.log_file}"
        )
        for key in keys:
            emit(link.register(key))
        emit(
            f"flwr connection '{link.connection}' in {link.flwr_home / 'config.toml'} "
            f"(FLWR_HOME={link.flwr_home} flwr ls {link.connection})"
        )
        code = 0
        if run:
            code, _ = link.submit(app_dir, values, log_path=state_dir / "last-run.log", timeout=run_timeout)
            status = "unknown (no summary.json)"
            summary = RunFolder(run_folder).summary
            if summary.is_file():
                status = json.loads(summary.read_text()).get("run", {}).get("status", "unknown")
            emit(f"run {status}: {run_folder} (flwr run exit code {code}; full log {state_dir / 'last-run.log'})")
            code = 0 if (code == 0 and status == "finished") else 1
        if keep_running or not run:
            emit("serving; Ctrl-C to stop")
            try:
                while link.running():
                    time.sleep(1.0)
            except KeyboardInterrupt:
                pass
    return code
