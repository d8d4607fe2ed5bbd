"""User-level DP-FedAvg (`dp-level = "user"`): its accounting, the noise share a device adds, and the
plan's forecast of whether a run will learn.

The privacy unit is a whole user: all of its text, in every round it joins. Each round the server samples
`cohort` of `population` users (rate q = cohort / population); every sampled client clips its update (new
heads minus the heads it was sent) to L2 norm C, and Gaussian noise of standard deviation z C on the sum
makes the round a sampled Gaussian mechanism, composed over the rounds by Opacus's RDP accountant.

Who adds the noise (`user-dp-noise`):
* "device": each client adds N(0, (z C)^2 / m) to every coordinate of its clipped update before SecAgg+
  masks it (Kairouz, Liu and Steinke 2021 do the same with discrete noise). m = ceil(cohort (1 -
  secagg-max-dropout)) is the fewest shares the sum is sized for: any m or more surviving shares add up
  to at least the noise z C that the accountant assumes, and the server only ever unmasks a noised sum.
* "server": Flower's fl-dp-sa pattern (server/user_dp.py): the server noises the unmasked sum, so the
  guarantee does not hold against the server itself.

What stays trusted with device noise, stated plainly: the server samples honestly (the amplification by
sampling in q is its claim), and the cohort holds at least m honest devices. A server that fills a cohort
with its own clients (a Sybil attack) removes their noise from the sum and can subtract what it knows of
its own updates; SecAgg+ hides the cohort from each client, so no device can check either. A device caps
both claims with its floor (client/training/floor.py): a smallest cohort and a smallest sampling rate it
accepts, and its ledger is charged at those.
"""

from __future__ import annotations

import functools
import math
import warnings

from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

NOISE_BY = ("device", "server")
# SecAgg+'s quantization clips each masked coordinate at its range: the range is C (every coordinate of a
# clipped update) plus this many share deviations, so noise is cut with probability ~1e-15 per coordinate.
NOISE_TAIL_DEVIATIONS = 8.0

# The forecast's thresholds on the per-round signal-to-noise ratio (signal_to_noise below), from the
# probe that issue 28 reports: ~0.03 gained nothing, ~0.06 kept most of the non-private gain, >= 0.2 all of it.
NO_GAIN_SNR = 0.05
FULL_GAIN_SNR = 0.2


@functools.lru_cache(maxsize=256)
def noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """z such that `steps` sampled Gaussian steps at `sample_rate` spend `epsilon` at `delta` (Opacus RDP): a
    user-level run's rounds here, a client's DP-SGD steps in client/training/dp.py."""
    with warnings.catch_warnings():  # the search visits sigmas whose best RDP order is the largest one
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        return float(
            get_noise_multiplier(
                target_epsilon=epsilon,
                target_delta=delta,
                sample_rate=min(1.0, sample_rate),
                steps=steps,
                accountant="rdp",
            )
        )


def epsilon_after(z: float, sample_rate: float, rounds: int, delta: float) -> float:
    """User-level epsilon after `rounds` noised rounds (Opacus RDP accountant; inf without noise)."""
    if z <= 0:
        return math.inf
    accountant = RDPAccountant()
    accountant.history = [(z, min(1.0, sample_rate), rounds)]
    return float(accountant.get_epsilon(delta))


def noise_cohort(cohort: int, max_dropout: float) -> int:
    """The fewest noise shares a round's sum is sized for: the cohort less its largest tolerated dropout."""
    return max(1, math.ceil(cohort * (1.0 - max_dropout)))


def share_std(z: float, clip: float, shares: int) -> float:
    """Per-coordinate standard deviation of one device's noise share: `shares` of them sum to z * clip."""
    return z * clip / math.sqrt(shares)


def masked_range(clip: float, std: float) -> float:
    """SecAgg+'s clipping range for a noised update: a clipped coordinate is at most `clip`, plus the noise's tail."""
    return clip + NOISE_TAIL_DEVIATIONS * std


def signal_to_noise(cohort: int, z: float, num_parameters: int, alignment: float) -> float:
    """Per-round signal-to-noise of the noised mean update. The mean of `cohort` clipped updates has a
    population part of norm ~ alignment * C (alignment: the norm of the mean of many clients' unit
    updates, i.e. the root of their mean pairwise cosine); the noise on the mean has norm
    ~ z C sqrt(P) / cohort. Their ratio, alignment * cohort / (z sqrt(P)), does not depend on C."""
    if z <= 0:
        return math.inf
    return alignment * cohort / (z * math.sqrt(max(1, num_parameters)))


def verdict(snr: float, cohort: int, population: int) -> str:
    """The plan's one line: whether user-level DP at this signal-to-noise is likely to keep the gain."""
    ratio = 1.0 / snr if snr > 0 else math.inf
    if snr < NO_GAIN_SNR:
        grow = "grow the cohort" if cohort < population else "grow the population (and the cohort with it)"
        return (
            f"at these settings the noise is {ratio:.0f}x the signal each round (signal-to-noise {snr:.3f} < "
            f"{NO_GAIN_SNR}): these heads will not improve; {grow}, or spend a larger epsilon"
        )
    if snr < FULL_GAIN_SNR:
        return (
            f"at these settings the noise is {ratio:.1f}x the signal each round (signal-to-noise {snr:.3f}): "
            f"DP is likely to keep part of the gain; a cohort {math.ceil(FULL_GAIN_SNR / snr)}x larger should keep all of it"
        )
    return f"signal-to-noise {snr:.2f} per round (>= {FULL_GAIN_SNR}): DP is likely to keep the non-private gain"
