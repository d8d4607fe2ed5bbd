"""`fedla client`: the long-running FedLookahead process on a device.

In order, it
1. checks everything it can without the network (checks.py) and stops with one line if something is
   wrong;
2. gets ready (readiness.py): builds the embedded base if the device has none, tokenises the device's
   private files into <state>/chunks and, when cheap, caches their base features, with progress bars;
3. writes the device's settings as node config (options.py, client/node_config.py) and runs Flower's own SuperNode,
   `flower-supernode`, as a child process (supernode.py), with TLS and node authentication;
4. restarts it when it exits, as the pure restart policy says (policy.py), and tells the owner what
   happens (reporter.py): one line per round from <state>/events.jsonl, and the lifecycle lines
   ("waiting for registration", "run X finished: heads vN kept", "server gone; retrying (k/N)").

Flower's full output goes to <state>/supernode.log; <state>/daemon.json says what the daemon is doing.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from client.daemon.checks import check_auth_key, check_data, parse_address, preflight
from client.daemon.options import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_TLS,
    EXIT_UNREACHABLE,
    DaemonError,
    DaemonOptions,
    floor_values,
    node_config_values,
)
from client.daemon.policy import Decision, Outcome, RestartPolicy
from client.daemon.reporter import RoundLogger, decision_line, final_error, format_round, server_gone
from client.daemon.supernode import SuperNode, classify, parse_line, supernode_command
from client.node_config import (
    BASE_MODEL_DIR_KEY,
    BUDGET_KEY,
    DATA_DIR_KEY,
    HEADS_DIR_KEY,
    MAX_DELTA_KEY,
    write_node_config,
)
from client.state import StateDir, StateLocked, state_lock
from common.durable import write_text
from common.errors import FedLookaheadError
from common.model.base import Loading
from common.paths import default_state_dir
from common.procs import flower_env, free_port

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_TLS",
    "EXIT_UNREACHABLE",
    "ClientDaemon",
    "DaemonError",
    "DaemonOptions",
    "RoundLogger",
    "check_auth_key",
    "check_data",
    "floor_values",
    "format_round",
    "node_config_values",
    "parse_address",
    "preflight",
    "reset_ledger_command",
    "run_daemon",
    "write_node_config",
]

log = logging.getLogger("fedla.client")

GIVE_UP_GRACE = 5.0  # seconds a SuperNode that gave up reconnecting gets to exit by itself


class ClientDaemon:
    def __init__(self, opts: DaemonOptions, emit: Callable[[str], None] | None = None) -> None:
        self.opts = opts
        self.state_dir = (opts.state_dir or default_state_dir()).expanduser()
        self.emit = emit or (lambda line: print(line, flush=True))
        self.stopping = threading.Event()
        self.node: SuperNode | None = None
        self.node_id: int | None = None
        self.connected_this_start = False
        self.gone_announced = False
        self.gave_up_at: float | None = None
        self.flwr_home = StateDir(self.state_dir).flwr_home
        self.log_path = StateDir(self.state_dir).supernode_log
        self.status: dict = {}

    # -- what flower-supernode says (called from its reader thread)
    def on_line(self, line: str) -> None:
        event = parse_line(line)
        if event is None:
            return
        name, value = event
        if name == "node-id":
            try:
                self.node_id = int(value)
            except ValueError:
                pass
            self.connected_this_start, self.gone_announced = True, False
            self.emit(f"connected to the SuperLink at {self.opts.superlink} as node {self.node_id}")
            self._write_status("connected")
        elif name == "reconnected":
            self.gone_announced = False
            self.emit(f"reconnected to the SuperLink ({value})")
            self._write_status("connected")
        elif name == "retrying" and self.connected_this_start and not self.gone_announced:
            self.gone_announced = True  # the SuperNode retries on its own: that is try 1
            self.emit(server_gone(1, self.opts.restarts))
            self._write_status("server-gone")
        elif name == "gave-up":
            # flower-supernode 1.42 does not always exit after this (its runtime API thread keeps the
            # process alive, disconnected): the daemon ends it and starts a new one
            self.gave_up_at = time.monotonic()
        elif name == "error" and self.connected_this_start and not self.gone_announced:
            # errors while connected (a ClientApp failing); connection errors are the policy's lines' detail
            self.emit(f"supernode: {value}")

    def _write_status(self, status: str, **extra) -> None:
        self.status.update(
            {
                "status": status,
                "pid": os.getpid(),
                "superlink": self.opts.superlink,
                "node_id": self.node_id,
                "state_dir": str(self.state_dir),
                "time": time.time(),
                **extra,
            }
        )
        write_text(StateDir(self.state_dir).daemon_status, json.dumps(self.status, indent=1, default=str))

    def stop(self, *_args) -> None:
        self.stopping.set()

    def _prepare(self) -> dict:
        """Readiness, then the node config every ClientApp reads."""
        from client.daemon.readiness import NotPrepared, prepare, prepare_base

        base_dir = prepare_base(self.opts.base, self.emit)
        values = node_config_values(self.opts, self.state_dir, base_dir)
        write_node_config(StateDir(self.state_dir).node_config, values)
        if self.opts.prepare:
            try:
                ready = prepare(values, self.emit)
                self.status["readiness"] = {
                    "train_chunks": ready.train_chunks,
                    "heldout_chunks": ready.heldout_chunks,
                    "features": ready.features,
                    "seconds": round(ready.seconds, 1),
                }
            except NotPrepared as exc:  # the run may use another chunk length: its rounds will say
                self.emit(f"not prepared ({exc}); the first round will try with the run's settings")
        return values

    def _run_one(self, cmd: list[str], rounds: RoundLogger) -> Outcome:
        """One SuperNode start, until it exits, gives up reconnecting, or the daemon stops."""
        self.connected_this_start, self.gone_announced, self.gave_up_at = False, False, None
        node = self.node = SuperNode(
            cmd, flower_env(self.flwr_home, PYTHONUNBUFFERED="1"), self.state_dir, self.log_path, self.on_line
        )
        while node.running() and not self.stopping.is_set():
            node.tree.remember()
            rounds.poll()
            if self.gave_up_at is not None and time.monotonic() - self.gave_up_at > GIVE_UP_GRACE:
                break  # it gave up reconnecting but is still running: restart it
            self.stopping.wait(0.5)
        node.end(grace=5)
        rounds.poll()
        kind, detail = classify(node.tail, self.connected_this_start)
        return Outcome(kind, self.connected_this_start, node.began, time.monotonic(), detail)

    def run(self) -> int:
        """Run until stopped (returns 0) or a final error (raises DaemonError)."""
        info = preflight(self.opts)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with ExitStack() as held:
            try:  # one daemon per state folder: two would share one privacy ledger and one node identity
                held.enter_context(state_lock(self.state_dir, StateDir.DAEMON_LOCK))
            except StateLocked as exc:
                raise DaemonError(
                    f"another fedla client is running on state folder {self.state_dir} ({exc}): "
                    "stop it first, or give this one its own --state-dir"
                ) from None
            return self._serve(info)

    def _serve(self, info: dict) -> int:
        opts = self.opts
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self._write_status("preparing")
        values = self._prepare()
        cmd = supernode_command(opts, StateDir(self.state_dir).node_config, opts.runtime_port or free_port())
        budget = float(values[BUDGET_KEY])
        rounds = RoundLogger(StateDir(self.state_dir).events, self.emit, budget)
        self.emit(
            f"fedla client: {info['data_files']} text file(s) in {values[DATA_DIR_KEY]}, device {opts.device}, "
            f"base {values[BASE_MODEL_DIR_KEY]}, state {self.state_dir}"
            + (f", heads published to {values[HEADS_DIR_KEY]}" if HEADS_DIR_KEY in values else "")
            + f", lifetime privacy budget epsilon {budget:g} at delta {float(values[MAX_DELTA_KEY]):g}"
        )
        if info["public_key"]:
            self.emit(f"node public key (register it on the server): {info['public_key']}")
        policy = RestartPolicy(opts.restarts, opts.refused_patience)
        self._write_status("starting", node_config=values, command=cmd)
        endpoint = None
        try:
            if opts.serve_port:  # apps on this device generate with the newest heads the rounds deliver
                from client.endpoint.server import start_endpoint

                try:
                    endpoint = start_endpoint(
                        Path(values[BASE_MODEL_DIR_KEY]),
                        StateDir(self.state_dir).latest_heads,
                        port=opts.serve_port,
                        loading=Loading(device=opts.device),
                        datastore_dir=Path(values[DATA_DIR_KEY]),
                        datastore_cache=StateDir(self.state_dir).datastore,
                    )
                except FedLookaheadError as exc:
                    raise DaemonError(f"local generation endpoint: {exc}") from None
                self.emit(
                    f"local generation endpoint on {endpoint.url}/v1 (OpenAI-compatible /v1/completions, "
                    f"/v1/chat/completions; {endpoint.app.state.endpoint.describe()})"
                )
                self._write_status("starting", serve_url=endpoint.url)
            while not self.stopping.is_set():
                outcome = self._run_one(cmd, rounds)
                if self.stopping.is_set():
                    break
                decision = policy.decide(outcome)
                self._act(decision, outcome.detail)
                self.stopping.wait(decision.delay)
        finally:
            if endpoint is not None:
                endpoint.stop()
            if self.node is not None:
                self.node.end(grace=10)
            rounds.poll()
            rounds.flush()
            try:
                self._write_status("stopped")
            except OSError:
                pass
        return EXIT_OK

    def _act(self, decision: Decision, detail: str) -> None:
        opts = self.opts
        if decision.stop:
            raise DaemonError(
                final_error(decision, opts.superlink, detail, opts.root_certificates, opts.auth_key), decision.code
            )
        if decision.state == "server-gone" and decision.first and self.gone_announced:
            detail = ""  # try 1 was announced when the connection failed; Flower's last error adds nothing new
        line = decision_line(decision, opts.superlink, detail, opts.refused_patience, opts.auth_key)
        if line:
            self.emit(line)
        self._write_status(decision.state, attempt=decision.attempt, limit=decision.limit)


def reset_ledger_command(state_dir: Path | None, yes: bool) -> int:
    """`fedla client reset-ledger`: start the device's privacy ledger over, on purpose (client.training.ledger.reset_ledger).

    Prints one line (what was done, or on stderr why not and what resetting means) and returns the
    exit code: 0, or EXIT_BAD_INPUT without --yes or without a state folder.
    """
    from client.training.ledger import reset_ledger

    try:
        print(reset_ledger(state_dir or default_state_dir(), yes=yes), flush=True)
    except FedLookaheadError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
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
