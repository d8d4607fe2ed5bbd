"""One `flower-supernode` child process, and what its output means.

Flower 1.42 reports its state only in its log, so the daemon reads it line by line: `parse_line`
turns one line into an event, `classify` says why a start ended. Both are pure functions of the
text; the strings they match are Flower's own (flwr/supernode/start_client_internal.py,
flwr/supercore/retry/http_retry.py, flwr/supercore/error/catalog.py), kept here in one place.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterable

from client.daemon.options import DaemonOptions
from client.daemon.policy import Kind
from common.procs import ProcessTree, flower_bin, set_parent_death_signal, strip_ansi

NODE_ID = "SuperNode ID:"
RECONNECTED = "Connection successful after"
RETRYING = "Connection attempt failed"  # "..., retrying in N seconds" (and its DEBUG detail line)
GAVE_UP = "Giving up reconnection"
REFUSED = ("Failed to activate SuperNode", "does not recognize this SuperNode")
TLS = ("CERTIFICATE_VERIFY_FAILED", "SSL/TLS handshake", "certificate verify failed")
BAD_KEY = "Unable to parse the private key"


def parse_line(line: str) -> tuple[str, str] | None:
    """One line of Flower's output as an event (name, value), or None for an ordinary line:

    ("node-id", id), ("reconnected", how long it took), ("retrying", ""), ("gave-up", line), ("error", line).
    """
    if NODE_ID in line:
        return "node-id", line.rsplit(":", 1)[1].strip()
    if RECONNECTED in line:
        return "reconnected", line.split(":", 1)[-1].strip()
    if RETRYING in line:
        return "retrying", ""
    if GAVE_UP in line:
        return "gave-up", line
    if line.startswith(("ERROR", "CRITICAL")) and "Exit Code" not in line and "retrying in" not in line:
        return "error", line
    return None


def detail(lines: Iterable[str]) -> str:
    """The most telling line of a SuperNode's output (Flower prints the cause after this one)."""
    lines = [line.strip() for line in lines]
    for index, line in enumerate(lines):
        if line.startswith("Failed to initialize the connection") and index + 1 < len(lines):
            return lines[index + 1]
    for line in reversed(lines):
        if line.startswith(("ERROR", "CRITICAL")) and "Exit Code" not in line and "handshake error" not in line:
            return line.split(":", 1)[1].strip() if ":" in line else line
    return ""


def classify(lines: Iterable[str], connected: bool) -> tuple[Kind, str]:
    """Why a SuperNode start ended: (kind, detail) for client.daemon.policy."""
    lines = list(lines)
    text = "\n".join(lines)
    why = detail(lines)
    if any(marker in text for marker in REFUSED):
        return "refused", why
    if any(marker in text for marker in TLS):
        return "tls", why
    if BAD_KEY in text:
        return "key", why
    return ("lost" if connected else "unreachable"), why


def supernode_command(opts: DaemonOptions, config_file: Path, port: int) -> list[str]:
    cmd = [
        flower_bin("flower-supernode"),
        "--superlink",
        opts.superlink,
        "--node-config",
        str(config_file),
        "--isolation",
        "subprocess",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-retries",
        str(opts.max_retries),
        "--max-wait-time",
        str(opts.max_wait_time),
    ]
    if opts.insecure:
        cmd.append("--insecure")
    if opts.root_certificates is not None:
        cmd += ["--root-certificates", str(opts.root_certificates.expanduser().resolve())]
    if opts.auth_key is not None:
        cmd += ["--auth-supernode-private-key", str(opts.auth_key.expanduser().resolve())]
    return cmd


class SuperNode:
    """One start of flower-supernode: its output goes to `log_path` and, line by line, to `on_line`."""

    def __init__(self, cmd: list[str], env: dict, cwd: Path, log_path: Path, on_line: Callable[[str], None]) -> None:
        self.tail: deque[str] = deque(maxlen=80)
        self.began = time.monotonic()
        log_file = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - the reader thread closes it
        log_file.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        self.process = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
            cwd=cwd,
            preexec_fn=set_parent_death_signal,
        )
        self.tree = ProcessTree(self.process)
        self._on_line = on_line
        self.reader = threading.Thread(target=self._read, args=(self.process.stdout, log_file), daemon=True)
        self.reader.start()

    def _read(self, stream, log_file) -> None:
        try:
            for raw in iter(stream.readline, ""):
                line = strip_ansi(raw.rstrip("\n"))
                log_file.write(line + "\n")
                log_file.flush()
                self.tail.append(line)
                self._on_line(line)
        finally:
            stream.close()
            log_file.close()

    def running(self) -> bool:
        return self.process.poll() is None

    def end(self, grace: float = 5.0) -> None:
        """Stop it (and its SuperExec and ClientApps, which may hold the output pipe open); read what is left."""
        self.tree.terminate(grace=grace)
        self.reader.join(timeout=15)
