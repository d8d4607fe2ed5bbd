"""`fedla client`: the long-running FedLookahead process on a device.

It checks everything it can before connecting (data folder, base, device, certificates, key,
state folder) and fails with one line if something is wrong; then it runs Flower's own SuperNode,
`flower-supernode`, as a child process, with TLS (`--root-certificates`) and node authentication
(`--auth-supernode-private-key`), and with this device's settings as node config (written to
<state>/node-config.toml and passed as `--node-config <file>`):

    data-dir           the device's private text folder (client.task reads it instead of a partition)
    state-dir          where the ClientApp keeps the privacy ledger and the global heads (client.state)
    heads-dir          where the newest global heads are also published for `fedla generate`
    device             auto | cpu | cuda (FedConfig's `device`, overriding the run config)
    base-model-dir     the device's copy of the base ("" = the embedded default)
    budget-epsilon, max-dp-delta, max-dp-grad-norm, min-dp-noise-multiplier
                       the device's privacy floor (client.privacy.DeviceFloor): DP always on, its
                       lifetime epsilon budget (--budget-eps) over all runs at its delta, the largest
                       delta and clipping norm and the smallest noise multiplier it accepts; a run
                       config can only be stricter

Every ClientApp of a run (one process per Flower message, started by the SuperNode) reads those
keys. The daemon restarts the SuperNode when it exits: at once after a lost connection, with
exponential backoff while the SuperLink cannot be reached (on top of flower-supernode's own
--max-retries / --max-wait-time), and gives up with a clear error after --restarts failed starts
in a row. A refused key or a certificate that does not match is final: retrying cannot fix it.

It prints one line per round from <state>/events.jsonl (written by the ClientApp), and Flower's
errors; Flower's full output goes to <state>/supernode.log.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from client.state import EVENTS_FILE, default_state_dir
from common.base import FedLookaheadError
from common.procs import ProcessTree, flower_bin, flower_env, free_port, set_parent_death_signal, strip_ansi, toml_value

log = logging.getLogger("fedla.client")

# exit codes of `fedla client` (also documented in docs/deploy.md)
EXIT_OK = 0
EXIT_BAD_INPUT = 2  # checked before connecting
EXIT_REFUSED = 3  # the SuperLink does not know this node's key
EXIT_TLS = 4  # the SuperLink's certificate is not trusted / does not match
EXIT_UNREACHABLE = 5  # gave up reconnecting

MAX_BACKOFF = 60.0
GIVE_UP_GRACE = 5.0  # seconds a SuperNode that gave up reconnecting gets to exit by itself


class DaemonError(FedLookaheadError):
    def __init__(self, message: str, code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class DaemonOptions:
    superlink: str
    data: Path
    base: Optional[Path] = None
    device: str = "auto"
    budget_eps: Optional[float] = None  # lifetime epsilon budget; None: DeviceFloor's default
    max_delta: float | None = None  # None: DeviceFloor's defaults, for these three too
    max_grad_norm: float | None = None
    min_noise_multiplier: float | None = None
    root_certificates: Optional[Path] = None
    auth_key: Optional[Path] = None
    state_dir: Optional[Path] = None
    heads_dir: Optional[Path] = None  # None: common.decoding.default_heads_dir()
    publish_heads: bool = True
    insecure: bool = False
    max_retries: int = 10  # flower-supernode's own reconnection tries per start
    max_wait_time: float = 60.0  # flower-supernode's own reconnection time limit per start
    restarts: int = 5  # failed starts in a row before giving up (0: never give up)
    refused_patience: float = 75.0  # seconds of refused activations before calling the key unregistered
    runtime_port: int = 0  # the SuperNode's local runtime API port (0: a free one)
    node_config: str = ""  # extra `k=v ...` node config (any FedConfig client-side key)
    serve_port: int = 0  # > 0: also serve the local OpenAI-compatible endpoint on 127.0.0.1:PORT
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------- preflight


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DaemonError(f"--superlink must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def check_data(folder: Path) -> int:
    """Number of readable, non-empty text files in `folder`; a one-line error when there are none."""
    from common.data import read_text, text_files

    folder = folder.expanduser()
    if not folder.exists():
        raise DaemonError(f"data folder not found: {folder}")
    if not folder.is_dir():
        raise DaemonError(f"data folder is not a folder: {folder}")
    if not os.access(folder, os.R_OK | os.X_OK):
        raise DaemonError(f"data folder is not readable: {folder}")
    try:
        files = text_files(folder)
    except PermissionError as exc:
        raise DaemonError(f"data folder is not readable: {exc}") from exc
    except FedLookaheadError as exc:
        raise DaemonError(f"data folder has no usable text: {exc}") from exc
    usable, unreadable = 0, 0
    for path in files:
        try:
            text = read_text(path)
        except OSError:
            unreadable += 1
            continue
        if text and text.strip():
            usable += 1
    if not usable:
        detail = f"{unreadable} unreadable, {len(files) - unreadable} empty or binary"
        raise DaemonError(f"data folder has no readable text: {len(files)} file(s) under {folder} ({detail})")
    return usable


def check_certificate(path: Path) -> None:
    from cryptography import x509

    if not path.expanduser().is_file():
        raise DaemonError(f"--root-certificates: no such file: {path}")
    try:
        x509.load_pem_x509_certificates(path.expanduser().read_bytes())
    except (ValueError, OSError) as exc:
        raise DaemonError(f"--root-certificates: {path} is not a PEM certificate ({exc})") from exc


def check_auth_key(path: Path) -> str:
    """The key's public half in OpenSSH format (what the operator registers)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not path.expanduser().is_file():
        raise DaemonError(f"--auth-key: no such file: {path}")
    try:
        key = serialization.load_ssh_private_key(path.expanduser().read_bytes(), password=None)
    except (ValueError, TypeError, OSError) as exc:
        raise DaemonError(f"--auth-key: {path} is not an unencrypted OpenSSH private key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in ("secp256r1", "secp384r1", "secp521r1"):
        raise DaemonError(f"--auth-key: Flower's node authentication needs an ECDSA key on a NIST curve "
                          f"(e.g. `ssh-keygen -t ecdsa -b 384`), {path} is not one")
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def check_device(device: str) -> None:
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise DaemonError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise DaemonError(f"--device {device}: CUDA is not available on this machine (use auto or cpu)")


def check_state_dir(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise DaemonError(f"state folder {folder} is not writable: {exc}") from exc


def preflight(opts: DaemonOptions) -> dict:
    """Every check that needs no network; raises DaemonError (one line) on the first problem."""
    parse_address(opts.superlink)
    files = check_data(opts.data)
    if opts.base is not None and not (opts.base.expanduser() / "config.json").is_file():
        raise DaemonError(f"--base {opts.base} is not a model folder (no config.json)")
    check_device(opts.device)
    if opts.budget_eps is not None and not opts.budget_eps > 0:
        raise DaemonError(f"--budget-eps must be positive, got {opts.budget_eps}")
    if opts.insecure and (opts.root_certificates or opts.auth_key):
        raise DaemonError("--insecure cannot be combined with --root-certificates or --auth-key "
                          "(node authentication requires TLS)")
    if opts.root_certificates is not None:
        check_certificate(opts.root_certificates)
    public_key = check_auth_key(opts.auth_key) if opts.auth_key is not None else None
    state_dir = (opts.state_dir or default_state_dir()).expanduser()
    check_state_dir(state_dir)
    extra: dict = {}
    if opts.node_config:
        from flwr.common.config import parse_config_args

        try:
            extra = parse_config_args([opts.node_config])
        except Exception as exc:  # noqa: BLE001 - click/tomli errors
            raise DaemonError(f"--node-config {opts.node_config!r} is not `k=v ...` with TOML values: {exc}") from exc
    check_privacy({**floor_values(opts), **extra, "state-dir": str(state_dir)})
    return {"data_files": files, "public_key": public_key}


def check_privacy(node_config: dict) -> None:
    """The privacy floor is valid and the ledger can be trusted (else the device would decline every round)."""
    from client.privacy import DeviceFloor, load_ledger

    try:
        DeviceFloor.from_node_config(node_config)
        load_ledger(Path(node_config["state-dir"]))
    except FedLookaheadError as exc:
        raise DaemonError(str(exc)) from exc


def reset_ledger_command(state_dir: Path | None, yes: bool) -> int:
    """`fedla client reset-ledger`: start the device's privacy ledger over, on purpose (client.privacy.reset_ledger).

    Prints one line (what was done, or on stderr why not and what resetting means) and returns the
    exit code: 0, or EXIT_BAD_INPUT without --yes or without a state folder.
    """
    from client.privacy import reset_ledger

    try:
        print(reset_ledger(state_dir or default_state_dir(), yes=yes), flush=True)
    except FedLookaheadError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return EXIT_OK


# ----------------------------------------------------------------------------------- node config


def floor_values(opts: DaemonOptions) -> dict:
    """This device's privacy floor as node config keys (client.privacy.DeviceFloor; unset options: its defaults)."""
    from client.privacy import BUDGET_KEY, MAX_DELTA_KEY, MAX_GRAD_NORM_KEY, MIN_NOISE_KEY, DeviceFloor

    defaults = DeviceFloor(Path("."))
    chosen = {BUDGET_KEY: (opts.budget_eps, defaults.budget_epsilon), MAX_DELTA_KEY: (opts.max_delta, defaults.delta),
              MAX_GRAD_NORM_KEY: (opts.max_grad_norm, defaults.max_grad_norm),
              MIN_NOISE_KEY: (opts.min_noise_multiplier, defaults.min_noise_multiplier)}
    return {key: float(default if value is None else value) for key, (value, default) in chosen.items()}


def node_config_values(opts: DaemonOptions, state_dir: Path) -> dict:
    from flwr.common.config import parse_config_args

    values: dict = {
        "data-dir": str(opts.data.expanduser().resolve()),
        "state-dir": str(state_dir.resolve()),
        "device": opts.device,
        "base-model-dir": str(opts.base.expanduser().resolve()) if opts.base else "",
    }
    if opts.publish_heads:
        if opts.heads_dir is None:
            from common.decoding import default_heads_dir

            values["heads-dir"] = str(default_heads_dir().resolve())
        else:
            values["heads-dir"] = str(opts.heads_dir.expanduser().resolve())
    values.update(floor_values(opts))
    if opts.node_config:
        values.update(parse_config_args([opts.node_config]))
    return values


def write_node_config(path: Path, values: dict) -> Path:
    path.write_text("".join(f"{key} = {toml_value(value)}\n" for key, value in values.items()))
    return path


# ----------------------------------------------------------------------------------- round lines


def format_round(round_no, run, train: dict | None, heads: dict | None, evaluation: dict | None,
                 budget: float | None) -> str:
    """One log line for one round on this device."""
    parts = []
    if train is None:
        parts.append("not sampled for training")
    elif train.get("skipped"):
        parts.append(f"declined training ({train.get('skip_reason') or 'skipped'}); still connected")
    else:
        text = f"trained {int(train.get('num_train_chunks', 0))} chunks"
        if "loss" in train:
            text += f", loss {float(train['loss']):.3f}"
        if "acc_1" in train:
            text += f", head-1 acc {float(train['acc_1']):.3f}"
        if train.get("dp"):
            eps = float(train.get("epsilon", 0.0))
            text += f", epsilon {eps:.3f}" + (f"/{budget:g}" if budget else "") + f" (delta {float(train.get('delta', 0)):g})"
        else:
            text += ", no DP"
        text += f", {float(train.get('train_seconds', 0.0)):.1f}s"
        parts.append(text)
    if heads is not None:
        parts.append(f"global heads v{heads['version']} kept (sha256 {str(heads.get('sha256', ''))[:12]})")
    if evaluation is not None and evaluation.get("head_accuracy"):
        accuracy = ", ".join(f"{float(a):.2f}" for a in evaluation["head_accuracy"])
        tau = evaluation.get("tau")
        parts.append(f"local eval acc [{accuracy}]" + (f" tau {float(tau):.2f}" if tau is not None else ""))
    return f"round {round_no} (run {run}): " + "; ".join(parts)


class RoundLogger:
    """Follows <state>/events.jsonl and emits one line per round."""

    def __init__(self, events: Path, emit: Callable[[str], None], budget: float | None) -> None:
        self.events = events
        self.emit = emit
        self.budget = budget
        self.offset = events.stat().st_size if events.is_file() else 0
        self.pending: dict | None = None
        self.lines: list[str] = []
        self._partial = ""

    def poll(self) -> None:
        if not self.events.is_file():
            return
        with open(self.events, encoding="utf-8") as handle:
            handle.seek(self.offset)
            data = handle.read()
            self.offset = handle.tell()
        data = self._partial + data
        *complete, self._partial = data.split("\n")
        for line in complete:
            if line.strip():
                try:
                    self.handle(json.loads(line))
                except (ValueError, KeyError):
                    continue

    def _current(self, event: dict) -> dict:
        key = (event.get("run"), event.get("round"))
        if self.pending is not None and self.pending["key"] != key:
            self.flush()
        if self.pending is None:
            self.pending = {"key": key, "train": None, "heads": None, "eval": None}
        return self.pending

    def handle(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "train-start":
            self._current(event)
        elif kind == "train-done":
            self._current(event)["train"] = event
        elif kind == "heads":  # kept from a train message (previous version) or an evaluate message (new one)
            self._current(event)["heads"] = event
        elif kind == "eval":
            self._current(event)["eval"] = event
            self.flush()

    def flush(self) -> None:
        if self.pending is None:
            return
        run, round_no = self.pending["key"]
        line = format_round(round_no, run, self.pending["train"], self.pending["heads"], self.pending["eval"],
                            self.budget)
        self.pending = None
        self.lines.append(line)
        self.emit(line)


# ----------------------------------------------------------------------------------- the daemon


NOISE = ("Connection attempt failed", "retrying in")


class ClientDaemon:
    def __init__(self, opts: DaemonOptions, emit: Callable[[str], None] | None = None) -> None:
        self.opts = opts
        self.state_dir = (opts.state_dir or default_state_dir()).expanduser()
        self.emit = emit or (lambda line: print(line, flush=True))
        self.stopping = threading.Event()
        self.tree: ProcessTree | None = None
        self.tail: deque[str] = deque(maxlen=80)
        self.node_id: int | None = None
        self.connected_this_start = False
        self.gave_up_at: float | None = None
        self.start_began = time.monotonic()
        self.flwr_home = self.state_dir / "flwr-home"
        self.log_path = self.state_dir / "supernode.log"

    # -- output of flower-supernode (and of the ClientApps it starts)
    def _reader(self, stream, log_file) -> None:
        try:
            self._read(stream, log_file)
        finally:
            stream.close()
            log_file.close()

    def _read(self, stream, log_file) -> None:
        for raw in iter(stream.readline, ""):
            line = strip_ansi(raw.rstrip("\n"))
            log_file.write(line + "\n")
            log_file.flush()
            self.tail.append(line)
            if "SuperNode ID:" in line:
                try:
                    self.node_id = int(line.rsplit(":", 1)[1].strip())
                except ValueError:
                    pass
                self.connected_this_start = True
                self.emit(f"connected to the SuperLink at {self.opts.superlink} as node {self.node_id}")
                self._write_status("connected")
            elif "Connection successful after" in line:
                self.emit(f"reconnected to the SuperLink ({line.split(':', 1)[-1].strip()})")
            elif line.startswith(("ERROR", "CRITICAL")) and not any(n in line for n in NOISE) and "Exit Code" not in line:
                self.emit(f"supernode: {line}")
            elif "Giving up reconnection" in line:
                # flower-supernode 1.42 does not always exit after this (its runtime API thread keeps the
                # process alive, disconnected): the daemon ends it and starts a new one
                self.gave_up_at = time.monotonic()
                self.emit(f"supernode: {line}")

    def _write_status(self, status: str, **extra) -> None:
        data = {"status": status, "pid": os.getpid(), "superlink": self.opts.superlink, "node_id": self.node_id,
                "state_dir": str(self.state_dir), "time": time.time(), **extra}
        tmp = self.state_dir / f".daemon.json.{os.getpid()}"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.state_dir / "daemon.json")

    def command(self, config_file: Path, port: int) -> list[str]:
        opts = self.opts
        cmd = [flower_bin("flower-supernode"), "--superlink", opts.superlink, "--node-config", str(config_file),
               "--isolation", "subprocess", "--host", "127.0.0.1", "--port", str(port),
               "--max-retries", str(opts.max_retries), "--max-wait-time", str(opts.max_wait_time)]
        if opts.insecure:
            cmd.append("--insecure")
        if opts.root_certificates is not None:
            cmd += ["--root-certificates", str(opts.root_certificates.expanduser().resolve())]
        if opts.auth_key is not None:
            cmd += ["--auth-supernode-private-key", str(opts.auth_key.expanduser().resolve())]
        return cmd

    def _start(self, cmd: list[str]) -> threading.Thread:
        self.connected_this_start = False
        self.gave_up_at = None
        self.start_began = time.monotonic()
        self.tail.clear()
        log_file = open(self.log_path, "a", encoding="utf-8")  # noqa: SIM115 - the reader thread closes it
        log_file.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                   env=flower_env(self.flwr_home, PYTHONUNBUFFERED="1"), cwd=self.state_dir,
                                   preexec_fn=set_parent_death_signal)
        self.tree = ProcessTree(process)
        reader = threading.Thread(target=self._reader, args=(process.stdout, log_file), daemon=True)
        reader.start()
        return reader

    def detail(self) -> str:
        """The most telling line of the last SuperNode's output (Flower prints the cause after this one)."""
        lines = [line.strip() for line in self.tail]
        for index, line in enumerate(lines):
            if line.startswith("Failed to initialize the connection") and index + 1 < len(lines):
                return lines[index + 1]
        for line in reversed(lines):
            if line.startswith(("ERROR", "CRITICAL")) and "Exit Code" not in line and "handshake error" not in line:
                return line.split(":", 1)[1].strip() if ":" in line else line
        return ""

    def classify(self) -> tuple[str, str]:
        """Why the last flower-supernode exited: (kind, detail)."""
        text = "\n".join(self.tail)
        detail = self.detail()
        if "Failed to activate SuperNode" in text or "does not recognize this SuperNode" in text:
            return "refused", detail
        if "CERTIFICATE_VERIFY_FAILED" in text or "SSL/TLS handshake" in text or "certificate verify failed" in text:
            return "tls", detail
        if "Unable to parse the private key" in text:
            return "key", detail
        if self.connected_this_start:
            return "lost", detail
        return "unreachable", detail

    def stop(self, *_args) -> None:
        self.stopping.set()

    def run(self) -> int:
        """Run until stopped (returns 0) or a final error (raises DaemonError)."""
        opts = self.opts
        info = preflight(opts)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        values = node_config_values(opts, self.state_dir)
        config_file = write_node_config(self.state_dir / "node-config.toml", values)
        port = opts.runtime_port or free_port()
        cmd = self.command(config_file, port)
        from client.privacy import BUDGET_KEY, MAX_DELTA_KEY

        budget = float(values[BUDGET_KEY])
        rounds = RoundLogger(self.state_dir / EVENTS_FILE, self.emit, budget)
        self.emit(f"fedla client: {info['data_files']} text file(s) in {values['data-dir']}, device {opts.device}, "
                  f"state {self.state_dir}" + (f", heads published to {values['heads-dir']}" if "heads-dir" in values else "")
                  + f", lifetime privacy budget epsilon {budget:g} at delta {float(values[MAX_DELTA_KEY]):g}")
        if info["public_key"]:
            self.emit(f"node public key (register it on the server): {info['public_key']}")
        failures, failing_since, refused_since = 0, None, None
        self._write_status("starting", node_config=values, command=cmd)
        endpoint = None
        try:
            if opts.serve_port:  # apps on this device generate with the newest heads the rounds deliver
                from client.endpoint import start_endpoint
                from common.default_model import resolve_base

                try:
                    endpoint = start_endpoint(resolve_base(opts.base), self.state_dir / "heads" / "latest",
                                              port=opts.serve_port, device=opts.device)
                except FedLookaheadError as exc:
                    raise DaemonError(f"local generation endpoint: {exc}") from None
                self.emit(f"local generation endpoint on {endpoint.url} (OpenAI-compatible /v1/completions, "
                          "/v1/chat/completions)")
            while not self.stopping.is_set():
                reader = self._start(cmd)
                process = self.tree.process
                while process.poll() is None and not self.stopping.is_set():
                    self.tree.remember()
                    rounds.poll()
                    if self.gave_up_at is not None and time.monotonic() - self.gave_up_at > GIVE_UP_GRACE:
                        break  # it gave up reconnecting but is still running: restart it below
                    self.stopping.wait(0.5)
                if self.stopping.is_set():
                    break
                self.tree.terminate(grace=5)  # its SuperExec may linger and hold the output pipe open
                reader.join(timeout=15)
                rounds.poll()
                kind, detail = self.classify()
                now = time.monotonic()
                if self.connected_this_start:
                    failures, failing_since, refused_since = 0, None, None
                if kind == "tls":
                    raise DaemonError(
                        f"TLS to {opts.superlink} failed: the SuperLink's certificate is not trusted by "
                        f"{opts.root_certificates or 'the system CA store'} or does not name this host ({detail})",
                        EXIT_TLS)
                if kind == "key":
                    raise DaemonError(f"flower-supernode could not read the key {opts.auth_key}: {detail}")
                if kind == "refused":
                    # Flower answers the same "Failed to activate SuperNode" for an unknown key and for a
                    # registered node the SuperLink still counts as online (a crash or a SuperLink restart
                    # less than 2 heartbeats ago): retry for a while before calling it final
                    refused_since = refused_since or now
                    if now - refused_since >= opts.refused_patience:
                        raise DaemonError(
                            f"the SuperLink at {opts.superlink} refused this node for {now - refused_since:.0f}s: its key "
                            f"{opts.auth_key} is not registered there (the operator runs `flwr supernode register "
                            f"{opts.auth_key}.pub`; see docs/deploy.md)", EXIT_REFUSED)
                    delay = min(10.0, max(1.0, opts.refused_patience - (now - refused_since)))
                    self.emit(f"the SuperLink refused to activate this node (key not registered, or the node is still "
                              f"marked online from a previous connection); retrying in {delay:.0f}s, for up to "
                              f"{opts.refused_patience:.0f}s")
                    self._write_status("refused")
                elif kind == "lost":
                    self.emit(f"connection to the SuperLink lost ({detail or 'supernode exited'}); reconnecting")
                    self._write_status("reconnecting")
                    delay = 1.0
                else:
                    failures += 1
                    failing_since = failing_since or self.start_began
                    if opts.restarts and failures >= opts.restarts:
                        raise DaemonError(
                            f"cannot reach the SuperLink at {opts.superlink}: {failures} attempt(s) over "
                            f"{now - failing_since:.0f}s failed (last error: {detail or 'no answer'})",
                            EXIT_UNREACHABLE)
                    delay = min(MAX_BACKOFF, 2.0 ** (failures - 1)) * (0.8 + 0.4 * random.random())
                    self.emit(f"SuperLink at {opts.superlink} unreachable ({detail or 'no answer'}); "
                              f"retry {failures}/{opts.restarts or 'unlimited'} in {delay:.1f}s")
                    self._write_status("waiting", failures=failures)
                self.stopping.wait(delay)
        finally:
            if endpoint is not None:
                endpoint.stop()
            if self.tree is not None:
                self.tree.terminate(grace=10)
            rounds.poll()
            rounds.flush()
            try:
                self._write_status("stopped")
            except OSError:
                pass
        return EXIT_OK


def run_daemon(opts: DaemonOptions) -> int:
    """Entry point of `fedla client`: run until SIGTERM/SIGINT; one-line errors and exit codes."""
    daemon = ClientDaemon(opts)
    previous = {sig: signal.signal(sig, daemon.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = daemon.run()
        print("fedla client: stopped", flush=True)
        return code
    except DaemonError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
