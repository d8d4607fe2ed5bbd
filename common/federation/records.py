"""What travels between the ServerApp and the ClientApps: head parameters only, and their checks.

Both sides use this module, so the wire format has one definition:

* the head weights (fusion + lookahead blocks; never the base) in `state_dict` order, in a Flower
  ArrayRecord (float32 in evaluate messages; how train messages encode heads and updates is
  common/federation/wire.py);
* a ConfigRecord naming the base model fingerprint, the head version and the head geometry, so a
  client whose base differs refuses with a clear error instead of training nonsense;
* `validate_update` / `validate_masked`: the checks the server applies to every update before it
  can touch the aggregate (shapes, NaN/Inf, value range), returning a one-line reason instead of
  raising, so one bad client never stops a round. The metrics and weights of a reply are checked
  by `common.federation.protocol` (`TrainReply` / `EvalReply`), which also defines every record key.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord

from common.errors import FedLookaheadError
from common.federation.protocol import (  # noqa: F401 - HEADS_*: re-exported
    ARCH,
    DRAFT_VOCAB,
    FINGERPRINT,
    HEADS_CONFIG_RECORD,
    HEADS_RECORD,
    HIDDEN,
    LAYER,
    NAMES,
    NUM_HEADS,
    VERSION,
    VOCAB,
    ReplyError,
    TrainReply,
)
from common.heads.lookahead import DraftHeads, HeadsConfig, base_mismatch, expected_shapes
from common.model.base import BaseModel


class BaseMismatchError(FedLookaheadError):
    """The heads on offer were trained for another base model."""


Shapes = list[tuple[str, tuple[int, ...]]]


def wire_shapes(heads: DraftHeads) -> Shapes:
    """(name, shape) of every head parameter, in the order they travel: the config's, which is the state dict's."""
    return list(expected_shapes(heads.config).items())


def heads_to_ndarrays(heads: DraftHeads) -> list[np.ndarray]:
    return [t.detach().float().cpu().numpy().copy() for t in heads.state_dict().values()]


def load_ndarrays(heads: DraftHeads, arrays: list[np.ndarray]) -> None:
    """Load arrays (in `wire_shapes` order) into `heads`, after the same checks the server makes."""
    shapes = wire_shapes(heads)
    reason = validate_update(arrays, shapes, bound=None)
    if reason:
        raise FedLookaheadError(f"bad head parameters: {reason}")
    heads.load_state_dict_checked(
        OrderedDict((name, torch.from_numpy(np.asarray(a, dtype=np.float32))) for (name, _), a in zip(shapes, arrays))
    )


def heads_config_dict(heads: DraftHeads) -> dict[str, Any]:
    """Scalars describing `heads` (ConfigRecord- and legacy-FitIns-config-compatible)."""
    cfg = heads.config
    return {
        FINGERPRINT: cfg.base_fingerprint,
        VERSION: int(cfg.version),
        NUM_HEADS: int(cfg.num_heads),
        HIDDEN: int(cfg.hidden_size),
        VOCAB: int(cfg.vocab_size),
        NAMES: ",".join(heads.state_dict().keys()),
        ARCH: cfg.arch,
        DRAFT_VOCAB: ",".join(map(str, cfg.draft_vocab)),
        LAYER: json.dumps(cfg.layer) if cfg.layer else "",
    }


def heads_records(heads: DraftHeads, **extra: Any) -> tuple[ArrayRecord, ConfigRecord]:
    """The ArrayRecord of head weights (named, float32) and its ConfigRecord."""
    state = OrderedDict((k, v.detach().float().cpu()) for k, v in heads.state_dict().items())
    return ArrayRecord(state), ConfigRecord({**heads_config_dict(heads), **extra})


def check_base(config: Mapping[str, Any], base: BaseModel) -> None:
    """Refuse heads made for another base model, with a one-line error naming both."""
    reason = base_mismatch(config.get(FINGERPRINT), config.get(HIDDEN), config.get(VOCAB), base)
    if reason:
        raise BaseMismatchError(
            f"base model mismatch: the server's heads were {reason}; install the same base model on this device"
        )


def heads_from_config(config: Mapping[str, Any], base: BaseModel) -> DraftHeads:
    """Empty heads with the geometry and version the server announced (after `check_base`)."""
    check_base(config, base)
    vocab = str(config.get(DRAFT_VOCAB, "") or "")
    try:
        draft_vocab = [int(t) for t in vocab.split(",")] if vocab else []
    except ValueError as exc:
        raise FedLookaheadError("the server's draft vocabulary is not a list of token ids") from exc
    layer = str(config.get(LAYER, "") or "")
    try:
        geometry = json.loads(layer) if layer else {}
    except json.JSONDecodeError as exc:
        raise FedLookaheadError("the server's heads layer geometry is not a JSON object") from exc
    heads = DraftHeads(
        HeadsConfig(
            int(config[NUM_HEADS]),
            base.hidden_size,
            base.vocab_size,
            base.fingerprint,
            int(config[VERSION]),
            arch=str(config.get(ARCH, "recurrent")),
            draft_vocab=draft_vocab,
            layer=geometry,
        ),
        base,
    )
    names = str(config.get(NAMES, ""))
    if names and names.split(",") != list(heads.state_dict().keys()):
        raise FedLookaheadError("the server's head parameter names differ from this client's head layout")
    return heads


def heads_from_records(arrays: ArrayRecord, config: ConfigRecord, base: BaseModel) -> DraftHeads:
    """Heads from a native message (evaluate): check the base, then load the named tensors."""
    heads = heads_from_config(config, base)
    state = arrays.to_torch_state_dict()
    reason = validate_update(
        [v.numpy() for v in state.values()], wire_shapes(heads), bound=None, names=list(state.keys())
    )
    if reason:
        raise FedLookaheadError(f"bad head parameters from the server: {reason}")
    heads.load_state_dict_checked(state)
    return heads


def validate_update(
    arrays: list[np.ndarray], shapes: Shapes, bound: float | None, names: list[str] | None = None
) -> str | None:
    """None if `arrays` is a well-formed set of head weights, else the reason it is not.

    Checks, in order: the number of arrays, names (when given), a floating dtype, each shape, that
    every value is finite, and (with `bound`) that |value| <= bound, the SecAgg+ clipping range
    beyond which the secure sum would silently clip.
    """
    if len(arrays) != len(shapes):
        return f"wrong number of arrays: got {len(arrays)}, expected {len(shapes)}"
    if names is not None and names != [n for n, _ in shapes]:
        return "wrong parameter names"
    for (name, shape), array in zip(shapes, arrays):
        array = np.asarray(array)
        if not np.issubdtype(array.dtype, np.floating):
            return f"{name} has dtype {array.dtype}, expected floating point"
        if tuple(array.shape) != tuple(shape):
            return f"wrong shape: {name} is {tuple(array.shape)}, expected {tuple(shape)}"
        if not np.isfinite(array).all():
            return f"non-finite values (NaN/Inf) in {name}"
        if bound is not None:
            peak = float(np.abs(array).max()) if array.size else 0.0
            if peak > bound:
                return f"out-of-range values in {name}: max |x| = {peak:.3g} > {bound:g}"
    return None


def validate_masked(arrays: list[np.ndarray], shapes: Shapes, mod_range: int) -> str | None:
    """Checks on a SecAgg+ masked vector: [weight factor (1,)] + one integer array per head parameter.

    The server cannot see the values behind the masks (that is the point of SecAgg+), so this only
    catches what would break or corrupt the sum: wrong count or shapes, non-integer data, entries
    outside [0, modulus).
    """
    if len(arrays) != len(shapes) + 1:
        return f"wrong number of masked arrays: got {len(arrays)}, expected {len(shapes) + 1}"
    for (name, shape), array in zip([("weight-factor", (1,))] + shapes, arrays):
        array = np.asarray(array)
        if not np.issubdtype(array.dtype, np.integer):
            return f"masked {name} has dtype {array.dtype}, expected integers"
        if tuple(array.shape) != tuple(shape):
            return f"wrong shape: masked {name} is {tuple(array.shape)}, expected {tuple(shape)}"
        if array.size and (int(array.min()) < 0 or int(array.max()) >= mod_range):
            return f"out-of-range values in masked {name}: outside [0, {mod_range})"
    return None
