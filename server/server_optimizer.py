"""Server optimisers over the (secure) mean update: FedAvg, FedAvgM, FedAdam (Reddi et al., 2021).

The server only ever holds the SecAgg+ mean of the clients' new heads, `mean`, and the global heads
it sent, `current`. Their difference is the round's pseudo-gradient (negated), `delta = mean - current`:
FedAvg takes it as is (x <- mean); FedAvgM keeps a momentum of it (Hsu et al., 2019):
v <- beta v + delta, x <- x + lr v; FedAdam keeps Adam's moments of it: m <- b1 m + (1 - b1) delta,
v <- b2 v + (1 - b2) delta^2, x <- x + lr m / (sqrt(v) + tau).

Under DP this is post-processing of an already-private aggregate (the noise is in `mean`), so it
costs no privacy; momentum averages the noise of several rounds, which is why it is tried for DP
fine-tuning. Pure numpy functions of (state, current, mean); the state lives in the server process
for one run (a resumed run starts with fresh moments).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

OPTIMIZERS = ("fedavg", "fedavgm", "fedadam")


@dataclass
class ServerOptimizer:
    name: str = "fedavg"
    lr: float = 1.0
    momentum: float = 0.9  # FedAvgM's beta; FedAdam's beta1
    beta2: float = 0.99
    tau: float = 1e-3  # FedAdam's adaptivity (Reddi et al.: 1e-3 works across tasks)
    m: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown server optimizer {self.name!r}: use one of {OPTIMIZERS}")

    def step(self, current: list[np.ndarray], mean: list[np.ndarray]) -> list[np.ndarray]:
        """The new global arrays from the ones sent (`current`) and the clients' mean (`mean`)."""
        if self.name == "fedavg":
            return [np.asarray(a, dtype=np.float32) for a in mean]
        delta = [np.asarray(b, np.float64) - np.asarray(a, np.float64) for a, b in zip(current, mean)]
        if not self.m:
            self.m = [np.zeros_like(d) for d in delta]
            self.v = [np.zeros_like(d) for d in delta]
        out = []
        for i, (x, d) in enumerate(zip(current, delta)):
            if self.name == "fedavgm":
                self.m[i] = self.momentum * self.m[i] + d
                update = self.m[i]
            else:
                self.m[i] = self.momentum * self.m[i] + (1 - self.momentum) * d
                self.v[i] = self.beta2 * self.v[i] + (1 - self.beta2) * d * d
                update = self.m[i] / (np.sqrt(self.v[i]) + self.tau)
            out.append((np.asarray(x, np.float64) + self.lr * update).astype(np.float32))
        return out

    def checked_step(self, current: list[np.ndarray], mean: list[np.ndarray], bound: float) -> list[np.ndarray] | None:
        """`step`, or None (its state left as it was) when the new heads would not be finite within +-`bound`:
        momentum over noised means can carry the heads past where the clients would accept them."""
        saved = ([m.copy() for m in self.m], [v.copy() for v in self.v])
        new = self.step(current, mean)
        if all(np.all(np.isfinite(a)) and float(np.max(np.abs(a), initial=0.0)) <= bound for a in new):
            return new
        self.m, self.v = saved
        return None


def from_config(config) -> ServerOptimizer:
    """The optimiser a run config asks for (`server-optimizer`, `server-lr`, `server-momentum`)."""
    return ServerOptimizer(config.server_optimizer, config.server_lr, config.server_momentum)
