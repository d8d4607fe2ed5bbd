"""`fedla server`: a deployment SuperLink with TLS and SuperNode authentication, and the run on it.

What it does, with Flower 1.42's own tools only:

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
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import httpx

from common.base import FedLookaheadError
from common.procs import ProcessTree, config_args, flower_bin, flower_env, set_parent_death_signal, strip_ansi

log = logging.getLogger("fedla.server")

CONNECTION = "fedla"
DEFAULT_PORT = 9092


def repo_app_dir() -> Path:
    """The Flower app folder (pyproject.toml with [tool.flwr.app]) of this checkout."""
    return Path(__file__).resolve().parents[1]


@dataclass
class TlsFiles:
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_dir(cls, folder: Path) -> TlsFiles:
        """ca.crt, server.pem, server.key as written by simulations/make_certs.py."""
        return cls(folder / "ca.crt", folder / "server.pem", folder / "server.key")

    def check(self) -> None:
        for name, path in (("CA certificate", self.ca), ("server certificate", self.cert), ("server key", self.key)):
            if not path.is_file():
                raise FedLookaheadError(f"{name} not found: {path} (make test files with simulations/make_certs.py)")


class DeploymentSuperLink:
    """`with DeploymentSuperLink(tls, state_dir=...) as link: link.register(pub); link.run(...)`."""

    def __init__(self, tls: Optional[TlsFiles], state_dir: Path, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 connection: str = CONNECTION, node_auth: bool = True, emit: Callable[[str], None] | None = None) -> None:
        if node_auth and tls is None:
            raise FedLookaheadError("SuperNode authentication requires TLS certificates")
        self.tls = tls
        self.state_dir = Path(state_dir).expanduser().resolve()
        self.host, self.port = host, port
        self.connection = connection
        self.node_auth = node_auth
        self.flwr_home = self.state_dir / "flwr-home"
        self.database = self.state_dir / "superlink.db"
        self.log_file = self.state_dir / "superlink.log"
        self.tree: ProcessTree | None = None
        self.emit = emit or (lambda line: print(line, flush=True))
        self._watch_stop = threading.Event()

    # -- addresses
    @property
    def local_address(self) -> str:
        """Where this machine reaches the SuperLink (the certificate must name 127.0.0.1)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return flower_env(self.flwr_home)

    def write_connection(self) -> Path:
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        lines = ["[superlink]", f'default = "{self.connection}"', "", f"[superlink.{self.connection}]",
                 f'address = "{self.local_address}"']
        if self.tls is not None:
            lines.append(f"root-certificates = {json.dumps(str(self.tls.ca.resolve()))}")
        else:
            lines.append("insecure = true")
        path = self.flwr_home / "config.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def command(self) -> list[str]:
        cmd = [flower_bin("flower-superlink"), "--isolation", "subprocess", "--disable-runtime-dependency-installation",
               "--host", self.host, "--port", str(self.port), "--database", str(self.database)]
        if self.tls is not None:
            cmd += ["--ssl-certfile", str(self.tls.cert.resolve()), "--ssl-keyfile", str(self.tls.key.resolve()),
                    "--ssl-ca-certfile", str(self.tls.ca.resolve())]
        else:
            cmd.append("--insecure")
        if self.node_auth:
            cmd.append("--enable-supernode-auth")
        return cmd

    # -- lifecycle
    def start(self, timeout: float = 90.0, cwd: Path | None = None) -> DeploymentSuperLink:
        if self.tls is not None:
            self.tls.check()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.write_connection()
        out = open(self.log_file, "a", encoding="utf-8")  # noqa: SIM115 - the child keeps it; closed below
        try:
            process = subprocess.Popen(self.command(), env=self.env, cwd=cwd or Path.cwd(), stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True,
                                       preexec_fn=set_parent_death_signal)
        finally:
            out.close()
        self.tree = ProcessTree(process)
        threading.Thread(target=self._watch, daemon=True).start()
        deadline = time.monotonic() + timeout
        verify = ssl.create_default_context(cafile=str(self.tls.ca)) if self.tls is not None else False
        scheme = "https" if self.tls is not None else "http"
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = self.log_tail()
                self.close()
                raise FedLookaheadError(f"flower-superlink exited with {process.returncode}: {tail}")
            try:
                if httpx.get(f"{scheme}://{self.local_address}/health", timeout=2, verify=verify).is_success:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.close()
        raise FedLookaheadError(f"flower-superlink did not answer on {self.local_address} within {timeout:.0f}s; "
                                f"see {self.log_file}")

    def _watch(self) -> None:
        """Note every descendant while the SuperLink runs (ServerApp processes can outlive their parent)."""
        while not self._watch_stop.wait(1.0):
            if self.tree is not None:
                self.tree.remember()

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = strip_ansi(self.log_file.read_text(errors="replace"))
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    def close(self) -> None:
        """Terminate the SuperLink and everything it started, by pid."""
        self._watch_stop.set()
        if self.tree is not None:
            self.tree.terminate(grace=10)
            self.tree = None

    def __enter__(self) -> DeploymentSuperLink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- flwr CLI against this SuperLink
    def flwr(self, *args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([flower_bin("flwr"), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, **kwargs)

    def register(self, public_key: Path) -> str:
        """Register one SuperNode public key (OpenSSH ECDSA); returns a one-line outcome."""
        done = self.flwr("supernode", "register", str(Path(public_key).expanduser().resolve()), self.connection,
                         "--format", "json")
        try:
            answer = json.loads(done.stdout[done.stdout.index("{"):])
        except ValueError:
            answer = {"success": False, "error-message": strip_ansi(done.stdout + done.stderr).strip()}
        if answer.get("success"):
            return f"registered {public_key} as node {answer.get('node-id')}"
        message = str(answer.get("error-message", ""))
        if "already in use" in message:
            return f"{public_key} is already registered"
        raise FedLookaheadError(f"could not register {public_key}: {message.strip().splitlines()[-1] if message else done.returncode}")

    def nodes(self) -> list[dict]:
        done = self.flwr("supernode", "list", self.connection, "--format", "json")
        try:
            return list(json.loads(done.stdout[done.stdout.index("{"):]).get("nodes", []))
        except ValueError:
            return []

    def submit(self, app_dir: Path, run_config: str = "", log_path: Path | None = None,
               timeout: float | None = None, echo: bool = True) -> tuple[int, list[str]]:
        """`flwr run APP <connection> --run-config ... --stream`; returns (exit code, output lines)."""
        cmd = [flower_bin("flwr"), "run", str(app_dir), self.connection, "--stream"]
        if run_config:
            cmd += ["--run-config", run_config]
        lines: list[str] = []
        out = open(log_path, "w", encoding="utf-8") if log_path else None  # noqa: SIM115
        process = subprocess.Popen(cmd, env=self.env, cwd=app_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1, preexec_fn=set_parent_death_signal)
        killer = threading.Timer(timeout, process.kill) if timeout else None
        if killer:
            killer.start()
        try:
            for raw in iter(process.stdout.readline, ""):
                line = strip_ansi(raw.rstrip("\n"))
                lines.append(line)
                if out:
                    out.write(line + "\n")
                    out.flush()
                if echo:
                    self.emit(line)
            return process.wait(), lines
        finally:
            if killer:
                killer.cancel()
            if process.poll() is None:
                process.kill()
                process.wait()
            if out:
                out.close()


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
    folder = Path(str(values["resume-from"])) if values.get("resume-from") else Path(values["run-dir"]) / str(values["run-id"])
    return values, folder


def serve(tls: TlsFiles, *, host: str, port: int, state_dir: Path, register: list[Path], run_config: str,
          app_dir: Path, run: bool = True, keep_running: bool = False, run_timeout: float | None = None,
          emit: Callable[[str], None] | None = None) -> int:
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
    link = DeploymentSuperLink(tls, state_dir=state_dir, host=host, port=port, emit=emit)
    with link:
        emit(f"SuperLink up on {host}:{port} (TLS, SuperNode authentication on); state {link.state_dir}; "
             f"log {link.log_file}")
        for key in keys:
            emit(link.register(key))
        emit(f"flwr connection '{link.connection}' in {link.flwr_home / 'config.toml'} "
             f"(FLWR_HOME={link.flwr_home} flwr ls {link.connection})")
        code = 0
        if run:
            code, _ = link.submit(app_dir, config_args(values), log_path=link.state_dir / "last-run.log",
                                  timeout=run_timeout)
            status = "unknown (no summary.json)"
            if (run_folder / "summary.json").is_file():
                status = json.loads((run_folder / "summary.json").read_text()).get("run", {}).get("status", "unknown")
            emit(f"run {status}: {run_folder} (flwr run exit code {code}; full log {link.state_dir / 'last-run.log'})")
            code = 0 if (code == 0 and status == "finished") else 1
        if keep_running or not run:
            emit("serving; Ctrl-C to stop")
            try:
                while link.tree is not None and link.tree.process.poll() is None:
                    time.sleep(1.0)
            except KeyboardInterrupt:
                pass
    return code
