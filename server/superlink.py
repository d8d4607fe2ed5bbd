"""The one launcher of Flower's SuperLink, for deployment (`fedla server`) and for simulations and tests.

Either way it starts `flower-superlink` itself with its own FLWR_HOME, whose `config.toml` names a
connection pointing at it (Flower 1.42 reads connections only from there, and its default `:local:`
connection would start a detached SuperLink on fixed ports that outlives the run and that two users of
one machine would share). It waits for `/health`, submits the app with `flwr run APP <connection>
--stream`, and on close terminates exactly the processes it started, by pid (the SuperLink, SuperExec,
ServerApp processes, the simulation and Ray), never processes found by name.

- `SuperLink.for_deployment(tls, state_dir, host, port)`: TLS, SuperNode authentication, a database
  that keeps registered nodes across restarts, one port for the Fleet, Control and ServerAppIo APIs.
- `SuperLink.for_simulation()`: `--simulation`, in-memory state, free loopback ports, a temporary
  FLWR_HOME removed on close.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from common.errors import FedLookaheadError
from common.procs import (
    ProcessTree,
    config_args,
    flower_bin,
    flower_env,
    free_port,
    set_parent_death_signal,
    strip_ansi,
)

CONNECTION = "fedla"  # the deployment's connection name in FLWR_HOME/config.toml
DEFAULT_PORT = 9092


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


class SuperLink:
    """`with SuperLink.for_simulation() as link: link.submit(app, run_config, federation_config)`."""

    def __init__(
        self,
        flwr_home: Path,
        log_file: Path,
        *,
        database: str,
        tls: TlsFiles | None = None,
        node_auth: bool = False,
        simulation: bool = False,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        control_port: int | None = None,
        connection: str = CONNECTION,
        remove_home: bool = False,
        cwd: Path | None = None,
        emit: Callable[[str], None] | None = None,
    ) -> None:
        if node_auth and tls is None:
            raise FedLookaheadError("SuperNode authentication requires TLS certificates")
        self.flwr_home, self.log_file, self.database = Path(flwr_home), Path(log_file), database
        self.tls, self.node_auth, self.simulation = tls, node_auth, simulation
        self.host, self.port, self.control_port = host, port, control_port
        self.connection = connection
        self.remove_home = remove_home
        self.cwd = cwd  # None: the caller's working directory at start
        self.emit = emit or (lambda line: print(line, flush=True))
        self.tree: ProcessTree | None = None
        self._watch_stop = threading.Event()

    @classmethod
    def for_deployment(
        cls,
        tls: TlsFiles | None,
        state_dir: Path,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        node_auth: bool = True,
        emit: Callable[[str], None] | None = None,
    ) -> SuperLink:
        """State (database, FLWR_HOME, log) under `state_dir`, kept across restarts."""
        state_dir = Path(state_dir).expanduser().resolve()
        return cls(
            state_dir / "flwr-home",
            state_dir / "superlink.log",
            database=str(state_dir / "superlink.db"),
            tls=tls,
            node_auth=node_auth,
            host=host,
            port=port,
            emit=emit,
        )

    @classmethod
    def for_simulation(
        cls, flwr_home: Path | None = None, log_dir: Path | None = None, cwd: Path | None = None
    ) -> SuperLink:
        """A private simulation SuperLink on free ports; a temporary FLWR_HOME unless one is given."""
        home = Path(flwr_home or tempfile.mkdtemp(prefix="fedla-flwr-home-"))
        # its own Control API port too: Flower's default (9093) would collide between concurrent runs
        return cls(
            home,
            (log_dir or home) / "superlink.log",
            database=":flwr-in-memory:",
            simulation=True,
            port=free_port(),
            control_port=free_port(),
            connection="local",
            remove_home=flwr_home is None,
            cwd=cwd,
        )

    # -- addresses and files
    @property
    def local_address(self) -> str:
        """Where this machine reaches the SuperLink (the certificate must name 127.0.0.1)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return flower_env(self.flwr_home)

    def write_connection(self) -> Path:
        """`$FLWR_HOME/config.toml` with this SuperLink as the default connection of the `flwr` CLI."""
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        lines = [
            "[superlink]",
            f'default = "{self.connection}"',
            "",
            f"[superlink.{self.connection}]",
            f'address = "{self.local_address}"',
        ]
        if self.tls is not None:
            lines.append(f"root-certificates = {json.dumps(str(self.tls.ca.resolve()))}")
        else:
            lines.append("insecure = true")
        path = self.flwr_home / "config.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def command(self) -> list[str]:
        cmd = [
            flower_bin("flower-superlink"),
            "--isolation",
            "subprocess",
            "--disable-runtime-dependency-installation",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--database",
            self.database,
        ]
        if self.simulation:
            cmd.append("--simulation")
        if self.control_port is not None:
            cmd += ["--control-api-address", f"127.0.0.1:{self.control_port}"]
        if self.tls is not None:
            cmd += [
                "--ssl-certfile",
                str(self.tls.cert.resolve()),
                "--ssl-keyfile",
                str(self.tls.key.resolve()),
                "--ssl-ca-certfile",
                str(self.tls.ca.resolve()),
            ]
        else:
            cmd.append("--insecure")
        if self.node_auth:
            cmd.append("--enable-supernode-auth")
        return cmd

    # -- lifecycle
    def start(self, timeout: float = 90.0) -> SuperLink:
        """Start the SuperLink and wait until `/health` answers; a FedLookaheadError (with its log) otherwise."""
        if self.tls is not None:
            self.tls.check()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.write_connection()
        out = open(self.log_file, "a", encoding="utf-8")  # noqa: SIM115 - the child keeps it; closed below
        try:
            process = subprocess.Popen(
                self.command(),
                env=self.env,
                cwd=self.cwd or Path.cwd(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=set_parent_death_signal,
            )
        finally:
            out.close()
        self.tree = ProcessTree(process)
        self._watch_stop.clear()
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
        raise FedLookaheadError(
            f"flower-superlink did not answer on {self.local_address} within {timeout:.0f}s; see {self.log_file}"
        )

    def _watch(self) -> None:
        """Note every descendant while the SuperLink runs (ServerApp processes and Ray can outlive their parent)."""
        while not self._watch_stop.wait(1.0):
            if self.tree is not None:
                self.tree.remember()

    def running(self) -> bool:
        return self.tree is not None and self.tree.process.poll() is None

    def pids(self) -> list[int]:
        """The SuperLink and every descendant noted so far that still runs."""
        return self.tree.pids() if self.tree is not None else []

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = strip_ansi(self.log_file.read_text(errors="replace"))
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    def close(self) -> None:
        """Terminate the SuperLink and everything it started, by pid; remove a temporary FLWR_HOME."""
        self._watch_stop.set()
        if self.tree is not None:
            self.tree.terminate(grace=10)
            self.tree = None
        if self.remove_home:
            shutil.rmtree(self.flwr_home, ignore_errors=True)

    def __enter__(self) -> SuperLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the flwr CLI against this SuperLink
    def flwr(self, *args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            [flower_bin("flwr"), *args], env=self.env, capture_output=True, text=True, timeout=timeout, **kwargs
        )

    def register(self, public_key: Path) -> str:
        """Register one SuperNode public key (OpenSSH ECDSA); returns a one-line outcome."""
        done = self.flwr(
            "supernode", "register", str(Path(public_key).expanduser().resolve()), self.connection, "--format", "json"
        )
        try:
            answer = json.loads(done.stdout[done.stdout.index("{") :])
        except ValueError:
            answer = {"success": False, "error-message": strip_ansi(done.stdout + done.stderr).strip()}
        if answer.get("success"):
            return f"registered {public_key} as node {answer.get('node-id')}"
        message = str(answer.get("error-message", ""))
        if "already in use" in message:
            return f"{public_key} is already registered"
        raise FedLookaheadError(
            f"could not register {public_key}: {message.strip().splitlines()[-1] if message else done.returncode}"
        )

    def nodes(self) -> list[dict]:
        done = self.flwr("supernode", "list", self.connection, "--format", "json")
        try:
            return list(json.loads(done.stdout[done.stdout.index("{") :]).get("nodes", []))
        except ValueError:
            return []

    def submit(
        self,
        app_dir: Path,
        run_config: dict,
        federation_config: dict | None = None,
        log_path: Path | None = None,
        timeout: float | None = None,
        echo: bool = True,
    ) -> tuple[int, list[str]]:
        """`flwr run APP <connection> --run-config ... --stream` until the run ends; returns (exit code, output
        lines). Past `timeout` seconds `flwr run` is killed (a negative exit code)."""
        cmd = [flower_bin("flwr"), "run", str(app_dir), self.connection, "--stream"]
        if run_config:
            cmd += ["--run-config", config_args(run_config)]
        if federation_config:
            cmd += ["--federation-config", config_args(federation_config)]
        lines: list[str] = []
        out = open(log_path, "w", encoding="utf-8") if log_path else None  # noqa: SIM115
        process = subprocess.Popen(
            cmd,
            env=self.env,
            cwd=app_dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            preexec_fn=set_parent_death_signal,
        )
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
            if self.tree is not None:
                self.tree.remember()
