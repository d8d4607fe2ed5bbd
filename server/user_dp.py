"""User-level DP (`dp-level = "user"`): Flower's `fl-dp-sa` pattern, with the epsilon Flower does not compute.

What each level guarantees, and whom it trusts:

* example level (`dp-level = "example"`, the default): each client runs Opacus DP-SGD, clipping every
  chunk's gradient and adding Gaussian noise on the device. One chunk is the privacy unit: whether
  any one chunk of a user's text was used changes the output distribution by at most (eps, delta),
  against everyone, the server included (the noise is added before anything leaves the device).
  A user who contributes many chunks is protected per chunk, not as a whole.
* user level (`dp-level = "user"`): each client trains without noise; Flower's `fixedclipping_mod`
  clips the client's whole update (new heads minus the heads it was sent) to L2 norm `update-max-norm`
  before SecAgg+ masks it; the server wraps its strategy in Flower's
  `DifferentialPrivacyClientSideFixedClipping`, which adds Gaussian noise of standard deviation
  sigma * clip / n to the mean of the n sampled clients. Every client counts equally (the same
  SecAgg+ weight), so one client moves the mean by at most clip / n: the privacy unit is the whole
  client, all of its text, in every round it takes part in. sigma is calibrated here to
  `dp-target-epsilon` at `dp-delta` over `num-server-rounds` rounds with sampling rate
  n / (connected nodes), by Opacus's RDP accountant. Trust: the noise is added by the server,
  after SecAgg+ unmasking, so the guarantee holds against everyone who sees only the released
  heads (other clients, users of the heads), not against the server, which sees the noiseless
  sum (SecAgg+ still hides each client's individual update from it). A device enforcing its own
  privacy floor never trusts that: on a device (node config `state-dir`) the client keeps training
  with its example-level DP-SGD whatever the run asks (client/client_app.py).
"""

from __future__ import annotations

import math
import warnings

from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping, Strategy
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from common.federation.config import FedConfig


def user_noise_multiplier(config: FedConfig, sampled: int, nodes: int) -> float:
    """sigma of the server's Gaussian noise: `dp-target-epsilon` after all rounds (or the fixed
    `dp-noise-multiplier`), with client sampling rate sampled / nodes."""
    if config.dp_noise_multiplier > 0:
        return config.dp_noise_multiplier
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        return float(
            get_noise_multiplier(
                target_epsilon=config.dp_target_epsilon,
                target_delta=config.dp_delta,
                sample_rate=min(1.0, sampled / nodes),
                steps=config.num_server_rounds,
                accountant="rdp",
            )
        )


def user_epsilon(noise_multiplier: float, sampled: int, nodes: int, rounds: int, delta: float) -> float:
    """User-level epsilon after `rounds` noised rounds (Opacus RDP accountant; inf without noise)."""
    if noise_multiplier <= 0:
        return math.inf
    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, min(1.0, sampled / nodes), rounds)]
    return float(accountant.get_epsilon(delta))


def noise_std(noise_multiplier: float, clip: float, sampled: int) -> float:
    """Standard deviation of the noise on each coordinate of the mean (Flower's compute_stdv)."""
    return noise_multiplier * clip / sampled


def plan_user_dp(config: FedConfig, sampled: int, nodes: int) -> dict:
    """The server's noise for this run and the guarantee it buys (written to run.json's plan)."""
    sigma = user_noise_multiplier(config, sampled, nodes)
    return {
        "level": "user",
        "noise_multiplier": sigma,
        "clip": config.update_max_norm,
        "clients_per_round": sampled,
        "noise_std": noise_std(sigma, config.update_max_norm, sampled),
        "epsilon": user_epsilon(sigma, sampled, nodes, config.num_server_rounds, config.dp_delta),
        "delta": config.dp_delta,
        "noise_added_by": "server (after SecAgg+ unmasking)",
    }


def wrap_strategy(strategy: Strategy, plan: dict) -> Strategy:
    """Flower's client-side fixed clipping wrapper around `strategy`: it sends the clipping norm to
    the clients (their `fixedclipping_mod` reads it) and noises the aggregate."""
    return DifferentialPrivacyClientSideFixedClipping(
        strategy, plan["noise_multiplier"], plan["clip"], plan["clients_per_round"]
    )
