"""The server's guard against bad client replies (issue 11 items 1 and 2), over the real GuardedGrid,
HeadsStrategy and client_evaluation with an in-process grid whose clients send crafted replies."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import flwr.compat.common.recorddict_compat as compat
import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Stage
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.federation.config import FedConfig
from common.federation.protocol import EvalReply, ReplyError, TrainReply
from common.federation.wire import encode_update
from common.heads.lookahead import DraftHeads
from server.evaluation import client_evaluation
from server.guard import REJECTED_CODE, ExchangeLog, GuardedGrid
from server.rounds import HeadsStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # simulations/ is a folder of scripts, not installed
from simulations.inprocess import InProcessGrid  # noqa: E402

SHAPES = [("w", (2, 3)), ("b", (3,))]
NUM_HEADS = 2
FIRST = 1000  # InProcessGrid's first node id


def train_metrics(**changes: Any) -> dict[str, Any]:
    """What an honest client reports after training (client/client_app.py)."""
    metrics = {
        "skipped": 0,
        "skip-reason": "",
        "epsilon": 1.5,
        "delta": 1e-5,
        "dp": 1,
        "q": 0.25,
        "no-amplification": 0,
        "noise-multiplier": 1.1,
        "steps": 8,
        "num-train-chunks": 10,
        "train-seconds": 0.5,
        "loss": 2.5,
        "acc-1": 0.4,
        "acc-2": 0.2,
    }
    metrics.update(changes)
    return metrics


def update(value: float) -> list[np.ndarray]:
    return [np.full(shape, value, dtype=np.float32) for _, shape in SHAPES]


def fit_reply(
    num_examples: Any = 10, metrics: dict | None = None, arrays: list[np.ndarray] | None = None, raw: bool = False
) -> RecordDict:
    """A train reply with this update, in the int8 layout honest clients send (`raw`: the arrays as given)."""
    arrays = update(0.0) if arrays is None else arrays
    res = FitRes(
        Status(Code.OK, ""),
        ndarrays_to_parameters(arrays if raw else encode_update(arrays)),
        num_examples,
        train_metrics() if metrics is None else metrics,
    )
    return compat.fitres_to_recorddict(res, keep_input=False)


def grid_of(replies: list[RecordDict]) -> InProcessGrid:
    """An in-process grid whose node FIRST + i answers every message with replies[i]."""

    def app_for(node: int) -> Callable[[Message, Any], Message]:
        return lambda msg, _context: Message(replies[node - FIRST], reply_to=msg)

    return InProcessGrid(app_for, len(replies), {})


def plain_config(**changes: Any) -> FedConfig:
    """Plain FedAvg whose update bound (update-max-norm) lets these crafted updates through unless huge."""
    return FedConfig.from_mapping({"secagg": False, "max-chunks-per-client": 12, "update-max-norm": 100.0, **changes})


def guard_round(
    replies: list[RecordDict], config: FedConfig | None = None, stage: str | None = None
) -> tuple[GuardedGrid, list[Message]]:
    """One train exchange through the real guard: returns it and the replies the workflow would see."""
    guard = GuardedGrid(
        grid_of(replies), config or plain_config(), ExchangeLog(), SHAPES, NUM_HEADS, default_timeout=None
    )
    nodes = sorted(guard.get_node_ids())
    guard.exchange.sampled = nodes
    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(update(0.0)), {}), keep_input=True)
    if stage is not None:
        content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord({SecAggKey.STAGE: stage})
    messages = [Message(content, dst_node_id=node, message_type=MessageType.TRAIN, group_id="1") for node in nodes]
    return guard, list(guard.send_and_receive(messages))


def aggregate(guard: GuardedGrid, replies: list[Message], config: FedConfig | None = None):
    """What default_fit_workflow hands the strategy: the replies without an error, as FitRes."""
    results = [
        (SimpleNamespace(node_id=r.metadata.src_node_id), compat.recorddict_to_fitres(r.content, keep_input=True))
        for r in replies
        if not r.has_error()
    ]
    strategy = HeadsStrategy(config or plain_config(), guard.exchange, guard.shapes, {}, current=update(0.0))
    parameters, _ = strategy.aggregate_fit(1, results, [])
    return None if parameters is None else parameters_to_ndarrays(parameters)


# ------------------------------------------------------------------------------------------ train


@pytest.mark.parametrize(
    "num_examples,metrics,reason",
    [
        (math.nan, None, "non-finite num_examples=nan"),
        (math.inf, None, "non-finite num_examples=inf"),
        (-math.inf, None, "non-finite num_examples=-inf"),
        (-3, None, "out-of-range num_examples=-3: below 0"),
        (2.5, None, "num_examples must be an integer, got 2.5"),
        (10, train_metrics(loss="abc"), "loss must be a number, got str 'abc'"),
        (10, train_metrics(epsilon="x"), "epsilon must be a number, got str 'x'"),
        (10, train_metrics(loss=math.nan), "non-finite loss=nan"),
        (10, train_metrics(**{"acc-1": 1.5}), "out-of-range acc-1=1.5: above 1"),
        (10, train_metrics(**{"acc-3": 0.1}), "unknown metric acc-3 for 2 heads"),
        (10, train_metrics(steps=[1, 2]), "steps must be an integer, got list [1, 2]"),
        (10, train_metrics(skipped=1), "a skipped client claims weight 10"),
        (0, train_metrics(), "weight 0 without skipped=1"),
    ],
)
def test_a_bad_train_reply_is_rejected_with_its_reason_and_the_round_goes_on(num_examples, metrics, reason, caplog):
    guard, replies = guard_round([fit_reply(num_examples, metrics, update(5.0)), fit_reply(10, arrays=update(1.0))])
    assert replies[0].has_error() and replies[0].error.code == REJECTED_CODE
    assert guard.exchange.rejected == [{"node": FIRST, "reason": reason}]
    assert f"rejected the reply of node {FIRST}: {reason}" in caplog.text
    assert not replies[1].has_error() and set(guard.exchange.checked) == {FIRST + 1}
    for got in aggregate(guard, replies):
        np.testing.assert_array_equal(got, 1.0)  # only the good update is in the mean
    assert guard.exchange.client_metrics[FIRST + 1].loss == 2.5


def test_a_reply_without_the_fitres_records_is_rejected():
    guard, replies = guard_round([RecordDict({"metrics": MetricRecord({"num-examples": 3})}), fit_reply()])
    assert replies[0].has_error() and guard.exchange.rejected[0]["reason"] == "reply has no num_examples"
    assert not replies[1].has_error()


@pytest.mark.parametrize("max_chunks,cap", [(12, 12), (0, 1000)])
def test_plain_fedavg_caps_a_huge_claimed_weight(max_chunks, cap):
    config = plain_config(**{"max-chunks-per-client": max_chunks})
    assert config.weight_cap == cap
    guard, replies = guard_round([fit_reply(10**12, arrays=update(1.0)), fit_reply(10, arrays=update(0.0))], config)
    mean = aggregate(guard, replies, config)
    for got in mean:
        np.testing.assert_allclose(got, cap / (cap + 10), rtol=1e-6)  # not 1.0: that client's own update
    assert guard.exchange.weights == {FIRST: cap, FIRST + 1: 10}
    assert guard.exchange.capped == {FIRST: 10**12}


def test_a_round_where_every_client_skipped_keeps_the_heads_and_says_why():
    skipped = train_metrics(skipped=1, **{"skip-reason": "privacy budget spent"})
    for key in ("loss", "acc-1", "acc-2"):
        del skipped[key]
    guard, replies = guard_round([fit_reply(0, skipped), fit_reply(0, skipped)])
    assert aggregate(guard, replies) is None
    assert guard.exchange.aggregate_note == "all 2 client(s) skipped training (privacy budget): heads unchanged"


@pytest.mark.parametrize("max_chunks,cap", [(256, 256), (0, 1000)])
def test_secagg_plaintext_weight_above_the_cap_is_rejected(max_chunks, cap):
    config = FedConfig.from_mapping({"secagg": True, "max-chunks-per-client": max_chunks})
    masked = fit_reply(cap + 1)
    masked.config_records[RECORD_KEY_CONFIGS] = ConfigRecord({SecAggKey.MASKED_PARAMETERS: []})
    guard, replies = guard_round([masked], config, stage=Stage.COLLECT_MASKED_VECTORS)
    assert replies[0].has_error()
    assert guard.exchange.rejected[0]["reason"] == (
        f"weight {cap + 1} above the weight cap {cap} (max-chunks-per-client, secagg-max-weight)"
    )


# ------------------------------------------------------------------------------------------- eval


@pytest.fixture(scope="module")
def heads(tiny_base) -> DraftHeads:
    return DraftHeads.fresh(tiny_base, NUM_HEADS)


def eval_reply(**metrics: Any) -> RecordDict:
    values = {"num-examples": 4, "loss": 3.0, "head-accuracy": [0.5, 0.25], "tau": 1.4, "eval-seconds": 0.1}
    values.update(metrics)
    return RecordDict({"metrics": MetricRecord({k: v for k, v in values.items() if v is not None})})


def evaluate(replies: list[RecordDict], heads: DraftHeads, config: FedConfig | None = None) -> dict:
    nodes = [FIRST + i for i in range(len(replies))]
    return client_evaluation(
        grid_of(replies), heads, config or plain_config(**{"fraction-evaluate": 1.0}), 1, nodes, random.Random(0)
    )


@pytest.mark.parametrize(
    "metrics,reason",
    [
        ({"head-accuracy": 0.5}, "head-accuracy must be a list of numbers, got float 0.5"),
        ({"tau": [1.0, 2.0]}, "tau must be a number, got list [1.0, 2.0]"),
        ({"num-examples": [3]}, "num-examples must be an integer, got list [3]"),
        ({"num-examples": math.nan}, "non-finite num-examples=nan"),
        ({"num-examples": None}, "evaluation reply has no num-examples"),
        ({"head-accuracy": [0.5]}, "1 head accuracies for 2 heads"),
        ({"head-accuracy": [0.5, 1.5]}, "out-of-range head-accuracy[1]=1.5: above 1"),
        ({"head-accuracy": None}, "4 evaluation examples but no head-accuracy"),
    ],
)
def test_a_bad_evaluation_reply_is_rejected_and_the_rest_averaged(heads, metrics, reason):
    result = evaluate([eval_reply(**metrics), eval_reply(**{"head-accuracy": [0.75, 0.5], "tau": 2.0})], heads)
    assert result["rejected"] == [reason] and result["evaluated"] == 1
    assert result["head_accuracy"] == [0.75, 0.5] and result["tau"] == 2.0


def test_evaluation_weights_are_capped_like_training_weights(heads):
    result = evaluate(
        [
            eval_reply(**{"num-examples": 10**12, "head-accuracy": [1.0, 1.0]}),
            eval_reply(**{"num-examples": 12, "head-accuracy": [0.0, 0.0]}),
        ],
        heads,
    )
    assert result["head_accuracy"] == [0.5, 0.5]


# -------------------------------------------------------------------------------------------- fuzz

SCALARS = st.one_of(
    st.integers(-(2**63), 2**63 - 1), st.floats(), st.text(max_size=6), st.binary(max_size=4), st.booleans()
)
RECORD_VALUES = st.one_of(
    SCALARS,
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
    st.lists(st.floats(), max_size=3),
    st.lists(st.text(max_size=3), max_size=2),
    st.lists(st.booleans(), max_size=2),
)
METRIC_VALUES = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
    st.lists(st.floats(), max_size=3),
)
TRAIN_KEYS = st.sampled_from(sorted(train_metrics()) + ["acc-0", "acc-3", "acc-x", "acc-01", "other"])
ANY_VALUES = st.recursive(
    st.one_of(st.none(), SCALARS),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


def fuzzed_metrics(keys: st.SearchStrategy, values: st.SearchStrategy, base: dict) -> st.SearchStrategy:
    """An honest reply's metrics with some values replaced, added or dropped."""
    return st.tuples(
        st.dictionaries(keys, values, max_size=4), st.lists(st.sampled_from(sorted(base)), max_size=2)
    ).map(lambda t: {k: v for k, v in {**base, **t[0]}.items() if k not in t[1]})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_examples=st.one_of(METRIC_VALUES, st.just(10**12)),
    metrics=fuzzed_metrics(TRAIN_KEYS, RECORD_VALUES, train_metrics()),
    arrays=st.sampled_from(["ok", "nan", "inf", "shape", "clip", "dtype"]),
)
def test_fuzzed_train_replies_never_escape_the_guard(num_examples, metrics, arrays):
    crafted = {
        "ok": update(0.5),
        "nan": [np.full((2, 3), np.nan, np.float32), np.zeros(3, np.float32)],
        "inf": [np.zeros((2, 3), np.float32), np.full(3, np.inf, np.float32)],
        "shape": [np.zeros((3, 2), np.float32), np.zeros(3, np.float32)],
        "clip": update(1e6),
        "dtype": [np.zeros((2, 3), np.complex64), np.zeros(3, np.float32)],
    }[arrays]
    raw = arrays != "ok"  # a hostile client sends whatever it likes on the wire
    guard, replies = guard_round([fit_reply(num_examples, metrics, crafted, raw), fit_reply(10, arrays=update(1.0))])
    parsed = None
    try:
        parsed = TrainReply.from_metrics(num_examples, metrics, NUM_HEADS)
    except ReplyError:
        pass
    bad_update = arrays != "ok"
    try:  # a value Flower's records cannot type (an empty list) makes the reply unreadable to its workflow too
        compat.recorddict_to_fitres(fit_reply(num_examples, metrics, crafted, raw), keep_input=True)
        unreadable = False
    except TypeError:
        unreadable = True
    if replies[0].has_error():
        assert parsed is None or bad_update or unreadable
        (rejected,) = guard.exchange.rejected
        assert rejected["node"] == FIRST and rejected["reason"] and "\n" not in rejected["reason"]
    else:
        assert parsed is not None and not bad_update and not unreadable and guard.exchange.checked[FIRST] == parsed
        assert 0 <= parsed.num_examples and all(0 <= a <= 1 for a in parsed.head_accuracy)
        assert parsed.loss is None or math.isfinite(parsed.loss)
    assert not replies[1].has_error()
    mean = aggregate(guard, replies)
    assert mean is not None and all(np.isfinite(a).all() and np.abs(a).max() <= 1.0 for a in mean)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stage=st.sampled_from([Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK]),
    record=st.dictionaries(
        st.sampled_from(
            [
                SecAggKey.PUBLIC_KEY_1,
                SecAggKey.PUBLIC_KEY_2,
                SecAggKey.DESTINATION_LIST,
                SecAggKey.CIPHERTEXT_LIST,
                SecAggKey.MASKED_PARAMETERS,
                SecAggKey.NODE_ID_LIST,
                SecAggKey.SHARE_LIST,
            ]
        ),
        RECORD_VALUES,
        max_size=4,
    ),
    with_fitres=st.booleans(),
)
def test_fuzzed_secagg_stage_replies_never_escape_the_guard(stage, record, with_fitres):
    content = fit_reply() if with_fitres else RecordDict()
    content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(record)
    guard, replies = guard_round([content], FedConfig.from_mapping({"secagg": True}), stage=stage)
    rejected = [r["reason"] for r in guard.exchange.rejected]
    assert len(replies) == 1 and (rejected == [] if not replies[0].has_error() else len(rejected) == 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    metrics=fuzzed_metrics(
        st.sampled_from(["num-examples", "loss", "head-accuracy", "tau", "eval-seconds", "x"]),
        METRIC_VALUES,
        {"num-examples": 4, "head-accuracy": [0.5, 0.25], "tau": 1.4},
    )
)
def test_fuzzed_evaluation_replies_never_escape_client_evaluation(heads, metrics):
    result = evaluate([RecordDict({"metrics": MetricRecord(metrics)}), eval_reply()], heads)
    try:
        EvalReply.from_metrics(metrics, NUM_HEADS)
        valid = True
    except ReplyError:
        valid = False
    assert result["evaluated"] == 1 + valid and len(result["rejected"]) == (not valid)
    assert all(0 <= a <= 1 for a in result["head_accuracy"])


@settings(max_examples=200, deadline=None)
@given(
    num_examples=ANY_VALUES,
    metrics=st.one_of(ANY_VALUES, st.dictionaries(TRAIN_KEYS, ANY_VALUES, max_size=5)),
    eval_metrics=st.one_of(
        ANY_VALUES,
        st.dictionaries(st.sampled_from(["num-examples", "head-accuracy", "tau", "loss", "eval-seconds"]), ANY_VALUES),
    ),
)
def test_protocol_raises_only_reply_errors_whatever_the_values(num_examples, metrics, eval_metrics):
    """Any Python value (not only what Flower records can carry) parses or raises a one-line ReplyError."""
    for parse, kind in (
        (lambda: TrainReply.from_metrics(num_examples, metrics, NUM_HEADS), TrainReply),
        (lambda: EvalReply.from_metrics(eval_metrics, NUM_HEADS), EvalReply),
    ):
        try:
            assert isinstance(parse(), kind)
        except ReplyError as exc:
            assert str(exc) and "\n" not in str(exc)
