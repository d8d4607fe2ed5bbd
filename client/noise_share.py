"""A device's share of user-level DP noise (`dp-level = "user"`, `user-dp-noise = "device"`;
common/federation/user_dp.py).

`train_handler` decides this round's share (its standard deviation: the run's noise multiplier and noise
cohort, or the device's own floor) and leaves it in the context's state; `noise_share_added`, a mod between
the update's clip and the update itself, adds it to the clipped heads, so the update that SecAgg+ masks
next is already noised and the server never unmasks a sum without it. Under adaptive clipping the clip mod
records whether the update was within the clip (`set_clip_bit`), and the bit travels noised beside it.
"""

from __future__ import annotations

from typing import NamedTuple

import flwr.compat.common.recorddict_compat as compat
import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays

from common.errors import FedLookaheadError
from common.federation.protocol import FITRES_PARAMETERS

SHARE_STATE = "fedla-noise-share"  # ConfigRecord in context.state: this round's share
STD, BIT_STD, BIT_SCALE, BIT = "std", "bit-std", "bit-scale", "bit"


class Share(NamedTuple):
    """A round's share: the update's per-coordinate deviation and, under adaptive clipping, the clip bit's
    deviation and the scale it travels at (0: no bit)."""

    std: float = 0.0
    bit_std: float = 0.0
    bit_scale: float = 0.0


def set_share(context: Context, std: float, bit_std: float = 0.0, bit_scale: float = 0.0) -> None:
    """This round's share (all 0: none)."""
    context.state.config_records[SHARE_STATE] = ConfigRecord(
        {STD: float(std), BIT_STD: float(bit_std), BIT_SCALE: float(bit_scale)}
    )


def wants_clip_bit(context: Context) -> bool:
    """Whether this round's share carries a clip bit (adaptive clipping)."""
    record = context.state.config_records.get(SHARE_STATE)
    return record is not None and float(record[BIT_SCALE]) > 0


def set_clip_bit(context: Context, within_clip: bool) -> None:
    """Adaptive clipping: whether this round's update was within the clip, for `noise_share_added` to send."""
    context.state.config_records[SHARE_STATE][BIT] = 1.0 if within_clip else 0.0


def noise_share_added(msg: Message, context: Context, call_next) -> Message:
    """Gaussian noise of the share's deviation added to the reply's (clipped) heads, drawn from OS entropy:
    the server must not be able to predict, and so subtract, it. Under adaptive clipping the centred clip bit
    and its own noise share follow as one more array, inside the same masked vector."""
    reply = call_next(msg, context)
    record = context.state.config_records.pop(SHARE_STATE, None)
    share = Share(*(float(record[key]) for key in (STD, BIT_STD, BIT_SCALE))) if record is not None else Share()
    if share.std <= 0 or reply.has_error() or FITRES_PARAMETERS not in reply.content.array_records:
        return reply
    rng = np.random.default_rng()
    fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
    noised = [
        a + rng.normal(0.0, share.std, a.shape).astype(a.dtype) for a in parameters_to_ndarrays(fitres.parameters)
    ]
    if share.bit_scale > 0:
        if BIT not in record:
            raise FedLookaheadError("adaptive clipping: the update was never measured against the clip")
        centred = float(record[BIT]) - 0.5 + rng.normal(0.0, share.bit_std)
        noised.append(np.array([centred * share.bit_scale], dtype=np.float32))
    reply.content.array_records[FITRES_PARAMETERS] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters(noised), keep_input=False
    )
    return reply
