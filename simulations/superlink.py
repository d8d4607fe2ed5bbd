"""A private local SuperLink for simulations and tests: our own ports, our own FLWR_HOME, our own pids.

Flower 1.42 no longer reads `[tool.flwr.federations]` from pyproject.toml for connections (if the
section is present, `flwr run` migrates it into $FLWR_HOME/config.toml and comments it out of the
pyproject). Connections live in `$FLWR_HOME/config.toml`; its default `[superlink.local]` with
`address = ":local:"` makes `flwr run` start a detached simulation SuperLink on the fixed port 39091
(and 39093) that keeps running after the run.

That default is fine for a quick `flwr run .`, but two concurrent users of one machine would share
that SuperLink. So this helper starts `flower-superlink --simulation` itself, on free ports, with a
temporary FLWR_HOME whose config.toml points a connection named "local" at it, submits the run with
`flwr run . local --run-config ... --federation-config ... --stream`, and on exit terminates exactly
the processes it started (the SuperLink and its descendants: SuperExec, simulation process, Ray).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

# process helpers shared with the deployment SuperLink (server/deploy.py) and the device daemon
from common.procs import config_args, terminate, toml_value  # noqa: F401 - re-exported for callers of this module
from common.procs import descendants as _descendants
from common.procs import free_port as _free_port

REPO = Path(__file__).resolve().parents[1]


class LocalSuperLink:
    """`with LocalSuperLink() as link: link.run(run_config, federation_config)`."""

    def __init__(self, flwr_home: Path | None = None, log_dir: Path | None = None) -> None:
        self._own_home = flwr_home is None
        self.flwr_home = Path(flwr_home or tempfile.mkdtemp(prefix="fedla-flwr-home-"))
        self.log_dir = log_dir or self.flwr_home
        self.port = _free_port()
        self.control_port = _free_port()
        self.process: subprocess.Popen | None = None
        self.known: set[int] = set()

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(FLWR_HOME=str(self.flwr_home), FLWR_DISABLE_UPDATE_CHECK="1",
                   FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", FLWR_TELEMETRY_ENABLED="0",
                   PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
        return env

    def __enter__(self) -> LocalSuperLink:
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        (self.flwr_home / "config.toml").write_text(
            '[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')
        log_file = self.log_dir / "superlink.log"
        command = [str(Path(sys.executable).parent / "flower-superlink"), "--insecure", "--simulation",
                   "--isolation", "subprocess", "--control-api-address", f"127.0.0.1:{self.control_port}",
                   "--host", "127.0.0.1", "--port", str(self.port), "--database", ":flwr-in-memory:",
                   "--log-file", str(log_file)]
        self.process = subprocess.Popen(command, env=self.env, cwd=REPO, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"flower-superlink exited with {self.process.returncode}; see {log_file}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).is_success:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError(f"flower-superlink did not become healthy within 60 s; see {log_file}")

    def run(self, run_config: dict, federation_config: dict, timeout: float = 3600, log_path: Path | None = None,
            app_dir: Path = REPO) -> int:
        """Submit the app and stream its logs until the run ends; returns `flwr run`'s exit code."""
        command = [str(Path(sys.executable).parent / "flwr"), "run", str(app_dir), "local", "--stream"]
        if run_config:
            command += ["--run-config", config_args(run_config)]
        if federation_config:
            command += ["--federation-config", config_args(federation_config)]
        out = open(log_path, "w") if log_path else None  # noqa: SIM115
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(stop,), daemon=True)
        watcher.start()  # Ray's processes can outlive their parent: note every descendant while it runs
        try:
            done = subprocess.run(command, env=self.env, cwd=app_dir, timeout=timeout,
                                  stdout=out or None, stderr=subprocess.STDOUT if out else None)
            return done.returncode
        finally:
            stop.set()
            watcher.join()
            self._remember()
            if out:
                out.close()

    def _watch(self, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            self._remember()

    def _remember(self) -> None:
        if self.process is not None:
            self.known.update(_descendants(self.process.pid))

    def close(self) -> None:
        """Terminate the SuperLink and every process it started (by pid), then remove our FLWR_HOME."""
        if self.process is None:
            return
        self._remember()
        terminate([self.process.pid] + sorted(self.known), grace=5.0, reap=self.process)
        self.process = None
        if self._own_home:
            shutil.rmtree(self.flwr_home, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()
