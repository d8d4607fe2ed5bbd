"""When to restart the SuperNode, and when to give up: a pure policy, no processes, no clock.

The daemon runs one `flower-supernode` at a time. Each time one exits, the daemon tells the policy how
that start ended (an `Outcome`: why, whether it had connected, when it began and ended) and gets a
`Decision` back: restart after `delay` seconds, or stop with an exit code. The SuperNode's log is
read elsewhere (client.daemon.supernode.classify); the words on screen are the reporter's.

The rules:

* **tls** (the SuperLink's certificate is not trusted) and **key** (Flower cannot read the node key)
  are final: retrying cannot fix them.
* **refused** ("Failed to activate SuperNode"): Flower gives this one answer both for a key that is
  not registered yet and for a node the SuperLink still counts online after a crash or a restart
  (up to two heartbeats, 60 s). The node is *waiting for registration*: it retries (every 1-10 s)
  for `refused_patience` seconds from the first refusal in a row, then stops (EXIT_REFUSED).
* **lost** (it had connected, then its own reconnection gave up): the *server is gone*. The
  SuperNode that lost the connection was try 1 of `restarts`; each new start is the next try,
  with exponential backoff, until `restarts` tries failed in a row (EXIT_UNREACHABLE).
* **unreachable** (never connected this start): `restarts` failed starts in a row, with
  exponential backoff (1, 2, 4, ... 60 s, jittered +-20%), then stop (EXIT_UNREACHABLE). After a
  lost connection these count as further tries of the same outage.
* A start that connected resets every count. `restarts=0` never gives up.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Literal

from client.daemon.options import EXIT_BAD_INPUT, EXIT_REFUSED, EXIT_TLS, EXIT_UNREACHABLE

Kind = Literal["tls", "key", "refused", "lost", "unreachable"]
MAX_BACKOFF = 60.0
LOST_RESTART_DELAY = 1.0


@dataclass(frozen=True)
class Outcome:
    """How one SuperNode start ended."""

    kind: Kind
    connected: bool  # it reached the SuperLink (and got a node id) during this start
    began: float  # seconds (any monotonic clock) when this start began
    ended: float  # ... and when it ended
    detail: str = ""  # Flower's most telling line


@dataclass(frozen=True)
class Decision:
    """Restart after `delay` (stop=False), or stop with `code`.

    `state` names the situation for the reporter and daemon.json: "waiting-registration",
    "server-gone", "unreachable" (restart), or "tls", "key", "refused", "gone", "unreachable" (stop).
    `attempt`/`limit` are the try this restart is (limit 0: no limit); `seconds` how long the
    situation has lasted.
    """

    stop: bool
    state: str
    delay: float = 0.0
    attempt: int = 0
    limit: int = 0
    seconds: float = 0.0
    code: int = 0
    first: bool = False  # the first decision of this situation (the reporter says it once)


class RestartPolicy:
    """The daemon's memory between SuperNode starts; `decide` is its only method that matters."""

    def __init__(self, restarts: int, refused_patience: float, jitter: Callable[[], float] | None = None) -> None:
        self.restarts = restarts
        self.refused_patience = refused_patience
        self.jitter = jitter or (lambda: 0.8 + 0.4 * random.random())
        self.failures = 0  # failed tries in a row (unreachable starts, plus the lost one)
        self.failing_since: float | None = None
        self.refused_since: float | None = None
        self.gone = False  # the current failures follow a lost connection

    def _backoff(self) -> float:
        return min(MAX_BACKOFF, 2.0 ** (self.failures - 1)) * self.jitter()

    def decide(self, outcome: Outcome) -> Decision:
        if outcome.connected:  # a start that connected ends any outage and any refusal streak
            self.failures, self.failing_since, self.refused_since, self.gone = 0, None, None, False
        if outcome.kind == "tls":
            return Decision(True, "tls", code=EXIT_TLS)
        if outcome.kind == "key":
            return Decision(True, "key", code=EXIT_BAD_INPUT)
        if outcome.kind == "refused":
            first = self.refused_since is None
            if first:
                self.refused_since = outcome.began
            waited = outcome.ended - self.refused_since
            if waited >= self.refused_patience:
                return Decision(True, "refused", seconds=waited, code=EXIT_REFUSED)
            delay = min(10.0, max(1.0, self.refused_patience - waited))
            return Decision(False, "waiting-registration", delay=delay, seconds=waited, first=first)
        self.refused_since = None
        if outcome.kind == "lost":  # the SuperNode that lost the connection retried on its own: try 1 failed
            self.gone, self.failures, self.failing_since = True, 1, outcome.ended
            if self.restarts == 1:
                return Decision(True, "gone", attempt=1, limit=1, code=EXIT_UNREACHABLE)
            return Decision(False, "server-gone", delay=LOST_RESTART_DELAY, attempt=2, limit=self.restarts, first=True)
        # unreachable: this start never connected
        self.failures += 1
        self.failing_since = self.failing_since if self.failing_since is not None else outcome.began
        waited = outcome.ended - self.failing_since
        if self.restarts and self.failures >= self.restarts:
            return Decision(
                True,
                "gone" if self.gone else "unreachable",
                attempt=self.failures,
                limit=self.restarts,
                seconds=waited,
                code=EXIT_UNREACHABLE,
            )
        if self.gone:
            return Decision(
                False,
                "server-gone",
                delay=self._backoff(),
                attempt=self.failures + 1,
                limit=self.restarts,
                seconds=waited,
            )
        return Decision(
            False,
            "unreachable",
            delay=self._backoff(),
            attempt=self.failures,
            limit=self.restarts,
            seconds=waited,
            first=self.failures == 1,
        )
