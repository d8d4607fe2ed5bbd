"""A device's share of user-level DP noise (`dp-level = "user"`, `user-dp-noise = "device"`;
common/federation/user_dp.py).

`train_handler` decides this round's share (its standard deviation: the run's noise multiplier and noise
cohort, or the device's own floor) and leaves it in the context's state; `noise_share_added`, a mod between
the update's clip and the update itself, adds it to the clipped heads, so the update that SecAgg+ masks
next is already noised and the server never unmasks a sum without it.
"""

from __future__ import annotations

import flwr.compat.common.recorddict_compat as compat
import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays

from common.federation.protocol import FITRES_PARAMETERS

SHARE_STATE = "fedla-noise-share"  # ConfigRecord in context.state: this round's share
STD = "std"


def set_share(context: Context, std: float) -> None:
    """This round's share: per-coordinate standard deviation `std` (0: none)."""
    context.state.config_records[SHARE_STATE] = ConfigRecord({STD: float(std)})


def noise_share_added(msg: Message, context: Context, call_next) -> Message:
    """Gaussian noise of the share's deviation added to the reply's (clipped) heads, drawn from OS entropy:
    the server must not be able to predict, and so subtract, it."""
    reply = call_next(msg, context)
    record = context.state.config_records.pop(SHARE_STATE, None)
    std = float(record[STD]) if record is not None else 0.0
    if std <= 0 or reply.has_error() or FITRES_PARAMETERS not in reply.content.array_records:
        return reply
    rng = np.random.default_rng()
    fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
    noised = [a + rng.normal(0.0, std, a.shape).astype(a.dtype) for a in parameters_to_ndarrays(fitres.parameters)]
    reply.content.array_records[FITRES_PARAMETERS] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters(noised), keep_input=False
    )
    return reply
