"""Per-client differential privacy: Opacus DP-SGD on the heads, with accounting that composes across rounds.

The privacy unit is one chunk of the client's text. Base features are computed under no_grad from a
frozen (public) base, so only the head parameters see private gradients; Opacus clips each chunk's
gradient to `dp-max-grad-norm` and adds Gaussian noise, with Poisson sampling of batches.

Accounting is Opacus's RDP accountant over a history [(sigma, q, steps), ...] that persists between
rounds, so the epsilon a client reports is the cumulative one (a fresh PrivacyEngine per round,
which forgets history, would under-report it). The noise multiplier is chosen once per run, from the
target epsilon and the steps of all planned rounds. Before each round the client computes the
epsilon it would have after that round's steps; if that exceeds its budget it does not train (and
says so in its reply).

Two regimes:

* A device (`fedla client`: node config `state-dir`) is governed by its own settings, a floor the
  server's run config can make stricter but never weaker (`DeviceFloor`): DP is always on, delta and
  the clipping norm are capped, the noise multiplier has a minimum, and the epsilon budget is the
  device's lifetime one. Every run's history is kept in one ledger, <state-dir>/privacy-ledger.json,
  and all of them compose into the device's lifetime epsilon at the device's delta. A small marker,
  <state-dir>/trained-once, remembers that the device has trained and how many DP-SGD steps its
  ledger held; a ledger that is missing, unreadable or behind the marker stops training until the
  owner resets it on purpose (`reset_ledger`, i.e. `fedla client reset-ledger`).
* A simulated client (no `state-dir`) follows the run config: one history per run, in
  `context.state` and, with `client-state-dir`, in a JSON file per partition and run.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from flwr.app import ConfigRecord, Context
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from opacus.utils.batch_memory_manager import BatchMemoryManager

from client.state import LEDGER_LOCK, StateLocked, state_lock
from common.data.features import Features
from common.errors import FedLookaheadError
from common.federation.config import MIN_CHUNK_LEN, FedConfig
from common.heads.lookahead import DraftHeads
from common.heads.lowrank import low_rank_updates
from common.training.loop import HeadMetrics, feature_loader, train_epoch

STATE_RECORD = "fedla-privacy"
EPSILON_SLACK = 1e-6  # float noise only; never a real allowance over the target

History = list[tuple[float, float, int]]


@dataclass
class PrivacyState:
    run_key: str
    noise_multiplier: float = 0.0  # 0: not chosen yet
    history: History = field(default_factory=list)

    def to_record(self) -> ConfigRecord:
        return ConfigRecord(
            {
                "run-key": self.run_key,
                "noise-multiplier": float(self.noise_multiplier),
                "sigmas": [float(s) for s, _, _ in self.history],
                "rates": [float(q) for _, q, _ in self.history],
                "steps": [int(n) for _, _, n in self.history],
            }
        )

    @classmethod
    def from_record(cls, record: ConfigRecord) -> PrivacyState:
        history = list(zip(map(float, record["sigmas"]), map(float, record["rates"]), map(int, record["steps"])))
        return cls(str(record["run-key"]), float(record["noise-multiplier"]), history)

    def to_json(self) -> dict:
        return {
            "run_key": self.run_key,
            "noise_multiplier": self.noise_multiplier,
            "history": [list(h) for h in self.history],
        }

    @classmethod
    def from_json(cls, data: dict) -> PrivacyState:
        return cls(
            data["run_key"],
            float(data["noise_multiplier"]),
            [(float(s), float(q), int(n)) for s, q, n in data["history"]],
        )


def epsilon_of(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """Epsilon of Opacus's RDP accountant over this history (0 before any step).

    Entries with the same (sigma, q) are handed to the accountant as one, with their steps summed, as
    RDPAccountant.step itself does for consecutive steps (RDP composes additively, in any order): a
    device's lifetime history repeats the same few mechanisms over many runs, and each distinct one
    costs the accountant ~0.1 s.
    """
    if not history:
        return 0.0
    steps: dict[tuple[float, float], int] = {}
    for sigma, q, n in history:
        steps[(float(sigma), float(q))] = steps.get((float(sigma), float(q)), 0) + int(n)
    accountant = RDPAccountant()
    accountant.history = [(sigma, q, n) for (sigma, q), n in steps.items()]
    return float(accountant.get_epsilon(delta))


# ----------------------------------------------------------------------------------- simulation


def state_file(config: FedConfig, node_config: Mapping[str, Any], run_key: str) -> Path | None:
    """Where a simulated client's accountant for this run lives on disk (`client-state-dir`), if anywhere."""
    if not config.client_state_dir:
        return None
    safe_key = re.sub(r"[^A-Za-z0-9._-]", "_", run_key)
    partition = int(node_config.get("partition-id", 0))
    return Path(config.client_state_dir).expanduser() / f"partition-{partition}" / f"privacy-{safe_key}.json"


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
        _write_json(path, state.to_json())


def _write_json(path: Path, data: dict) -> None:
    """Atomically and durably: a crash or a power cut leaves the old or the new file, never half of one,
    and once this returns the new one is on disk (a device's update leaves only after its ledger is)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(data, indent=1))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself
    finally:
        os.close(folder)


def _remove_stale_temporaries(state_dir: Path) -> None:
    """Temporary ledger and marker files a killed writer left (called under the ledger lock, so no writer
    is running)."""
    for name in (LEDGER_FILE, TRAINED_MARKER):
        for tmp in state_dir.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------- devices

# node config keys of a device's privacy floor (written by `fedla client`, see client.daemon)
BUDGET_KEY = "budget-epsilon"
MAX_DELTA_KEY = "max-dp-delta"
MAX_GRAD_NORM_KEY = "max-dp-grad-norm"
MIN_NOISE_KEY = "min-dp-noise-multiplier"
MIN_CHUNK_LEN_KEY = "min-chunk-len"

LEDGER_FILE = "privacy-ledger.json"
TRAINED_MARKER = "trained-once"
LEDGER_FORMAT = "fedla-privacy-ledger/1"
LEDGER_WAIT_SECONDS = 600.0  # how long a round waits for another round (or a reset) to release the ledger


@dataclass(frozen=True)
class DeviceFloor:
    """A device's own privacy settings: the server's run config may be stricter, never weaker."""

    state_dir: Path
    budget_epsilon: float = 8.0  # lifetime epsilon of this device and its data, at `delta`, over all runs
    delta: float = 1e-5  # the largest delta it accepts; its lifetime epsilon is accounted at this delta
    max_grad_norm: float = 1.0  # the largest per-chunk clipping norm it accepts
    min_noise_multiplier: float = 0.5  # the smallest sigma it trains with
    min_chunk_len: int = 32  # the fewest tokens one privacy unit (a chunk) holds: epsilon protects a chunk

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> DeviceFloor | None:
        """The floor of a device (its node config has a `state-dir`); None for a simulated client."""
        state_dir = str(node_config.get("state-dir", "") or "")
        if not state_dir:
            return None
        defaults = cls(Path(state_dir))
        values = {}
        for key, name in (
            (BUDGET_KEY, "budget_epsilon"),
            (MAX_DELTA_KEY, "delta"),
            (MAX_GRAD_NORM_KEY, "max_grad_norm"),
            (MIN_NOISE_KEY, "min_noise_multiplier"),
            (MIN_CHUNK_LEN_KEY, "min_chunk_len"),
        ):
            value = node_config.get(key, getattr(defaults, name))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise FedLookaheadError(f"node config {key} must be a finite number, got {value!r}")
            values[name] = float(value)
        floor = replace(defaults, state_dir=Path(state_dir).expanduser(), **values)
        if not floor.budget_epsilon > 0:
            raise FedLookaheadError(f"node config {BUDGET_KEY} must be positive, got {floor.budget_epsilon:g}")
        if not 0 < floor.delta < 1:
            raise FedLookaheadError(f"node config {MAX_DELTA_KEY} must be in (0, 1), got {floor.delta:g}")
        if not floor.max_grad_norm > 0:
            raise FedLookaheadError(f"node config {MAX_GRAD_NORM_KEY} must be positive, got {floor.max_grad_norm:g}")
        if floor.min_noise_multiplier < 0:
            raise FedLookaheadError(
                f"node config {MIN_NOISE_KEY} must not be negative, got {floor.min_noise_multiplier:g}"
            )
        if floor.min_chunk_len != int(floor.min_chunk_len) or floor.min_chunk_len < MIN_CHUNK_LEN:
            raise FedLookaheadError(
                f"node config {MIN_CHUNK_LEN_KEY} must be a whole number of at least {MIN_CHUNK_LEN} tokens, "
                f"got {floor.min_chunk_len:g}"
            )
        return replace(floor, min_chunk_len=int(floor.min_chunk_len))

    def apply(self, config: FedConfig) -> FedConfig:
        """The run config, made no weaker than this floor (sigma's minimum is applied in train_round)."""
        run_dp = config.dp
        target = config.dp_target_epsilon if run_dp and config.dp_target_epsilon > 0 else self.budget_epsilon
        return replace(
            config,
            dp=True,
            dp_target_epsilon=min(target, self.budget_epsilon),
            dp_delta=config.dp_delta if run_dp and 0 < config.dp_delta < self.delta else self.delta,
            dp_max_grad_norm=min(config.dp_max_grad_norm, self.max_grad_norm),
            dp_noise_multiplier=config.dp_noise_multiplier if run_dp else 0.0,
            # a run asking for 2-token chunks would report the same epsilon for protecting almost nothing
            chunk_len=max(config.chunk_len, self.min_chunk_len),
        )


class LedgerError(FedLookaheadError):
    """A device's privacy ledger cannot be trusted: it does not train until its owner resets the ledger."""


@dataclass
class Ledger:
    """A device's lifetime privacy spending: every run's accountant history, in one file."""

    state_dir: Path
    runs: dict[str, PrivacyState] = field(default_factory=dict)
    resets: list[dict] = field(default_factory=list)
    first_trained: str | None = None  # from the trained-once marker

    @property
    def path(self) -> Path:
        return self.state_dir / LEDGER_FILE

    def run(self, run_key: str) -> PrivacyState:
        return self.runs.setdefault(run_key, PrivacyState(run_key))

    def history(self, excluding: str | None = None) -> History:
        """Every run's history, concatenated (the device's lifetime), or every run's but one."""
        return [h for key, state in self.runs.items() if key != excluding for h in state.history]

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self.history())


def _reset_hint(state_dir: Path) -> str:
    return (
        f"this device does not train until its owner resets the ledger on purpose: "
        f"`fedla client reset-ledger --state-dir {state_dir} --yes`"
    )


def _read_marker(state_dir: Path) -> dict | None:
    path = state_dir / TRAINED_MARKER
    if not path.exists():
        return None
    try:
        marker = json.loads(path.read_text())
        int(marker["steps"])
        return marker
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LedgerError(
            f"privacy marker {path} is unreadable ({_first_line(exc)}); {_reset_hint(state_dir)}"
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def load_ledger(state_dir: Path) -> Ledger:
    """The device's ledger (empty before it ever trained); LedgerError when it cannot be trusted.

    That is when it is unreadable, or when the trained-once marker says the device has trained and
    the ledger is missing or holds fewer DP-SGD steps than the device has taken (deleted, replaced by
    an empty or older copy): reading it as 0 would give the device's budget back silently.
    """
    state_dir = state_dir.expanduser()
    marker = _read_marker(state_dir)
    ledger = Ledger(state_dir, first_trained=marker.get("first_trained") if marker else None)
    if not ledger.path.exists():
        if marker is not None:
            raise LedgerError(
                f"privacy ledger {ledger.path} is missing but this device has trained "
                f"(since {ledger.first_trained}); {_reset_hint(state_dir)}"
            )
        return ledger
    try:
        data = json.loads(ledger.path.read_text())
        if data.get("format") != LEDGER_FORMAT:
            raise ValueError(f"not a {LEDGER_FORMAT} file")
        ledger.runs = {key: PrivacyState.from_json({"run_key": key, **run}) for key, run in data["runs"].items()}
        ledger.resets = list(data.get("resets", []))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LedgerError(
            f"privacy ledger {ledger.path} is unreadable ({_first_line(exc)}); {_reset_hint(state_dir)}"
        ) from exc
    if marker is not None and ledger.steps < int(marker["steps"]):
        raise LedgerError(
            f"privacy ledger {ledger.path} holds {ledger.steps} DP-SGD steps but this device has "
            f"taken {int(marker['steps'])}; {_reset_hint(state_dir)}"
        )
    return ledger


def save_ledger(ledger: Ledger) -> None:
    """Write the ledger, then the trained-once marker that guards it (in this order: a crash in between
    leaves a ledger ahead of its marker, which is accepted)."""
    now = _utc_now()
    ledger.first_trained = ledger.first_trained or now
    _write_json(
        ledger.path,
        {
            "format": LEDGER_FORMAT,
            "runs": {
                key: {"noise_multiplier": s.noise_multiplier, "history": [list(h) for h in s.history]}
                for key, s in ledger.runs.items()
            },
            "resets": ledger.resets,
            "updated": now,
        },
    )
    _write_json(
        ledger.state_dir / TRAINED_MARKER,
        {"first_trained": ledger.first_trained, "updated": now, "steps": ledger.steps},
    )


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def reset_ledger(state_dir: Path, yes: bool = False) -> str:
    """Start a device's privacy ledger over, on purpose (`fedla client reset-ledger --state-dir DIR --yes`).

    This forgets what the device has spent so far, so its whole budget is available again; the privacy
    its past updates cost does not go away (the server and anyone who saw those updates keep them).
    The old ledger, when there is one, is kept beside it as privacy-ledger.json.reset-<time>, and the
    reset is recorded in the new one. Without `yes` nothing changes and FedLookaheadError says what
    resetting means. A round in progress holds the ledger lock: the reset waits for it to finish.
    Returns one line saying what was done.
    """
    state_dir = state_dir.expanduser()
    path = state_dir / LEDGER_FILE
    if not yes:
        raise FedLookaheadError(
            f"resetting {path} forgets this device's past privacy spending and makes its whole budget available "
            f"again, although the privacy its past updates cost does not go away; add --yes to reset it"
        )
    if not state_dir.is_dir():
        raise FedLookaheadError(f"state folder not found: {state_dir}")
    try:
        with state_lock(state_dir, LEDGER_LOCK, wait_seconds=LEDGER_WAIT_SECONDS):  # never under a running round
            return _reset_ledger(state_dir, path)
    except StateLocked as exc:
        raise FedLookaheadError(f"cannot reset {path}: a round still holds it ({exc})") from None


def _reset_ledger(state_dir: Path, path: Path) -> str:
    _remove_stale_temporaries(state_dir)
    try:
        marker = _read_marker(state_dir)
    except LedgerError:
        marker = None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept = path.with_name(f"{path.name}.reset-{stamp}") if path.exists() else None
    if kept is not None:
        os.replace(path, kept)
    forgotten = int(marker["steps"]) if marker else None
    ledger = Ledger(
        state_dir,
        first_trained=marker.get("first_trained") if marker else None,
        resets=[{"time": _utc_now(), "forgotten_steps": forgotten, "old_ledger": str(kept) if kept else None}],
    )
    save_ledger(ledger)
    return (
        f"privacy ledger {path} reset: past spending forgotten"
        + (f" ({forgotten} DP-SGD steps)" if forgotten is not None else "")
        + (f", old ledger kept as {kept.name}" if kept else "")
        + "; the device's real privacy loss from past updates remains"
    )


# ----------------------------------------------------------------------------------- training


PHYSICAL_BATCH = 64  # chunks per forward under DP-SGD: bounds the memory of per-sample gradients


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
        return float(
            get_noise_multiplier(
                target_epsilon=target_epsilon, target_delta=delta, sample_rate=q, steps=steps, accountant="rdp"
            )
        )


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
) -> RoundResult:
    """One round of local training, in place on `heads`: DP-SGD (Opacus) or plain, per config.dp.

    Reads the chunks' cached base features (one row per chunk: the privacy unit). With DP, `state`
    is updated (history appended, sigma fixed on first use) only when training ran. On a device
    (`floor`, with `config` already passed through `floor.apply`), sigma is at least the floor's and
    the round is declined when it would bring the lifetime epsilon (`earlier` runs plus this one, at
    the floor's delta) above the floor's budget.
    """
    started = time.perf_counter()
    q, steps = plan(config, len(features))
    if not config.dp:
        metrics = HeadMetrics(heads.num_heads)
        with trained_parameters(heads, config) as trainable:
            optimizer = torch.optim.AdamW(trainable, lr=config.lr)
            for epoch in range(config.local_epochs):
                loader = feature_loader(features, config.batch_size, shuffle=True, seed=config.seed + epoch)
                metrics = train_epoch(heads, loader, optimizer, heads.num_heads, show_progress=False)
        return RoundResult(metrics, math.inf, q, steps, 0.0, seconds=time.perf_counter() - started)

    assert state is not None
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

    if config.dp_target_epsilon > 0:
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
    heads: DraftHeads, features: Features, config: FedConfig, floor: DeviceFloor, run_key: str
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
        with state_lock(floor.state_dir, LEDGER_LOCK, wait_seconds=LEDGER_WAIT_SECONDS):
            _remove_stale_temporaries(floor.state_dir)
            try:
                ledger = load_ledger(floor.state_dir)
            except LedgerError as exc:
                return declined(str(exc))
            history = ledger.history(excluding=run_key)
            result = train_round(heads, features, config, ledger.run(run_key), floor, history)
            if not result.skipped:
                save_ledger(ledger)  # durable before the update leaves (the reply is built after this returns)
            return result
    except StateLocked as exc:
        return declined(f"privacy ledger busy for {LEDGER_WAIT_SECONDS:g}s: {exc}")
