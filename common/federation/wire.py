"""How heads and updates travel, and the SecAgg+ parameters that follow, by rule, from the cohort.

Down, the global heads are encoded by `heads-codec` and the train config names the codec:
float32 (as they are), float16, or int8 (every INT8_GROUP values scaled by their largest magnitude, the
scales in float32: 1.125 bytes a weight). A client decodes them before anything reads them (client/client_app.py) and
trains from exactly what it decoded; the server keeps the float32 master copy and adds the clients' mean
update to it.

Up, a client sends its update, new heads minus the heads it decoded, never its heads: updates are small
and centred, so they survive coarse quantization that weights would not. In plain FedAvg it travels in
the same int8 layout, rounded stochastically (unbiased: the errors average out over the cohort). Under SecAgg+, Flower's `secaggplus_mod` quantizes it over +-`clipping_range` into
`quantization_range` levels and masks it modulo `modulus_range`; the masked integers travel in the
unsigned type as wide as the modulus (`masked_dtype`: 2 bytes a value up to 257 clients), in which Flower's
own sums on the server wrap exactly modulo the modulus: the server never widens them (a 256-client round
holds 256 masked vectors at once).

`secagg_plan` sets everything SecAgg+ needs from the cohort (module constants say why each rule):
  shares k      every client masks with k - 1 neighbours (SecAgg+, Bell et al. 2020: O(log n) instead of
                all n - 1): k = 2 ceil(log2 n) + 1, at most n. Each neighbour costs a client one pseudo-random
                mask of the whole update, so k sets the protocol's compute.
  threshold t   the largest t for which a round aborts (some node keeps fewer than t live neighbours) with
                probability at most ABORT_PROBABILITY when `secagg-max-dropout` of the cohort drops, at
                least 2. A server colluding with t of a node's neighbours could unmask it: t is the privacy.
  clipping c    the largest move of one coordinate an honest client makes in a round: AdamW's per-step
                bound times its steps (FedConfig.update_bound); under an update-max-norm clip,
                COORDINATE_SPREAD times the clip's per-coordinate share (a clipped update is spread over
                every coordinate).
  levels q      as many as the modulus holds for n clients: floor((modulus - 1) / n), the modulus 2**16
                when that leaves at least MIN_LEVELS levels, else 2**32 (capped at Flower's default 2**22).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from common.errors import FedLookaheadError
from common.federation.config import HEADS_CODECS, FedConfig

INT8_GROUP = 32  # values per int8 scale: per-row scales cost 0.007 of head-1 accuracy, 32 values 0.0006
ABORT_PROBABILITY = 1e-3  # per round, at the planned dropout rate
COORDINATE_SPREAD = 8.0  # a clipped update's largest coordinate, in units of its root-mean-square
MIN_LEVELS = 255  # 8 bits per client and coordinate: a quantization error far below the clients' spread
MAX_LEVELS = 1 << 22  # Flower's default quantization_range
SMALL_MODULUS, LARGE_MODULUS = 1 << 16, 1 << 32


def _to_int8(array: np.ndarray, rng: np.random.Generator | None) -> list[np.ndarray]:
    """(values, scales): int8 values shaped like `array`, one float32 scale (largest magnitude / 127) per
    INT8_GROUP consecutive values; rounded to nearest, or stochastically (unbiased) with `rng`."""
    flat = np.asarray(array, dtype=np.float32).ravel()
    groups = np.pad(flat, (0, -len(flat) % INT8_GROUP)).reshape(-1, INT8_GROUP)
    scales = np.abs(groups).max(axis=1, keepdims=True) / 127.0
    scales[scales == 0] = 1.0
    scaled = groups / scales
    rounded = np.floor(scaled + rng.random(scaled.shape)) if rng is not None else np.rint(scaled)
    values = np.clip(rounded, -127, 127).astype(np.int8).ravel()[: len(flat)]
    return [values.reshape(np.shape(array)), scales.ravel()]


def _from_int8(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    groups = -(-values.size // INT8_GROUP)
    if values.dtype != np.int8 or scales.shape != (groups,) or not np.isfinite(scales).all():
        raise FedLookaheadError(f"int8 arrays need int8 values and one finite scale per {INT8_GROUP} values")
    flat = np.pad(values.ravel().astype(np.float32), (0, -values.size % INT8_GROUP)).reshape(-1, INT8_GROUP)
    return (flat * scales.astype(np.float32)[:, None]).ravel()[: values.size].reshape(values.shape)


def _int8_pairs(arrays: list[np.ndarray]) -> list[np.ndarray]:
    if len(arrays) % 2:
        raise FedLookaheadError(f"int8 arrays come as (values, scales) pairs, got {len(arrays)} arrays")
    return [_from_int8(values, scales) for values, scales in zip(arrays[::2], arrays[1::2])]


def encode_heads(arrays: list[np.ndarray], codec: str) -> list[np.ndarray]:
    """The heads as they travel down: float32 or float16 arrays, or int8 (values, scales) pairs."""
    if codec == "float32":
        return [np.asarray(a, dtype=np.float32) for a in arrays]
    if codec == "float16":
        return [np.asarray(a, dtype=np.float16) for a in arrays]
    if codec == "int8":
        return [part for array in arrays for part in _to_int8(array, rng=None)]
    raise FedLookaheadError(f"unknown heads codec {codec!r}: use one of {', '.join(HEADS_CODECS)}")


def decode_heads(arrays: list[np.ndarray], codec: str) -> list[np.ndarray]:
    """float32 heads from `encode_heads(..., codec)`; a one-line error on anything else (their shapes are
    checked where they are loaded, common/federation/records.py)."""
    if codec in ("float32", "float16"):
        if not all(np.issubdtype(a.dtype, np.floating) for a in arrays):
            raise FedLookaheadError(f"heads coded {codec} must be floating-point arrays")
        return [np.asarray(a, dtype=np.float32) for a in arrays]
    if codec == "int8":
        return _int8_pairs(arrays)
    raise FedLookaheadError(f"unknown heads codec {codec!r}: use one of {', '.join(HEADS_CODECS)}")


def encode_update(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """A plain FedAvg update as it travels up: int8 (values, scales) pairs, rounded stochastically, so the
    rounding is unbiased and averages out over the cohort."""
    rng = np.random.default_rng()
    return [part for array in arrays for part in _to_int8(array, rng)]


def decode_update(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """float32 arrays from `encode_update`; a one-line error on anything else."""
    return _int8_pairs(arrays)


def as_received(arrays: list[np.ndarray], codec: str) -> list[np.ndarray]:
    """The heads exactly as a client decodes them (what its update is measured from)."""
    return decode_heads(encode_heads(arrays, codec), codec)


def masked_dtype(modulus: int) -> np.dtype:
    """The unsigned type a masked vector travels in: exactly the modulus's width, so that the server's sums,
    which wrap at that width, are the sums modulo the modulus that SecAgg+ needs (moduli are 2**16 or 2**32)."""
    if modulus not in (SMALL_MODULUS, LARGE_MODULUS):
        raise FedLookaheadError(f"SecAgg+ modulus must be 2**16 or 2**32, got {modulus}")
    return np.dtype(np.uint16 if modulus == SMALL_MODULUS else np.uint32)


def pack_masked(arrays: list[np.ndarray], modulus: int) -> list[np.ndarray]:
    """A SecAgg+ masked vector (integers in [0, modulus), int64 from Flower) in `masked_dtype(modulus)`."""
    return [np.asarray(a).astype(masked_dtype(modulus)) for a in arrays]


@dataclass(frozen=True)
class SecAggPlan:
    """SecAgg+'s parameters for one cohort (module docstring), and what they tolerate."""

    cohort: int
    num_shares: int
    threshold: int
    tolerated_dropouts: int  # the most dropouts no node can fail on (neighbours - threshold)
    max_dropout: float  # the dropout rate the threshold is sized for
    abort_probability: float  # per round, at max_dropout
    clipping_range: float
    quantization_range: int
    modulus_range: int
    bytes_per_value: int

    def to_dict(self) -> dict:
        return asdict(self)


def coordinate_bound(config: FedConfig, num_parameters: int) -> float:
    """The largest move of one head coordinate an honest client makes in a round (SecAgg+'s clipping range):
    AdamW's bound on one weight, or, under an update-max-norm clip, COORDINATE_SPREAD times its share."""
    if config.update_max_norm <= 0:
        return config.update_bound(1)
    return COORDINATE_SPREAD * config.update_max_norm / math.sqrt(max(1, num_parameters))


def abort_probability(cohort: int, shares: int, threshold: int, dropout: float) -> float:
    """P(some node's secret cannot be rebuilt: fewer than `threshold` live holders of its shares) when each
    client drops with `dropout`, by a union bound over the cohort. A live node holds one of its own shares;
    a dropped node's shares are held by its live neighbours only."""
    others = shares - 1

    def at_most(alive_max: int) -> float:  # P(at most alive_max of the others are alive)
        return sum(
            math.comb(others, alive) * (1 - dropout) ** alive * dropout ** (others - alive)
            for alive in range(0, max(0, alive_max + 1))
        )

    return min(1.0, cohort * ((1 - dropout) * at_most(threshold - 2) + dropout * at_most(threshold - 1)))


def secagg_plan(config: FedConfig, cohort: int, num_parameters: int, clipping_range: float | None = None) -> SecAggPlan:
    """SecAgg+'s parameters for `cohort` clients: the rule (module docstring), or secagg-num-shares and
    secagg-reconstruction-threshold where the run config sets them (Flower's own arithmetic). `clipping_range`:
    a noised update's (common/federation/user_dp.py masked_range) instead of an honest client's move."""
    if config.secagg_num_shares:
        shares, threshold = explicit_shares_and_threshold(config, cohort)
    else:
        shares = min(cohort, 2 * math.ceil(math.log2(max(2, cohort))) + 1)
        threshold = 2
        while (
            threshold < shares
            and abort_probability(cohort, shares, threshold + 1, config.secagg_max_dropout) <= ABORT_PROBABILITY
        ):
            threshold += 1
        if config.secagg_reconstruction_threshold:
            threshold = explicit_shares_and_threshold(config, cohort, shares)[1]
    levels = min(MAX_LEVELS, (SMALL_MODULUS - 1) // max(1, cohort))
    modulus = SMALL_MODULUS
    if levels < MIN_LEVELS:
        levels, modulus = min(MAX_LEVELS, (LARGE_MODULUS - 1) // max(1, cohort)), LARGE_MODULUS
    return SecAggPlan(
        cohort=cohort,
        num_shares=shares,
        threshold=threshold,
        tolerated_dropouts=max(0, min(shares, cohort) - threshold),
        max_dropout=config.secagg_max_dropout,
        abort_probability=abort_probability(cohort, shares, threshold, config.secagg_max_dropout),
        clipping_range=clipping_range or coordinate_bound(config, num_parameters),
        quantization_range=levels,
        modulus_range=modulus,
        bytes_per_value=masked_dtype(modulus).itemsize,
    )


def explicit_shares_and_threshold(config: FedConfig, sampled: int, shares: int | None = None) -> tuple[int, int]:
    """The (num_shares, threshold) SecAggPlusWorkflow.setup_stage derives for `sampled` clients from the run
    config's secagg-num-shares (float: a share of the cohort; int: a count) and secagg-reconstruction-threshold
    (float: a share of num_shares; int: a count); `shares` given: only the threshold is the config's."""
    shares_cfg, threshold_cfg = config.secagg_num_shares, config.secagg_reconstruction_threshold
    if shares is None:
        if isinstance(shares_cfg, float):
            shares = round(shares_cfg * sampled)
            if shares < sampled and shares & 1 == 0:
                shares += 1
            if shares <= 2:
                shares = sampled
        else:
            shares = int(shares_cfg)
        if sampled != shares and shares & 1 == 0:
            shares += 1
    if isinstance(threshold_cfg, float):
        threshold = max(round(threshold_cfg * shares), 2)
    else:
        threshold = int(threshold_cfg) if threshold_cfg else 2
    return shares, threshold
