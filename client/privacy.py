"""Per-client differential privacy: Opacus DP-SGD on the heads, with accounting that composes across rounds.

The privacy unit is one chunk of the client's text. Base features are computed under no_grad from a
frozen (public) base, so only the head parameters see private gradients; Opacus clips each chunk's
gradient to `dp-max-grad-norm` and adds Gaussian noise, with Poisson sampling of batches.

Accounting: one RDP accountant per client and run, whose history [(sigma, q, steps), ...] persists
between rounds in `context.state` (simulation) and, when a state folder is configured (a device's
`state-dir` node config, or `client-state-dir` in simulation), in a JSON file there. The epsilon a
client reports is therefore the cumulative one, equal to a single continuous accountant; a fresh
PrivacyEngine per round (which forgets history) would under-report it.

The noise multiplier is chosen once per run, from the target epsilon and the steps of all planned
rounds, and kept in the same state. Before each round the client computes the epsilon it would have
after that round's steps; if that exceeds the target it does not train (and says so in its reply).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from flwr.app import ConfigRecord, Context
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as privacy_analysis
from opacus.accountants.utils import get_noise_multiplier

from common.base import BaseModel
from common.fedconfig import FedConfig
from common.heads import DraftHeads
from common.features import Features
from common.training import HeadMetrics, feature_loader, train_epoch

STATE_RECORD = "fedla-privacy"
EPSILON_SLACK = 1e-6  # float noise only; never a real allowance over the target


@dataclass
class PrivacyState:
    run_key: str
    noise_multiplier: float = 0.0  # 0: not chosen yet
    history: list[tuple[float, float, int]] = field(default_factory=list)

    def to_record(self) -> ConfigRecord:
        return ConfigRecord({
            "run-key": self.run_key,
            "noise-multiplier": float(self.noise_multiplier),
            "sigmas": [float(s) for s, _, _ in self.history],
            "rates": [float(q) for _, q, _ in self.history],
            "steps": [int(n) for _, _, n in self.history],
        })

    @classmethod
    def from_record(cls, record: ConfigRecord) -> PrivacyState:
        history = list(zip(map(float, record["sigmas"]), map(float, record["rates"]), map(int, record["steps"])))
        return cls(str(record["run-key"]), float(record["noise-multiplier"]), history)

    def to_json(self) -> dict:
        return {"run_key": self.run_key, "noise_multiplier": self.noise_multiplier,
                "history": [list(h) for h in self.history]}

    @classmethod
    def from_json(cls, data: dict) -> PrivacyState:
        return cls(data["run_key"], float(data["noise_multiplier"]),
                   [(float(s), float(q), int(n)) for s, q, n in data["history"]])


def epsilon_of(history: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon of an RDP accountant with this history (0 before any step).

    The same arithmetic as Opacus's RDPAccountant.get_epsilon (RDP composes additively, so each
    (sigma, q) mechanism's per-step RDP curve is computed once and scaled by its steps), cached per
    process because Opacus's fractional orders cost ~0.4 s per curve on this CPU.
    """
    if not history:
        return 0.0
    rdp = sum(_unit_rdp(float(s), float(q)) * int(n) for s, q, n in history)
    eps, _ = privacy_analysis.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    return float(eps)


@functools.lru_cache(maxsize=1024)
def _unit_rdp(sigma: float, q: float) -> np.ndarray:
    return privacy_analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS)


def state_file(config: FedConfig, node_config: dict, run_key: str) -> Path | None:
    """Where this client's accountant lives on disk, if anywhere."""
    safe_key = re.sub(r"[^A-Za-z0-9._-]", "_", run_key)
    if node_config.get("state-dir"):
        return Path(str(node_config["state-dir"])).expanduser() / f"privacy-{safe_key}.json"
    if config.client_state_dir:
        partition = int(node_config.get("partition-id", 0))
        return Path(config.client_state_dir).expanduser() / f"partition-{partition}" / f"privacy-{safe_key}.json"
    return None


def load_state(context: Context, path: Path | None, run_key: str) -> PrivacyState:
    """The disk copy when there is one (it survives restarts), else context.state, else a fresh state."""
    if path is not None and path.is_file():
        state = PrivacyState.from_json(json.loads(path.read_text()))
        if state.run_key == run_key:
            return state
    record = context.state.config_records.get(STATE_RECORD)
    if record is not None:
        state = PrivacyState.from_record(record)
        if state.run_key == run_key:
            return state
    return PrivacyState(run_key)


def save_state(context: Context, path: Path | None, state: PrivacyState) -> None:
    context.state.config_records[STATE_RECORD] = state.to_record()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state.to_json(), indent=1))
        os.replace(tmp, path)  # atomic: a crash leaves the old or the new history, never half


def plan(config: FedConfig, num_chunks: int) -> tuple[float, int]:
    """(q, steps per round) of Poisson sampling with expected batch `batch-size` (Opacus: q = 1/len(loader))."""
    batches = math.ceil(num_chunks / config.batch_size)
    return 1.0 / batches, config.local_epochs * batches


def choose_noise_multiplier(config: FedConfig, q: float, steps_per_round: int) -> float:
    """sigma for the whole planned run: target epsilon after `planned_rounds` rounds of this client's steps."""
    if config.dp_noise_multiplier > 0:
        return config.dp_noise_multiplier
    return _sigma(config.dp_target_epsilon, config.dp_delta, q, config.planned_rounds * steps_per_round)


@functools.lru_cache(maxsize=256)
def _sigma(target_epsilon: float, delta: float, q: float, steps: int) -> float:
    with warnings.catch_warnings():  # the search visits sigmas whose best RDP order is the largest one
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=q,
                                          steps=steps, accountant="rdp"))


@dataclass
class RoundResult:
    metrics: HeadMetrics | None
    epsilon: float
    q: float
    steps: int
    noise_multiplier: float
    skipped: str = ""  # non-empty: why this client did not train this round
    seconds: float = 0.0


def train_round(heads: DraftHeads, features: Features, config: FedConfig, state: PrivacyState | None) -> RoundResult:
    """One round of local training, in place on `heads`: DP-SGD (Opacus) or plain, per config.dp.

    Reads the chunks' cached base features (one row per chunk: the privacy unit). With DP, `state`
    is updated (history appended, sigma fixed on first use) only when training ran.
    """
    started = time.perf_counter()
    q, steps = plan(config, len(features))
    if not config.dp:
        optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr)
        metrics = HeadMetrics(heads.num_heads)
        for epoch in range(config.local_epochs):
            loader = feature_loader(features, config.batch_size, shuffle=True, seed=config.seed + epoch)
            metrics = train_epoch(heads, loader, optimizer, heads.num_heads, show_progress=False)
        return RoundResult(metrics, math.inf, q, steps, 0.0, seconds=time.perf_counter() - started)

    assert state is not None
    sigma = state.noise_multiplier or choose_noise_multiplier(config, q, steps)
    spent = epsilon_of(state.history, config.dp_delta)
    if config.dp_target_epsilon > 0:
        after = epsilon_of(state.history + [(sigma, q, steps)], config.dp_delta)
        if after > config.dp_target_epsilon + EPSILON_SLACK:
            return RoundResult(None, spent, q, 0, sigma, skipped=(
                f"privacy budget: this round would bring epsilon from {spent:.3f} to {after:.3f}, "
                f"above the target {config.dp_target_epsilon:g} (delta {config.dp_delta:g})"))

    engine = PrivacyEngine(accountant="rdp")
    engine.accountant.history = list(state.history)  # continue the run's accountant, not a fresh one
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr)  # the heads only: the base is frozen
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        warnings.filterwarnings("ignore", message=".*full_backward_hook.*")
        module, dp_optimizer, dp_loader = engine.make_private(
            module=heads, optimizer=optimizer, data_loader=feature_loader(features, config.batch_size, shuffle=False),
            noise_multiplier=sigma, max_grad_norm=config.dp_max_grad_norm, poisson_sampling=True)
        metrics = HeadMetrics(heads.num_heads)
        for _ in range(config.local_epochs):
            metrics = train_epoch(module, dp_loader, dp_optimizer, heads.num_heads, show_progress=False)
    module._close()  # remove Opacus's hooks from `heads` (the module is rebuilt next round anyway)
    state.noise_multiplier = sigma
    state.history = [tuple(h) for h in engine.accountant.history]
    return RoundResult(metrics, epsilon_of(state.history, config.dp_delta), q, steps, sigma,
                       seconds=time.perf_counter() - started)
