"""What the daemon tells the device's owner: one line per round, and the lifecycle lines.

Round lines come from <state>/events.jsonl (written by the ClientApp, client/events.py); lifecycle lines
from the restart policy's decisions (client.daemon.policy) and the SuperNode's output:

    connected to the SuperLink at HOST:PORT as node N
    waiting for registration: ...                  the SuperLink does not accept the node's key (yet)
    round R (run X): trained ..., epsilon e/B ...; global heads vV kept ...
    run X finished: heads vV kept                  the last round's heads arrived
    server gone; retrying (k/N) in S s             the connection was lost; try k of N
    SuperLink at HOST:PORT unreachable (...); retry k/N in S s   never connected yet
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from client.daemon.policy import Decision
from common.federation import protocol as P


def format_round(
    round_no, run, train: dict | None, heads: dict | None, evaluation: dict | None, budget: float | None
) -> str:
    """One log line for one round on this device."""
    parts = []
    if train is None:
        parts.append("not sampled for training")
    else:
        parts.append(format_training(train.get("metrics", {}), budget))
    if heads is not None:
        parts.append(f"global heads v{heads['version']} kept (sha256 {str(heads.get('sha256', ''))[:12]})")
    metrics = (evaluation or {}).get("metrics", {})
    if metrics.get(P.HEAD_ACCURACY):
        accuracy = ", ".join(f"{float(a):.2f}" for a in metrics[P.HEAD_ACCURACY])
        tau = metrics.get(P.TAU)
        parts.append(f"local eval acc [{accuracy}]" + (f" tau {float(tau):.2f}" if tau is not None else ""))
    return f"round {round_no} (run {run}): " + "; ".join(parts)


def format_training(metrics: dict, budget: float | None) -> str:
    """A train reply's metrics (common.federation.protocol keys) as the daemon reports them."""
    if metrics.get(P.SKIPPED):
        return f"declined training ({metrics.get(P.SKIP_REASON) or 'skipped'}); still connected"
    text = f"trained {int(metrics.get(P.NUM_TRAIN_CHUNKS, 0))} chunks"
    if P.LOSS in metrics:
        text += f", loss {float(metrics[P.LOSS]):.3f}"
    if f"{P.ACC_PREFIX}1" in metrics:
        text += f", head-1 acc {float(metrics[f'{P.ACC_PREFIX}1']):.3f}"
    if metrics.get(P.DP):
        budget_text = f"/{budget:g}" if budget else ""
        text += f", epsilon {float(metrics.get(P.EPSILON, 0.0)):.3f}{budget_text} (delta {float(metrics.get(P.DELTA, 0)):g})"
    else:
        text += ", no DP"
    return text + f", {float(metrics.get(P.TRAIN_SECONDS, 0.0)):.1f}s"


def run_finished(run, version) -> str:
    return f"run {run} finished: heads v{version} kept"


class RoundLogger:
    """Follows <state>/events.jsonl and emits one line per round, and one when a run's last heads arrive."""

    def __init__(self, events: Path, emit: Callable[[str], None], budget: float | None) -> None:
        self.events = events
        self.emit = emit
        self.budget = budget
        self.offset = events.stat().st_size if events.is_file() else 0
        self.pending: dict | None = None
        self.names: dict = {}  # Flower run id -> FedLookahead run id (from train-start events)
        self.kept: dict = {}  # Flower run id -> newest heads version kept
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
                except (ValueError, KeyError, TypeError):
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
        run = event.get("run")
        if kind == "train-start":
            self._current(event)
            if event.get("fedla_run"):
                self.names[run] = event["fedla_run"]
        elif kind == "train-done":
            self._current(event)["train"] = event
        elif kind == "heads":  # kept from a train message (previous version) or an evaluate message (new one)
            self._current(event)["heads"] = event
            self.kept[run] = max(int(event["version"]), self.kept.get(run, 0))
        elif kind == "eval":
            self._current(event)["eval"] = event
            self.flush()
            if event.get("final"):
                version = self.kept.get(run, event.get("version"))
                self.emit(run_finished(self.names.get(run, run), version))

    def flush(self) -> None:
        if self.pending is None:
            return
        run, round_no = self.pending["key"]
        line = format_round(
            round_no, run, self.pending["train"], self.pending["heads"], self.pending["eval"], self.budget
        )
        self.pending = None
        self.emit(line)


def server_gone(attempt: int, limit: int, delay: float | None = None) -> str:
    tries = f"{attempt}/{limit}" if limit else f"{attempt}"
    return f"server gone; retrying ({tries})" + (f" in {delay:.1f}s" if delay is not None else "")


def decision_line(
    decision: Decision, superlink: str, detail: str, patience: float, auth_key: Path | None
) -> str | None:
    """The line a restart decision is worth, or None when it would only repeat the last one."""
    if decision.state == "waiting-registration":
        if not decision.first:
            return None
        key = f"{auth_key}.pub" if auth_key else "this node's public key"
        return (
            f"waiting for registration: the SuperLink at {superlink} does not accept this node yet (the operator "
            f"runs `flwr supernode register {key}`; a node that was just connected is also refused until the "
            f"SuperLink marks it offline); retrying for up to {patience:.0f}s"
        )
    if decision.state == "server-gone":
        return server_gone(decision.attempt, decision.limit, decision.delay) + (
            f" (last error: {detail})" if detail else ""
        )
    if decision.state == "unreachable":
        return (
            f"SuperLink at {superlink} unreachable ({detail or 'no answer'}); "
            f"retry {decision.attempt}/{decision.limit or 'unlimited'} in {decision.delay:.1f}s"
        )
    return None


def final_error(
    decision: Decision, superlink: str, detail: str, root_certificates: Path | None, auth_key: Path | None
) -> str:
    """The one-line error of a decision to stop."""
    if decision.state == "tls":
        return (
            f"TLS to {superlink} failed: the SuperLink's certificate is not trusted by "
            f"{root_certificates or 'the system CA store'} or does not name this host ({detail})"
        )
    if decision.state == "key":
        return f"flower-supernode could not read the key {auth_key}: {detail}"
    if decision.state == "refused":
        return (
            f"the SuperLink at {superlink} refused this node for {decision.seconds:.0f}s: its key {auth_key} is "
            f"not registered there (the operator runs `flwr supernode register {auth_key}.pub`; see docs/deploy.md)"
        )
    return (
        ("server gone: " if decision.state == "gone" else "")
        + f"cannot reach the SuperLink at {superlink}: {decision.attempt} attempt(s) over "
        f"{decision.seconds:.0f}s failed (last error: {detail or 'no answer'})"
    )
