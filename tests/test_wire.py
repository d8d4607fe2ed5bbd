"""How heads and updates travel (common/federation/wire.py): the codecs against float32, SecAgg+'s rule
against a simulation of dropouts, and a hostile server's codec refused in one line."""

from __future__ import annotations

import math

import flwr.compat.common.recorddict_compat as compat
import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.supercore.task_identity import TaskIdentity

from client.client_app import heads_decoded
from common.errors import FedLookaheadError
from common.federation.config import FedConfig
from common.federation.protocol import HEADS_CODEC
from common.federation.wire import (
    INT8_GROUP,
    abort_probability,
    as_received,
    decode_heads,
    decode_update,
    encode_heads,
    encode_update,
    masked_dtype,
    pack_masked,
    secagg_plan,
)

HEADS = [np.random.default_rng(0).normal(0, 0.05, shape).astype(np.float32) for shape in ((70, 33), (33,), (5,))]


@pytest.mark.parametrize(
    "codec,bytes_per_value,error", [("float32", 4, 0.0), ("float16", 2, 1e-3), ("int8", 1, 1 / 254)]
)
def test_heads_codecs_round_trip_within_their_rounding(codec, bytes_per_value, error):
    encoded = encode_heads(HEADS, codec)
    decoded = decode_heads(encoded, codec)
    for original, back in zip(HEADS, decoded):
        assert back.dtype == np.float32 and back.shape == original.shape
        groups = np.pad(original.ravel(), (0, -original.size % INT8_GROUP)).reshape(-1, INT8_GROUP)
        peak = np.repeat(np.abs(groups).max(axis=1), INT8_GROUP)[: original.size].reshape(original.shape)
        bound = peak * error if codec == "int8" else np.abs(original) * error
        assert np.all(np.abs(back - original) <= bound + 1e-9)  # int8: half a step of its group's scale
    values = sum(a.size for a in HEADS)
    assert values * bytes_per_value <= sum(a.nbytes for a in encoded) <= values * bytes_per_value * 1.13
    np.testing.assert_array_equal(as_received(HEADS, codec)[0], decoded[0])


def test_plain_updates_round_stochastically_and_without_bias():
    update = [np.full((4, 64), 0.3, np.float32), np.linspace(-1, 1, 64, dtype=np.float32)]
    mean = [np.zeros_like(a, dtype=np.float64) for a in update]
    for _ in range(400):
        for acc, back in zip(mean, decode_update(encode_update(update))):
            acc += back / 400
    for original, averaged in zip(update, mean):
        step = np.abs(original).max() / 127
        assert np.abs(averaged - original).max() < 0.2 * step  # one client is off by up to a step; 400 average out


@pytest.mark.parametrize(
    "arrays,codec,reason",
    [
        ([np.zeros(3, np.float32)], "bfloat7", "unknown heads codec 'bfloat7'"),
        ([np.zeros(3, np.int8)], "float32", "must be floating-point arrays"),
        ([np.zeros(3, np.int8)], "int8", "(values, scales) pairs, got 1 arrays"),
        ([np.zeros(3, np.int8), np.array([np.nan], np.float32)], "int8", "one finite scale per 32 values"),
        ([np.zeros(64, np.int8), np.ones(1, np.float32)], "int8", "one finite scale per 32 values"),
    ],
)
def test_malformed_heads_on_the_wire_get_a_one_line_error(arrays, codec, reason):
    with pytest.raises(FedLookaheadError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        decode_heads(arrays, codec)


def test_a_client_refuses_a_codec_it_does_not_know_before_training():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0  # as the in-process grid sets them
    fitins = FitIns(ndarrays_to_parameters(HEADS), {HEADS_CODEC: "zip"})
    msg = Message(compat.fitins_to_recorddict(fitins, keep_input=True), dst_node_id=1, message_type=MessageType.TRAIN)
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(FedLookaheadError, match="unknown heads codec 'zip'"):
        heads_decoded(msg, context, lambda m, c: pytest.fail("trained on heads it could not read"))


def test_masked_vectors_travel_as_wide_as_their_modulus_and_sum_modulo_it():
    rng = np.random.default_rng(1)
    vectors = [rng.integers(0, 1 << 16, 1000) for _ in range(300)]  # 300 clients' int64 vectors from Flower
    packed = [pack_masked([v], 1 << 16)[0] for v in vectors]
    assert packed[0].dtype == np.uint16 and masked_dtype(1 << 32) == np.uint32
    total = packed[0]
    for v in packed[1:]:  # Flower's own sum: in the vectors' type, wrapping at its width
        total = total + v
    np.testing.assert_array_equal(total, np.sum(vectors, axis=0) % (1 << 16))
    with pytest.raises(FedLookaheadError, match="2\\*\\*16 or 2\\*\\*32"):
        masked_dtype(1 << 20)


def simulated_abort_rate(cohort: int, shares: int, threshold: int, dropout: float, trials: int = 4000) -> float:
    """Rounds in which some node's secret cannot be rebuilt, over random neighbourhoods and dropouts."""
    rng = np.random.default_rng(2)
    aborted = 0
    for _ in range(trials):
        alive = rng.random(cohort) >= dropout
        for node in range(cohort):
            others = rng.choice(np.delete(np.arange(cohort), node), shares - 1, replace=False)
            holders = int(alive[others].sum()) + int(alive[node])
            if holders < threshold:
                aborted += 1
                break
    return aborted / trials


def test_the_abort_bound_holds_against_a_simulation():
    cohort, shares, dropout = 20, 9, 0.3
    for threshold in (3, 4, 5):
        bound = abort_probability(cohort, shares, threshold, dropout)
        simulated = simulated_abort_rate(cohort, shares, threshold, dropout, trials=1500)
        assert simulated <= bound + 0.02  # a union bound: never below what happens


@pytest.mark.parametrize("cohort", [4, 64, 256, 1024])
@pytest.mark.parametrize("dropout", [0.1, 0.3])
def test_secagg_parameters_follow_from_the_cohort(cohort, dropout):
    config = FedConfig.from_mapping({"secagg-max-dropout": dropout, "max-chunks-per-client": 3, "batch-size": 2})
    plan = secagg_plan(config, cohort, 10**6)
    assert plan.num_shares == min(cohort, 2 * math.ceil(math.log2(cohort)) + 1)
    assert 2 <= plan.threshold <= plan.num_shares
    if plan.threshold > 2:  # the largest threshold within the abort target
        assert plan.abort_probability <= 1e-3
        assert abort_probability(cohort, plan.num_shares, plan.threshold + 1, dropout) > 1e-3
    assert cohort * plan.quantization_range < plan.modulus_range  # the secure sum never wraps
    assert plan.modulus_range == (1 << 16 if cohort <= 257 else 1 << 32)
    assert plan.clipping_range == pytest.approx(config.update_bound(1))  # AdamW's bound on one coordinate


def test_explicit_shares_and_threshold_keep_flowers_arithmetic():
    config = FedConfig.from_mapping({"secagg-num-shares": 1.0, "secagg-reconstruction-threshold": 0.5})
    plan = secagg_plan(config, 10, 1000)
    assert (plan.num_shares, plan.threshold) == (10, 5)
