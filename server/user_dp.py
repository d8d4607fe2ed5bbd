"""User-level DP on the server side (`dp-level = "user"`, common/federation/user_dp.py): the run's noise, the
guarantee it buys and the forecast, before round 1; and, with `user-dp-noise = "server"`, Flower's
fl-dp-sa wrapper that noises the unmasked sum.

What each level guarantees, and whom it trusts:

* example level (`dp-level = "example"`, the default): each client runs Opacus DP-SGD, clipping every
  chunk's gradient and adding Gaussian noise on the device. One chunk is the privacy unit, against
  everyone, the server included. A user who contributes many chunks is protected per chunk, not as a whole.
* user level: each client trains without per-chunk noise; Flower's `fixedclipping_mod` clips the client's
  whole update to `update-max-norm` before SecAgg+ masks it, and every client weighs the same, so one
  client moves the sum by at most the clip: the privacy unit is the whole client. z is calibrated here
  to `dp-target-epsilon` at `dp-delta` over `num-server-rounds` rounds at sampling rate
  cohort / (connected nodes), by Opacus's RDP accountant.
  - `user-dp-noise = "device"`: each device adds its share of the noise before masking (client/noise_share.py);
    the server only ever unmasks a noised sum. What stays trusted: common/federation/user_dp.py.
  - `user-dp-noise = "server"`: Flower's `DifferentialPrivacyClientSideFixedClipping` adds the noise after
    unmasking, so the guarantee does not hold against the server, which sees the noiseless sum.
  With `user-dp-clip-quantile > 0` (device noise only) the clip adapts to that quantile of the update norms
  (Andrew et al. 2021): each client's centred clip bit travels noised inside its masked vector, the plan
  splits z between the update and the bits, and server/rounds.py steps the clip from their secure mean.
  A device enforcing its own floor never takes server noise: it adds its own share, at its own floor's
  cohort and sampling rate, or falls back to its example-level DP-SGD (client/training/floor.py).
"""

from __future__ import annotations

from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping, Strategy

from common.federation import user_dp
from common.federation.config import FedConfig
from common.federation.protocol import (
    USER_DP_BIT_NOISE,
    USER_DP_BIT_SCALE,
    USER_DP_NOISE_COHORT,
    USER_DP_NOISE_MULTIPLIER,
    USER_DP_SAMPLE_RATE,
)


def plan_user_dp(config: FedConfig, sampled: int, nodes: int, num_parameters: int) -> dict:
    """The run's user-level noise, the guarantee it buys and the forecast (run.json's plan["user_dp"])."""
    rate = min(1.0, sampled / nodes)
    z = config.dp_noise_multiplier or user_dp.noise_multiplier(
        config.dp_target_epsilon, config.dp_delta, rate, config.num_server_rounds
    )
    snr = user_dp.signal_to_noise(sampled, z, num_parameters, config.user_dp_alignment)
    plan = {
        "level": "user",
        "noise_multiplier": z,
        "clip": config.update_max_norm,
        "clients_per_round": sampled,
        "population": nodes,
        "sample_rate": rate,
        "epsilon": user_dp.epsilon_after(z, rate, config.num_server_rounds, config.dp_delta),
        "delta": config.dp_delta,
        "noise_added_by": config.user_dp_noise,
        "signal_to_noise": snr,
        "alignment": config.user_dp_alignment,
        "verdict": user_dp.verdict(snr, sampled, nodes),
    }
    if config.user_dp_noise == "device":
        shares = user_dp.noise_cohort(sampled, config.secagg_max_dropout)
        z_update = z
        if config.adaptive_clip:  # the clip bits take a little of the noise budget (Andrew et al. 2021)
            bit_std = user_dp.bit_noise_std(sampled)
            z_update = user_dp.update_noise_multiplier(z, bit_std)
        std = user_dp.share_std(z_update, config.update_max_norm, shares)
        plan.update(
            noise_cohort=shares,
            update_noise_multiplier=z_update,
            share_std=std,
            masked_range=user_dp.masked_range(config.update_max_norm, std),
            noise_std=user_dp.mean_noise_std(z_update, config.update_max_norm, sampled, shares),
        )
        if config.adaptive_clip:
            bit_share = bit_std / shares**0.5
            plan.update(
                clip_quantile=config.user_dp_clip_quantile,
                bit_noise_std=bit_std,
                # a centred bit (+-1/2) and its share's tail, scaled into the updates' masked range
                bit_scale=plan["masked_range"] / (0.5 + user_dp.NOISE_TAIL_DEVIATIONS * bit_share),
            )
    else:
        plan["noise_std"] = z * config.update_max_norm / sampled  # Flower's compute_stdv, on the mean
    return plan


def device_noise_config(plan: dict) -> dict:
    """The train-config keys a device reads to add its noise share (client/noise_share.py)."""
    keys = {
        USER_DP_NOISE_MULTIPLIER: float(plan["update_noise_multiplier"]),
        USER_DP_NOISE_COHORT: int(plan["noise_cohort"]),
        USER_DP_SAMPLE_RATE: float(plan["sample_rate"]),
    }
    if "bit_scale" in plan:
        keys.update({USER_DP_BIT_NOISE: float(plan["bit_noise_std"]), USER_DP_BIT_SCALE: float(plan["bit_scale"])})
    return keys


def wrap_strategy(strategy: Strategy, plan: dict) -> Strategy:
    """user-dp-noise=server: Flower's client-side fixed clipping wrapper around `strategy`: it sends the clipping
    norm to the clients (their `fixedclipping_mod` reads it) and noises the aggregate."""
    return DifferentialPrivacyClientSideFixedClipping(
        strategy, plan["noise_multiplier"], plan["clip"], plan["clients_per_round"]
    )
