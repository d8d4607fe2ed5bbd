"""Process plumbing shared by everything that starts Flower's own processes (SuperLink, SuperNode).

Flower's daemons start children of their own (SuperExec, ServerApp/ClientApp processes, Ray), some
of which outlive their parent for a while. Whoever starts one must end exactly what it started: we
note every descendant of our process by pid while it runs (from /proc) and terminate those pids,
never processes found by name.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def toml_value(value) -> str:
    """A scalar in TOML syntax (a JSON string is a valid TOML basic string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def config_args(values: dict) -> str:
    """`k=v k2=v2` in Flower's --run-config / --node-config / --federation-config syntax (TOML values)."""
    return " ".join(f"{k}={toml_value(v)}" for k, v in values.items())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the usual bind-to-0 trick; racy but fine for tests)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def flower_bin(name: str) -> str:
    """Path of a Flower console script next to this interpreter (the venv's, not whatever is on PATH)."""
    return str(Path(sys.executable).parent / name)


def flower_env(flwr_home: Path | str | None = None, **extra: str) -> dict[str, str]:
    """Environment for Flower's processes: no update check, no telemetry, no `uv sync`, venv first on PATH."""
    env = dict(os.environ)
    env.update(
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_TELEMETRY_ENABLED="0",
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
    )
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    env.update(extra)
    return env


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (from /proc), breadth first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None if gone.

    A pid plus its start time names one process for good: pids are recycled, this pair is not.
    """
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def terminate(pids: Iterable[int], grace: float = 5.0, reap: subprocess.Popen | None = None) -> None:
    """SIGTERM every pid, wait up to `grace` seconds, then SIGKILL the survivors.

    `reap`: our own child among them, waited for so it leaves no zombie.
    """
    pids = list(dict.fromkeys(pids))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        sent = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                sent.append(pid)
            except ProcessLookupError:
                pass
        if not sent:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(alive(p) for p in sent):
            if reap is not None:
                try:
                    reap.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.2)
        if not any(alive(p) for p in sent):
            break
    if reap is not None:
        try:
            reap.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


class ProcessTree:
    """A started process plus every descendant it ever had while we watched (`remember()` often).

    Descendants are remembered with their start time, so a pid the system has since given to some
    unrelated process is never signalled.
    """

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.known: dict[int, int] = {}  # pid -> start time

    @property
    def pid(self) -> int:
        return self.process.pid

    def remember(self) -> set[int]:
        if self.process.poll() is None:
            for pid in descendants(self.process.pid):
                started = start_time(pid)
                if started is not None:
                    self.known.setdefault(pid, started)
        return set(self.known)

    def pids(self) -> list[int]:
        """Our process and those remembered descendants that are still the same processes."""
        return [self.process.pid, *sorted(pid for pid, started in self.known.items() if start_time(pid) == started)]

    def terminate(self, grace: float = 5.0) -> None:
        self.remember()
        terminate(self.pids(), grace=grace, reap=self.process)


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """`preexec_fn` for a child that must not outlive us even if we are SIGKILLed (Linux; no-op elsewhere)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)
