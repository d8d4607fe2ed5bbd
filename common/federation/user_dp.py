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

# The forecast's thresholds on the per-round signal-to-noise ratio (signal_to_noise below, at the default
# alignment 0.1). The population privacy-utility grid (docs/benchmarks.md, 2026-12-08: 18 points, one seed)
# measured <= 0.047 keeping at most 0.17 of the non-private gain, 0.092 and 0.121 keeping 0.77 and 0.89, and
# 0.159 keeping 0.97; it ran with FULL_GAIN_SNR 0.2 and missed only that last point, hence 0.15 (fitted
# in-sample: not yet checked on other settings).
NO_GAIN_SNR = 0.05
FULL_GAIN_SNR = 0.15
# what "no gain" and "keeps the gain" mean when a benchmark checks the forecast: the share of the
# non-private gain in heads-only tau a DP run kept
NO_GAIN_SHARE = 0.25
FULL_GAIN_SHARE = 0.9


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


def mean_noise_std(z: float, clip: float, cohort: int, shares: int) -> float:
    """Per-coordinate deviation of the noise on the mean update when all `cohort` devices add their share
    (each sized for `shares`): a little above z * clip / cohort unless no dropout is tolerated."""
    return share_std(z, clip, shares) * math.sqrt(cohort) / cohort


def masked_range(clip: float, std: float) -> float:
    """SecAgg+'s clipping range for a noised update: a clipped coordinate is at most `clip`, plus the noise's tail."""
    return clip + NOISE_TAIL_DEVIATIONS * std


# Adaptive quantile clipping (Andrew et al. 2021): each client also sends its clip bit, centred (b - 1/2, so one
# user moves the bit sum by at most 1/2), noised on the sum with deviation cohort / BIT_NOISE_DIVISOR, their
# recommendation; the update's noise multiplier is raised so that the pair is one Gaussian mechanism of z.
BIT_NOISE_DIVISOR = 20.0


def bit_noise_std(cohort: int) -> float:
    """Deviation of the noise on a round's sum of centred clip bits."""
    return cohort / BIT_NOISE_DIVISOR


def update_noise_multiplier(z: float, bit_std: float) -> float:
    """The update's noise multiplier when the clip bits carry noise `bit_std`: z_update^-2 + (2 bit_std)^-2 = z^-2."""
    if not 2 * bit_std > z:
        raise ValueError(f"the clip bits' noise {bit_std:g} is too small for a total noise multiplier of {z:g}")
    return (z**-2 - (2 * bit_std) ** -2) ** -0.5


def combined_noise_multiplier(z_update: float, bit_std: float) -> float:
    """The one Gaussian mechanism's z that an update noised at `z_update` and bits noised at `bit_std` amount to."""
    return (z_update**-2 + (2 * bit_std) ** -2) ** -0.5


def next_clip(clip: float, bit_mean: float, quantile: float, lr: float, cap: float) -> float:
    """The geometric update of the clip towards the `quantile` of the update norms (`bit_mean`: the noised share
    of clients that were not clipped), never above `cap` (what SecAgg+'s range and the guard are sized for)."""
    return min(cap, clip * math.exp(-lr * (bit_mean - quantile)))


def signal_to_noise(cohort: int, z: float, num_parameters: int, alignment: float) -> float:
    """Per-round signal-to-noise of the noised mean update. The mean of `cohort` clipped updates has a
    population part of norm ~ alignment * C (alignment: the norm of the mean of many clients' unit
    updates, i.e. the root of their mean pairwise cosine); the noise on the mean has norm
    ~ z C sqrt(P) / cohort. Their ratio, alignment * cohort / (z sqrt(P)), does not depend on C."""
    if z <= 0:
        return math.inf
    return alignment * cohort / (z * math.sqrt(max(1, num_parameters)))


def expected_outcome(snr: float) -> str:
    """What the forecast expects of a run at this signal-to-noise: "none" | "part" | "full" of the gain."""
    return "none" if snr < NO_GAIN_SNR else "part" if snr < FULL_GAIN_SNR else "full"


def outcome_of(kept_share: float) -> str:
    """The same three classes for a measured run, from the share of the non-private gain it kept."""
    return "none" if not kept_share >= NO_GAIN_SHARE else "part" if kept_share < FULL_GAIN_SHARE else "full"


def verdict(snr: float, cohort: int, population: int) -> str:
    """The plan's one line: whether user-level DP at this signal-to-noise is likely to keep the gain."""
    ratio = 1.0 / snr if snr > 0 else math.inf
    expected = expected_outcome(snr)
    if expected == "none":
        grow = "grow the cohort" if cohort < population else "grow the population (and the cohort with it)"
        return (
            f"at these settings the noise is {ratio:.0f}x the signal each round (signal-to-noise {snr:.3f} < "
            f"{NO_GAIN_SNR}): these heads will not improve; {grow}, or spend a larger epsilon"
        )
    if expected == "part":
        return (
            f"at these settings the noise is {ratio:.1f}x the signal each round (signal-to-noise {snr:.3f}): "
            f"DP is likely to keep part of the gain; a cohort {math.ceil(FULL_GAIN_SNR / snr)}x larger should keep all of it"
        )
    return f"signal-to-noise {snr:.2f} per round (>= {FULL_GAIN_SNR}): DP is likely to keep the non-private gain"
