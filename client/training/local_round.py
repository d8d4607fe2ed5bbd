"""One round of local training on the heads: DP-SGD (Opacus) or plain, and, on a device, under its ledger.

Two regimes: a device (node config `state-dir`) trains under its privacy floor (client/training/floor.py)
and its lifetime ledger (client/training/ledger.py), through `device_round`; a simulated client follows
the run config, with one accountant per run (client/training/run_state.py), through `train_round`.
"""

from __future__ import annotations

import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager

from client.state import StateDir, StateLocked, state_lock
from client.training.dp import EPSILON_SLACK, History, PrivacyState, choose_noise_multiplier, epsilon_of, plan
from client.training.floor import DeviceFloor, UserNoise
from client.training.ledger import LEDGER_WAIT_SECONDS, LedgerError, load_ledger, remove_stale_temporaries, save_ledger
from common.data.features import Features
from common.federation.config import FedConfig
from common.heads.lookahead import DraftHeads
from common.heads.lowrank import low_rank_updates
from common.training.loop import HeadMetrics, feature_loader, train_epoch
from common.training.preconditioner import PreconditionedSGD, Preconditioner

PHYSICAL_BATCH = 64  # chunks per forward under DP-SGD: bounds the memory of per-sample gradients


def trainable_parameters(heads: DraftHeads, which: str = "all") -> list[torch.nn.Parameter]:
    """The head parameters a round trains (`dp-trainable`: all | fusion | blocks, the eagle layer counting
    as the blocks); the rest stay frozen, so under DP-SGD the same noise is spread over fewer coordinates."""
    prefix = "layer" if which == "blocks" and heads.eagle else which
    for name, parameter in heads.named_parameters():
        parameter.requires_grad_(which == "all" or name.startswith(prefix))
    return [p for p in heads.parameters() if p.requires_grad]


@contextmanager
def trained_parameters(heads: DraftHeads, config: FedConfig) -> Iterator[list[torch.nn.Parameter]]:
    """What this round trains: a subset of the heads' parameters, or (dp-trainable=lowrank) rank-r
    updates of every Linear, merged into the heads when the round ends (common/heads/lowrank.py)."""
    if config.dp_trainable != "lowrank":
        yield trainable_parameters(heads, config.dp_trainable)
        return
    with low_rank_updates(heads, config.dp_rank, seed=config.seed) as parameters:
        yield parameters


def train_plainly(
    heads: DraftHeads, features: Features, config: FedConfig, preconditioner: Preconditioner | None = None
) -> HeadMetrics:
    """Local epochs of the client optimizer on the heads, in place, without per-chunk noise: AdamW, or with
    `preconditioner` (client-optimizer=public-sgd) SGD scaled by the public gradients' rms."""
    metrics = HeadMetrics(heads.num_heads)
    with trained_parameters(heads, config) as trainable:
        if preconditioner is None:
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(trainable, lr=config.lr)
        else:
            named = [(name, p) for name, p in heads.named_parameters() if p.requires_grad]
            optimizer = PreconditionedSGD(named, preconditioner.denominators(), config.lr)
        for epoch in range(config.local_epochs):
            loader = feature_loader(features, config.batch_size, shuffle=True, seed=config.seed + epoch)
            metrics = train_epoch(heads, loader, optimizer, heads.num_heads, show_progress=False)
    return metrics


@dataclass
class RoundResult:
    metrics: HeadMetrics | None
    epsilon: float  # a device's lifetime epsilon, else the run's (inf: no DP, or spending unknown)
    q: float
    steps: int
    noise_multiplier: float
    delta: float = 0.0  # the delta of `epsilon` (0: no DP)
    skipped: str = ""  # non-empty: why this client did not train this round
    seconds: float = 0.0


def train_round(
    heads: DraftHeads,
    features: Features,
    config: FedConfig,
    state: PrivacyState | None,
    floor: DeviceFloor | None = None,
    earlier: History | None = None,
    user: UserNoise | None = None,
    preconditioner: Preconditioner | None = None,
) -> RoundResult:
    """One round of local training, in place on `heads`: DP-SGD (Opacus) or plain, per config.dp; `user`
    given (a device's user-level round): trained plainly, one round of that mechanism charged. A plain round
    steps with `preconditioner` when the server sent one (client-optimizer=public-sgd).

    Reads the chunks' cached base features (one row per chunk: the privacy unit). With DP, `state`
    is updated (history appended, sigma fixed on first use) only when training ran. On a device
    (`floor`, with `config` already passed through `floor.apply`), sigma is at least the floor's and
    the round is declined when it would bring the lifetime epsilon (`earlier` runs plus this one, at
    the floor's delta) above the floor's budget.
    """
    started = time.perf_counter()
    q, steps = plan(config, len(features))
    if not config.dp:
        metrics = train_plainly(heads, features, config, preconditioner)
        return RoundResult(metrics, math.inf, q, steps, 0.0, seconds=time.perf_counter() - started)

    assert state is not None
    if user is not None:  # one sampled Gaussian round on the whole user's update (its share: client/noise_share.py)
        sigma, q = user.charged, user.sample_rate
        this_round = [(sigma, q, 1)]
    else:
        sigma = state.noise_multiplier or choose_noise_multiplier(config, q, steps)
        if floor is not None:
            sigma = max(sigma, floor.min_noise_multiplier)
        this_round = [(sigma, q, steps)]
    prior = list(earlier or [])

    def spent(history: History) -> tuple[float, float]:
        """(epsilon reported, its delta): the device's lifetime one, else the run's."""
        if floor is not None:
            return epsilon_of(prior + history, floor.delta), floor.delta
        return epsilon_of(history, config.dp_delta), config.dp_delta

    now, delta = spent(state.history)

    def declined(reason: str) -> RoundResult:
        return RoundResult(None, now, q, 0, sigma, delta, skipped=f"privacy budget: this round would bring {reason}")

    if config.dp_target_epsilon > 0 and user is None:  # a user-level run's own accounting is the server's
        after = epsilon_of(state.history + this_round, config.dp_delta)
        if after > config.dp_target_epsilon + EPSILON_SLACK:
            return declined(
                f"the run's epsilon from {epsilon_of(state.history, config.dp_delta):.3f} to {after:.3f}, "
                f"above the target {config.dp_target_epsilon:g} (delta {config.dp_delta:g})"
            )
    if floor is not None:
        after, _ = spent(state.history + this_round)
        if after > floor.budget_epsilon + EPSILON_SLACK:
            return declined(
                f"the device's lifetime epsilon from {now:.3f} to {after:.3f}, "
                f"above its budget {floor.budget_epsilon:g} (delta {floor.delta:g})"
            )

    if user is not None:
        metrics = train_plainly(heads, features, config, preconditioner)
        state.level = "user" if state.level == "user" or not state.history else "mixed"
        state.noise_multiplier = sigma
        state.history = state.history + this_round
        epsilon, delta = spent(state.history)
        return RoundResult(metrics, epsilon, q, steps, sigma, delta, seconds=time.perf_counter() - started)

    engine = PrivacyEngine(accountant="rdp")
    engine.accountant.history = list(state.history)  # continue the run's accountant, not a fresh one
    heads.train()  # Opacus refuses a module in eval mode, which is how the previous round left it
    with trained_parameters(heads, config) as trainable, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        warnings.filterwarnings("ignore", message=".*full_backward_hook.*")
        module, dp_optimizer, dp_loader = engine.make_private(
            module=heads,
            optimizer=torch.optim.AdamW(trainable, lr=config.lr),  # the heads only: the base is frozen
            data_loader=feature_loader(features, config.batch_size, shuffle=False),
            noise_multiplier=sigma,
            max_grad_norm=config.dp_max_grad_norm,
            poisson_sampling=True,
        )
        metrics = HeadMetrics(heads.num_heads)
        # a large expected batch is taken in physical pieces (one noisy step per logical batch)
        with BatchMemoryManager(
            data_loader=dp_loader, max_physical_batch_size=PHYSICAL_BATCH, optimizer=dp_optimizer
        ) as loader:
            for _ in range(config.local_epochs):
                metrics = train_epoch(module, loader, dp_optimizer, heads.num_heads, show_progress=False)
        module._close()  # remove Opacus's hooks from `heads` (the module is rebuilt next round anyway)
    state.noise_multiplier = sigma
    state.history = [tuple(h) for h in engine.accountant.history]
    epsilon, delta = spent(state.history)
    return RoundResult(metrics, epsilon, q, steps, sigma, delta, seconds=time.perf_counter() - started)


def device_round(
    heads: DraftHeads,
    features: Features,
    config: FedConfig,
    floor: DeviceFloor,
    run_key: str,
    user: UserNoise | None = None,
    preconditioner: Preconditioner | None = None,
) -> RoundResult:
    """One round on a device: its ledger is read, the round trained (or declined) and the ledger saved.

    A ledger that cannot be trusted declines the round, with the reason, and reports epsilon as
    unbounded (the device's spending is unknown).
    """

    def declined(reason: str) -> RoundResult:
        return RoundResult(None, math.inf, plan(config, len(features))[0], 0, 0.0, floor.delta, skipped=reason)

    # Read, train and write under one lock: two rounds at once (two runs, or a second daemon) would
    # otherwise both start from the same ledger and the last writer would erase the other's spending.
    try:
        with state_lock(floor.state_dir, StateDir.LEDGER_LOCK, wait_seconds=LEDGER_WAIT_SECONDS):
            remove_stale_temporaries(floor.state_dir)
            try:
                ledger = load_ledger(floor.state_dir)
            except LedgerError as exc:
                return declined(str(exc))
            history = ledger.history(excluding=run_key)
            result = train_round(heads, features, config, ledger.run(run_key), floor, history, user, preconditioner)
            if not result.skipped:
                save_ledger(ledger)  # durable before the update leaves (the reply is built after this returns)
            return result
    except StateLocked as exc:
        return declined(f"privacy ledger busy for {LEDGER_WAIT_SECONDS:g}s: {exc}")
