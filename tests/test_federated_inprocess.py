"""The real server loop and ClientApp over an in-process Grid: SecAgg+ vs plain mean, dropouts, bad replies, resume."""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from pathlib import Path

import flwr.compat.common.recorddict_compat as compat
import numpy as np
import pytest
import torch
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import FitRes, ndarray_to_bytes, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey

from client import client_app as client_module
from client.client_app import (
    fixedclipping_when_asked,
    heads_decoded,
    secaggplus_when_needed,
    train_handler,
    update_sent,
)
from client.node_config import STATE_DIR_KEY
from client.training.dp import epsilon_of
from common.errors import FedLookaheadError
from common.federation.config import FedConfig
from common.federation.records import heads_to_ndarrays
from common.federation.wire import as_received, decode_update, encode_update, secagg_plan
from common.heads.lookahead import DraftHeads
from server.federation import run_federation
from tests.conftest import LOOPBACK_URL

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # simulations/ is a folder of scripts, not installed
from simulations.faults import FaultPlan, dropout_mod  # noqa: E402
from simulations.inprocess import InProcessGrid  # noqa: E402


def recording_app(
    sent: dict, corrupt=None, corrupt_masked=None, corrupt_eval=None, corrupt_stage=None, outer_mods=(), received=None
) -> ClientApp:
    """The real train and evaluate handlers, recording each client's plain update before SecAgg+ masks
    it; `outer_mods` wrap everything (as a simulation's fault injection does); `corrupt*` change a
    client's train reply, masked vector, evaluation metrics or any SecAgg+ stage's reply record on the
    way out (`corrupt_stage(node, stage, record, earlier)`, `earlier`: (stage, node) ->
    the records the other clients sent so far, for replays)."""
    earlier: dict = {}

    def masked_corrupter(msg, context, call_next):
        stage = None
        if RECORD_KEY_CONFIGS in msg.content.config_records:
            stage = msg.content.config_records[RECORD_KEY_CONFIGS].get(SecAggKey.STAGE)
        reply = call_next(msg, context)
        if not reply.has_content() or RECORD_KEY_CONFIGS not in reply.content.config_records:
            return reply
        record = reply.content.config_records[RECORD_KEY_CONFIGS]
        earlier[(stage, context.node_id)] = copy.deepcopy(dict(record))
        if corrupt_masked and SecAggKey.MASKED_PARAMETERS in record:
            record[SecAggKey.MASKED_PARAMETERS] = corrupt_masked(
                context.node_id, list(record[SecAggKey.MASKED_PARAMETERS])
            )
        if corrupt_stage:
            corrupt_stage(context.node_id, stage, record, earlier)
        return reply

    def fitres_corrupter(msg, context, call_next):  # a hostile client changes its update, skips the clip, still masks
        reply = call_next(msg, context)
        if corrupt and reply.has_content() and "fitres.parameters" in reply.content.array_records:
            fitres = compat.recorddict_to_fitres(reply.content, keep_input=False)
            plain = RECORD_KEY_CONFIGS not in msg.content.config_records  # plain updates travel in int8
            if plain:
                fitres.parameters = ndarrays_to_parameters(decode_update(parameters_to_ndarrays(fitres.parameters)))
            fitres = corrupt(context.node_id, fitres)
            if plain:
                fitres.parameters = ndarrays_to_parameters(encode_update(parameters_to_ndarrays(fitres.parameters)))
            reply.content = compat.fitres_to_recorddict(fitres, keep_input=False)
        return reply

    app = ClientApp(mods=list(outer_mods))

    @app.train(
        mods=[
            heads_decoded,
            masked_corrupter,
            secaggplus_when_needed,
            fitres_corrupter,
            update_sent,
            fixedclipping_when_asked,
        ]
    )
    def train(msg: Message, context: Context) -> Message:
        fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
        fitres = train_handler(dict(fitins.config), parameters_to_ndarrays(fitins.parameters), context)
        sent[context.node_id] = (parameters_to_ndarrays(fitres.parameters), fitres.num_examples)
        if received is not None:
            received[context.node_id] = parameters_to_ndarrays(fitins.parameters)
        return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        reply = client_module.evaluate(msg, context)
        if corrupt_eval:
            corrupt_eval(context.node_id, reply.content.metric_records["metrics"])
        return reply

    return app


def run(run_config: dict, app: ClientApp, nodes: int = 4) -> tuple:
    """The run, with the heads sent in float32 unless the config says otherwise: the tests compare the global
    heads with the mean of what clients sent, which the int8 codec moves by its rounding (tested on its own)."""
    run_config = {"heads-codec": "float32", **run_config}
    grid = InProcessGrid(app, nodes, run_config)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    run_dir = run_federation(grid, context, FedConfig.from_mapping(run_config))
    return run_dir, json.loads((run_dir / "summary.json").read_text()), grid


def round_record(run_dir, round_: int = 1) -> dict:
    return json.loads((run_dir / "rounds" / f"round-{round_}.json").read_text())


def global_heads(run_dir, base, round_: int = 1) -> list[np.ndarray]:
    return heads_to_ndarrays(DraftHeads.load(run_dir / "checkpoints" / f"round-{round_}", base))


def weighted_mean(updates: list[tuple[list[np.ndarray], int]]) -> list[np.ndarray]:
    total = sum(w for _, w in updates)
    return [sum(arrays[i].astype(np.float64) * w / total for arrays, w in updates) for i in range(len(updates[0][0]))]


def int8_step(sent: dict, received: dict) -> float:
    """The most a plain update's int8 rounding moves one weight: the largest update's step (its max / 127)."""
    return (
        max(float(np.abs(a - r).max()) for node, (arrays, _) in sent.items() for a, r in zip(arrays, received[node]))
        / 127
    )


def secagg_tolerance(config: FedConfig, sent: list[tuple[list[np.ndarray], int]], sampled: int = 4) -> float:
    """Stochastic quantisation: each client's weighted update is off by < one step 2c/Q, the sum by n steps
    (c and Q by rule for the round's `sampled` clients, common/federation/wire.py)."""
    plan = secagg_plan(config, sampled, sum(a.size for a in sent[0][0]))
    step = 2 * plan.clipping_range / plan.quantization_range
    weights = [w for _, w in sent]
    return len(weights) * step / (sum(weights) / config.weight_cap) + 1e-6


def test_secagg_dp_aggregate_equals_plain_weighted_mean(run_config, tiny_base):
    sent: dict = {}
    run_dir, summary, grid = run(run_config, recording_app(sent))
    assert summary["run"]["status"] == "finished" and len(summary["rounds"]) == 1
    record = round_record(run_dir)
    assert record["aggregated"] and record["participation"]["succeeded"] == 4
    assert len(sent) == 4
    config = FedConfig.from_mapping(run_config)
    expected = weighted_mean(list(sent.values()))
    tolerance = secagg_tolerance(config, list(sent.values()))
    secure = global_heads(run_dir, tiny_base)
    worst = max(float(np.abs(s - e).max()) for s, e in zip(secure, expected))
    assert worst <= tolerance, (worst, tolerance)
    spread = max(float(np.abs(a[i] - expected[i]).max()) for a, _ in sent.values() for i in range(len(a)))
    assert spread > 20 * tolerance  # the clients really differ (DP noise), so the check is not vacuous
    privacy = summary["rounds"][0]["privacy"]
    assert 0 < privacy["epsilon_max"] <= 8.0 and privacy["delta"] == 1e-5
    values = sum(a.size for a in expected)
    assert 4 * values <= record["bytes"]["down_per_client"] < 4 * values + 4096  # the heads and nothing else
    assert 2 * values <= record["bytes"]["up_per_client"] < 2 * values + 4096  # the masked update in uint16
    assert record["client_eval"]["pushed_to"] == 4  # the last round pushes the final heads to every node
    assert record["client_eval"]["evaluated"] == 4
    assert (run_dir / "checkpoints" / "round-1" / "heads.safetensors").is_file()
    assert summary["checkpoints"][0]["head_version"] == 1
    assert (run_dir / "plot.png").is_file()


def test_secagg_survives_a_mid_round_dropout(run_config, tiny_base):
    sent: dict = {}
    plan = FaultPlan(dropout_rate=0.25)
    run_dir, summary, grid = run(run_config, recording_app(sent, outer_mods=[dropout_mod(plan)]))
    record = round_record(run_dir)
    assert record["aggregated"], record["aggregate_note"]
    part = record["participation"]
    assert part["sampled"] == 4 and part["succeeded"] == 3 and part["dropped"] == 1
    [(crashed, reason)] = part["failures"].items()
    assert "simulated dropout in round 1" in reason
    assert plan.drops(1, grid.contexts[int(crashed)].node_config)  # the one the plan chose
    assert len(sent) == 3 and int(crashed) not in sent
    config = FedConfig.from_mapping(run_config)
    expected = weighted_mean(list(sent.values()))
    secure = global_heads(run_dir, tiny_base)
    tolerance = secagg_tolerance(config, list(sent.values()))
    assert max(float(np.abs(s - e).max()) for s, e in zip(secure, expected)) <= tolerance


def _corrupt_plain(node_id: int, fitres: FitRes) -> FitRes:
    arrays = parameters_to_ndarrays(fitres.parameters)
    if node_id == 1000:
        arrays[0][0, 0] = np.nan
    elif node_id == 1001:
        arrays[1] = arrays[1][:-1]
    elif node_id == 1002:
        arrays[2][0, 0] = 1e3
    else:
        return fitres
    return FitRes(fitres.status, ndarrays_to_parameters(arrays), fitres.num_examples, fitres.metrics)


def test_plain_fedavg_rejects_malformed_replies_and_keeps_going(run_config, tiny_base):
    sent: dict = {}
    received: dict = {}
    run_dir, summary, _ = run(
        dict(run_config, secagg=False), recording_app(sent, corrupt=_corrupt_plain, received=received)
    )
    record = round_record(run_dir)
    reasons = sorted(r["reason"] for r in record["participation"]["rejected"])
    assert len(reasons) == 3
    assert any("one finite scale per" in r for r in reasons)  # NaN in an int8 update shows in its scales
    assert any("wrong shape" in r for r in reasons)
    assert any("update norm 1000 above the bound" in r for r in reasons)
    assert record["aggregated"] and record["participation"]["succeeded"] == 1
    honest = sent[1003][0]
    for got, want in zip(global_heads(run_dir, tiny_base), honest):
        np.testing.assert_allclose(got, want, rtol=0, atol=int8_step(sent, received))  # only the honest one
    stored = summary["rounds"][0]["participation"]["rejected"]
    assert sorted(r["reason"] for r in stored) == reasons  # logged in the run store too


def test_bad_values_are_rejected_a_huge_weight_capped_and_the_run_goes_on(run_config, tiny_base):
    """Issue 11: NaN weight, loss="abc", epsilon="x" and bad evaluation replies each cost only their client."""
    sent: dict = {}

    def corrupt(node_id: int, fitres: FitRes) -> FitRes:
        weight, metrics = fitres.num_examples, dict(fitres.metrics)
        if node_id == 1000:
            weight = math.nan
        elif node_id == 1001:
            metrics["loss"] = "abc"
        elif node_id == 1002:
            metrics["epsilon"] = "x"
        elif node_id == 1003:
            weight = 10**12
        return FitRes(fitres.status, fitres.parameters, weight, metrics)

    def corrupt_eval(node_id: int, metrics) -> None:
        if node_id == 1000:
            metrics["head-accuracy"] = 0.5
        elif node_id == 1001:
            metrics["tau"] = [1.0, 2.0]
        elif node_id == 1002:
            metrics["num-examples"] = [3]

    received: dict = {}
    run_dir, summary, _ = run(
        dict(run_config, secagg=False),
        recording_app(sent, corrupt, corrupt_eval=corrupt_eval, received=received),
        nodes=5,
    )
    assert summary["run"]["status"] == "finished"
    record = round_record(run_dir)
    reasons = [
        "non-finite num_examples=nan",
        "loss must be a number, got str 'abc'",
        "epsilon must be a number, got str 'x'",
    ]
    assert sorted((r["node"], r["reason"]) for r in record["participation"]["rejected"]) == list(
        zip([1000, 1001, 1002], reasons)
    )
    assert sorted(r["reason"] for r in summary["rounds"][0]["participation"]["rejected"]) == sorted(reasons)
    assert record["aggregated"] and record["participation"]["succeeded"] == 2
    cap = 12  # max-chunks-per-client: the most an honest client can claim
    assert record["participation"]["capped_weights"] == {"1003": 10**12}
    assert record["participation"]["weights"] == {"1003": cap, "1004": sent[1004][1]}
    expected = weighted_mean([(sent[1003][0], cap), sent[1004]])
    for got, want in zip(global_heads(run_dir, tiny_base), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=int8_step(sent, received))
    client_eval = record["client_eval"]
    assert client_eval["evaluated"] == 2 and sorted(client_eval["rejected"]) == [
        "head-accuracy must be a list of numbers, got float 0.5",
        "num-examples must be an integer, got list [3]",
        "tau must be a number, got list [1.0, 2.0]",
    ]


@pytest.mark.parametrize("claimed", [10**12, 1000])
def test_secagg_rejects_a_plaintext_weight_above_the_cap(run_config, tiny_base, claimed):
    """The server cannot cap a weight inside a masked update, so a claim above the cap (12 chunks here; 1000
    is secagg-max-weight, which passed before and then weighed 1000 in the secure mean while the record said
    "capped at 12") is refused: the client is dropped and named, the others' secure mean stands."""
    sent: dict = {}

    def corrupt(node_id: int, fitres: FitRes) -> FitRes:
        weight = claimed if node_id == 1000 else fitres.num_examples
        return FitRes(fitres.status, fitres.parameters, weight, fitres.metrics)

    run_dir, _, _ = run(run_config, recording_app(sent, corrupt))
    record = round_record(run_dir)
    assert record["participation"]["rejected"] == [
        {"node": 1000, "reason": f"weight {claimed} above the weight cap 12 (max-chunks-per-client, secagg-max-weight)"}
    ]
    assert record["participation"]["capped_weights"] == {}  # nothing claims a cap the server could not apply
    assert record["aggregated"], record["aggregate_note"]
    honest = [v for node, v in sent.items() if node != 1000]
    tolerance = secagg_tolerance(FedConfig.from_mapping(run_config), list(honest))
    expected = weighted_mean(honest)
    secure = global_heads(run_dir, tiny_base)
    assert max(float(np.abs(s - e).max()) for s, e in zip(secure, expected)) <= tolerance


def test_secagg_rejects_a_malformed_masked_vector_and_unmasks_the_rest(run_config, tiny_base):
    sent: dict = {}

    def corrupt_masked(node_id: int, payload: list) -> list:
        if node_id == 1001:
            return payload[:-1]  # one array short
        if node_id == 1002:
            return payload[:1] + [ndarray_to_bytes(np.zeros((3, 3), dtype=np.int64))] + payload[2:]
        return payload

    run_dir, _, _ = run(run_config, recording_app(sent, corrupt_masked=corrupt_masked), nodes=5)
    record = round_record(run_dir)
    reasons = sorted(r["reason"] for r in record["participation"]["rejected"])
    assert len(reasons) == 2
    assert any("wrong number of masked arrays" in r for r in reasons) and any("wrong shape" in r for r in reasons)
    assert record["aggregated"], record["aggregate_note"]
    honest = [v for node, v in sent.items() if node not in (1001, 1002)]
    expected = weighted_mean(honest)
    tolerance = secagg_tolerance(FedConfig.from_mapping(run_config), list(honest), sampled=5)
    secure = global_heads(run_dir, tiny_base)
    assert max(float(np.abs(s - e).max()) for s, e in zip(secure, expected)) <= tolerance


def _init_heads(tiny_base, tmp_path) -> tuple[str, list[np.ndarray]]:
    folder = DraftHeads.fresh(tiny_base, 2).save(tmp_path / "init-heads")
    return str(folder), heads_to_ndarrays(DraftHeads.load(folder, tiny_base))


@pytest.mark.parametrize("secagg", [True, False])
def test_int8_heads_go_down_and_the_mean_update_is_added_to_the_float32_heads(run_config, tiny_base, tmp_path, secagg):
    """heads-codec=int8: clients train from the int8-rounded heads and send their update; the server adds the
    mean update to its float32 heads, so the rounding never enters the global heads."""
    heads = DraftHeads.fresh(tiny_base, 2)
    with torch.no_grad():  # trained-looking weights: a fresh layout (zeros, identities) is exact in int8
        for parameter in heads.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    init = str(heads.save(tmp_path / "init-heads"))
    start = heads_to_ndarrays(DraftHeads.load(init, tiny_base))
    config = dict(run_config, **{"dp": False, "init-heads": init, "heads-codec": "int8", "secagg": secagg})
    received = as_received(start, "int8")
    assert max(float(np.abs(r - s).max()) for r, s in zip(received, start)) > 1e-4  # the rounding is real
    sent: dict = {}
    run_dir, _, _ = run(config, recording_app(sent))
    record = round_record(run_dir)
    assert record["aggregated"], record["aggregate_note"]
    updates = [([a - r for a, r in zip(arrays, received)], w) for arrays, w in sent.values()]
    expected = [s + m for s, m in zip(start, weighted_mean(updates))]
    if secagg:
        tolerance = secagg_tolerance(FedConfig.from_mapping(config), list(sent.values()))
    else:  # each update travels in float16
        tolerance = max(float(np.abs(a).max()) for arrays, _ in updates for a in arrays) / 127
    worst = max(float(np.abs(g - e).max()) for g, e in zip(global_heads(run_dir, tiny_base), expected))
    assert worst <= tolerance, (worst, tolerance)
    values = sum(a.size for a in start)
    assert values <= record["bytes"]["down_per_client"] < values + 4096  # one byte a weight, plus row scales


def _distance(arrays: list[np.ndarray], reference: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((a.astype(np.float64) - r) ** 2) for a, r in zip(arrays, reference))))


def test_plain_fedavg_refuses_an_update_beyond_the_norm_bound(run_config, tiny_base, tmp_path):
    """Issue 29 item 6: an update boosted 1e6x and clipped element-wise into range was accepted (178x the honest
    update's distance from the mean). Every update is now bounded in L2; in plain rounds the server checks it."""
    init, start = _init_heads(tiny_base, tmp_path)
    config = dict(run_config, **{"secagg": False, "dp": False, "init-heads": init})
    sent: dict = {}
    limit = FedConfig.from_mapping(config).secagg_clipping_range

    def boost(node_id: int, fitres: FitRes) -> FitRes:  # its update, as it travels
        if node_id != 1000:
            return fitres
        arrays = [np.clip(1e6 * a, -limit, limit) for a in parameters_to_ndarrays(fitres.parameters)]
        return FitRes(fitres.status, ndarrays_to_parameters(arrays), fitres.num_examples, fitres.metrics)

    run_dir, _, _ = run(config, recording_app(sent, boost))
    record = round_record(run_dir)
    [rejected] = record["participation"]["rejected"]
    assert rejected["node"] == 1000 and "update norm" in rejected["reason"] and "above the bound" in rejected["reason"]
    assert record["aggregated"], record["aggregate_note"]
    bound = record["update_norm"]["bound"]
    assert record["update_norm"]["checked"] and record["update_norm"]["max"] <= bound
    honest = [v for node, v in sent.items() if node != 1000]
    update = weighted_mean(honest)[0] - start[0]
    largest = max(float(np.abs(arrays[0] - start[0]).max()) for arrays, _ in honest)  # each travelled in int8
    np.testing.assert_allclose(global_heads(run_dir, tiny_base)[0] - start[0], update, rtol=0, atol=largest / 127)


def test_honest_clients_clip_their_update_to_the_bound_under_secagg(run_config, tiny_base, tmp_path):
    """Under SecAgg+ the server cannot see a masked update's norm: honest clients clip theirs (Flower's
    fixedclipping_mod, with the bound every train message carries), so the secure mean moves at most the bound."""
    init, start = _init_heads(tiny_base, tmp_path)
    bound = 1e-3
    config = dict(run_config, **{"dp": False, "init-heads": init, "update-max-norm": bound, "lr": 0.05})
    sent: dict = {}
    run_dir, _, _ = run(config, recording_app(sent))
    record = round_record(run_dir)
    assert record["aggregated"] and record["update_norm"] == {"bound": bound, "checked": False}
    assert min(_distance(arrays, start) for arrays, _ in sent.values()) > 10 * bound  # what they trained
    tolerance = secagg_tolerance(FedConfig.from_mapping(config), list(sent.values()))
    moved = _distance(global_heads(run_dir, tiny_base), start)
    size = sum(a.size for a in start)
    assert 0 < moved <= bound + tolerance * np.sqrt(size)


def test_a_device_reveals_its_spending_and_nothing_else_of_its_data(run_config, tmp_path):
    """Issue 29 item 2: a device answered evaluation with its loss and accuracy on private held-out data, and its
    train replies carried loss and accuracy in plaintext under SecAgg+. Now a device (state-dir) sends its
    update, its privacy spending and the weight cap; its own log keeps the rest. A simulated client reports all."""
    from flwr.app.message_type import MessageType

    from client.client_app import DEVICE_TRAIN_METRICS
    from common.federation import protocol as P

    config = dict(run_config, **{"max-chunks-per-client": 40, "fraction-evaluate": 1.0})
    states = {i: tmp_path / f"device-{i}" for i in (0, 1)}
    grid = InProcessGrid(client_module.app, 3, config, {i: {STATE_DIR_KEY: str(s)} for i, s in states.items()})
    seen: list = []
    real = grid.send_and_receive

    def spy(messages, *, timeout=None):
        replies = list(real(messages, timeout=timeout))
        seen.extend(replies)
        return replies

    grid.send_and_receive = spy
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    run_dir = run_federation(grid, context, FedConfig.from_mapping(config))
    devices = {1000 + i for i in states}  # InProcessGrid: node 1000 + partition
    record = round_record(run_dir)
    assert record["aggregated"] and record["client_eval"]["withheld"] == 2
    train = [r for r in seen if P.FITRES_METRICS in r.content.config_records]
    evals = [r for r in seen if r.metadata.message_type == MessageType.EVALUATE]
    assert len(train) == 3 and len(evals) == 3
    for reply in train:
        metrics = dict(reply.content.config_records[P.FITRES_METRICS])
        weight = reply.content.metric_records[P.FITRES_NUM_EXAMPLES]["num_examples"]
        if reply.metadata.src_node_id in devices:
            assert set(metrics) == set(DEVICE_TRAIN_METRICS) and weight == 40  # the cap, not its 36 chunks
        else:
            assert P.LOSS in metrics and weight == metrics[P.NUM_TRAIN_CHUNKS] < 40
    for reply in evals:
        metrics = dict(reply.content.metric_records[P.EVAL_METRICS_RECORD])
        if reply.metadata.src_node_id in devices:
            assert metrics == {P.NUM_EXAMPLES: 0, P.WITHHELD: 1}
        else:
            assert metrics[P.NUM_EXAMPLES] > 0 and P.HEAD_ACCURACY in metrics
    for state in states.values():  # the device keeps its whole story for its owner
        events = [json.loads(line) for line in (state / "events.jsonl").read_text().splitlines()]
        done = next(e for e in events if e["event"] == "train-done")
        assert P.LOSS in done["metrics"] and done["weight"] == done["metrics"][P.NUM_TRAIN_CHUNKS]
        assert P.HEAD_ACCURACY in next(e for e in events if e["event"] == "eval")["metrics"]


HOSTILE = 1004  # the last of 5 nodes: it answers after node 1000, so it can replay what 1000 sent


def _hostile_reply(attack: str):
    """What node HOSTILE does to its SecAgg+ replies in each attack of issue 29 item 5."""
    from flwr.common.secure_aggregation.secaggplus_constants import Stage

    def corrupt(node: int, stage: str, record, earlier: dict) -> None:
        if node != HOSTILE:
            return
        if attack == "replayed-setup" and stage == Stage.SETUP:
            for key in (SecAggKey.PUBLIC_KEY_1, SecAggKey.PUBLIC_KEY_2):
                record[key] = earlier[(stage, 1000)][key]
        elif attack == "garbage-ciphertexts" and stage == Stage.SHARE_KEYS:
            record[SecAggKey.CIPHERTEXT_LIST] = [os.urandom(len(c)) for c in record[SecAggKey.CIPHERTEXT_LIST]]
        elif attack == "replayed-share-keys" and stage == Stage.SHARE_KEYS:
            for key in (SecAggKey.DESTINATION_LIST, SecAggKey.CIPHERTEXT_LIST):
                record[key] = earlier[(stage, 1000)][key]
        elif stage == Stage.UNMASK and attack.endswith("share"):
            nids, shares = list(record[SecAggKey.NODE_ID_LIST]), list(record[SecAggKey.SHARE_LIST])
            victim = nids.index(1001)
            if attack == "garbage-share":  # well formed: its index, then random chunks
                shares[victim] = shares[victim][:4] + os.urandom(len(shares[victim]) - 4)
            elif attack == "truncated-share":
                shares[victim] = shares[victim][:-5]
            elif attack == "empty-share":
                shares[victim] = b""
            elif attack == "duplicated-share":  # node 1000's share of the same secret, sent again
                theirs = earlier[(stage, 1000)]
                shares[victim] = theirs[SecAggKey.SHARE_LIST][theirs[SecAggKey.NODE_ID_LIST].index(1001)]
            record[SecAggKey.SHARE_LIST] = shares

    return corrupt


@pytest.mark.parametrize(
    "attack,named,reason,in_sum",
    [
        ("replayed-setup", {1000, HOSTILE}, "public key identical to node", False),
        ("garbage-ciphertexts", {HOSTILE}, "key share for node 100", False),
        ("replayed-share-keys", {HOSTILE}, "not addressed to this node's neighbours", False),
        ("garbage-share", {HOSTILE}, "does not match the others'", True),
        ("truncated-share", {HOSTILE}, "the share for node 1001 is malformed", True),
        ("empty-share", {HOSTILE}, "the share for node 1001 is malformed (0 bytes)", True),
        ("duplicated-share", {HOSTILE}, "repeats node 1000's", True),
    ],
)
def test_a_hostile_secagg_client_is_dropped_and_named_and_the_round_goes_on(
    run_config, tiny_base, attack, named, reason, in_sum
):
    """Issue 29 item 5: garbage, truncated, duplicated or empty unmask shares raised ValueError in Flower's
    combine_shares and failed the run; garbage ciphertexts or a replayed setup or share-keys reply aborted the
    round with the honest nodes recorded as failing. Now the culprit is dropped and named, the honest clients
    are not, and the secure mean is the right one (the hostile node's own update counts when it was dropped
    only at the unmask stage: its masked vector was in the sum, and its mask is removed with the others' shares)."""
    sent: dict = {}
    config = dict(run_config, **{"min-train-clients": 5, "min-available-clients": 5, "fraction-evaluate": 0.0})
    run_dir, summary, _ = run(config, recording_app(sent, corrupt_stage=_hostile_reply(attack)), nodes=5)
    assert summary["run"]["status"] == "finished"
    record = round_record(run_dir)
    rejected = {r["node"]: r["reason"] for r in record["participation"]["rejected"]}
    assert set(rejected) == named, rejected
    assert all(reason in why for why in rejected.values()), rejected
    assert record["participation"]["failures"] == {}  # no honest node is recorded as failing
    assert record["aggregated"], record["aggregate_note"]
    counted = [v for node, v in sent.items() if node not in named or (in_sum and node == HOSTILE)]
    tolerance = secagg_tolerance(FedConfig.from_mapping(config), list(counted), sampled=5)
    secure = global_heads(run_dir, tiny_base)
    assert max(float(np.abs(s - e).max()) for s, e in zip(secure, weighted_mean(counted))) <= tolerance


def test_resume_continues_heads_and_privacy_accounting(run_config, tiny_base, tmp_path):
    config = dict(
        run_config,
        **{
            "num-server-rounds": 2,
            "dp-planned-rounds": 2,
            "run-id": "resumable",
            "fraction-evaluate": 0.0,
            "client-state-dir": str(tmp_path / "client-state"),
        },
    )
    first_dir, first, _ = run(dict(config, **{"num-server-rounds": 1}), recording_app({}))
    assert [r["round"] for r in first["rounds"]] == [1]
    starting_heads = first["run"]["starting_heads"]
    assert len(starting_heads["head_accuracy"]) == 2 and "tau_heads_only" in starting_heads
    # a new federation (fresh contexts: only the clients' state folders remember their accountants)
    run_dir, summary, _ = run(dict(config, **{"resume-from": str(first_dir)}), recording_app({}))
    assert run_dir == first_dir and [r["round"] for r in summary["rounds"]] == [1, 2]
    assert json.loads((run_dir / "run.json").read_text())["resumed_from_round"] == 1
    assert summary["checkpoints"][-1]["head_version"] == 2
    assert summary["run"]["starting_heads"] == starting_heads  # the run's start, not the resumed checkpoint
    record = round_record(run_dir, 2)
    sigma = record["privacy"]["noise_multiplier"][0]
    q = record["privacy"]["q"][0]
    steps = int(round(1 / q))
    expected = epsilon_of([(sigma, q, steps)] * 2, 1e-5)  # two rounds on one accountant, not one fresh one
    for eps in record["privacy"]["epsilon_this_round"].values():
        assert eps == pytest.approx(expected, rel=1e-9)
    assert expected <= 8.0


def test_resume_skips_a_half_written_checkpoint_and_a_run_it_cannot_resume_is_marked_failed(run_config, tmp_path):
    """Issue 29: a truncated weights file made resume fail with "no heads in .../round-N" and the run showed
    "running" forever. Now resume takes the newest checkpoint that loads; with none, the run is failed."""
    from server.store.run_store import RunStore

    config = dict(run_config, **{"num-server-rounds": 2, "run-id": "crashy", "fraction-evaluate": 0.0, "dp": False})
    run_dir, _, _ = run(config, recording_app({}))
    weights = run_dir / "checkpoints" / "round-2" / "heads.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # as a crash mid-write left it
    resumed_dir, summary, _ = run(
        dict(config, **{"num-server-rounds": 3, "resume-from": str(run_dir)}), recording_app({})
    )
    assert resumed_dir == run_dir and summary["run"]["status"] == "finished"
    assert json.loads((run_dir / "run.json").read_text())["resumed_from_round"] == 1  # round 2 is trained again
    assert not list((run_dir / "checkpoints").glob(".*"))  # checkpoints are written atomically: no leftovers
    for folder in (run_dir / "checkpoints").iterdir():
        (folder / "heads.safetensors").write_bytes(b"")
    with pytest.raises(FedLookaheadError, match="resume-from: no usable checkpoint under .* \\(the newest: "):
        run(dict(config, **{"num-server-rounds": 4, "resume-from": str(run_dir)}), recording_app({}))
    with RunStore(str(Path(config["run-dir"]) / "fedla.db"), read_only=True) as store:
        assert store.get_run("crashy")["status"] == "failed"


class Killed(BaseException):
    """Stands for a SIGKILL of the server at a chosen write (nothing after it runs, not even the run's failure)."""


@pytest.mark.parametrize("dies_in", ["save_checkpoint", "record_checkpoint", "record_round"])
def test_a_server_killed_between_a_rounds_writes_loses_no_round(run_config, tmp_path, monkeypatch, dies_in):
    """Issue 29 item 8: killed after round 2's checkpoint but before its store row, the store, summary.json and
    the dashboard showed rounds [1, 3, 4] after resume. Now a checkpoint exists only once its round is recorded,
    and resume reconciles the store with the checkpoints, wherever the server died in round 2's writes."""
    import server.run.recorder as recorder_module
    from server.run.recorder import Recorder
    from server.store.run_store import RunStore

    config = dict(run_config, **{"num-server-rounds": 4, "run-id": "killed", "fraction-evaluate": 0.0, "dp": False})
    target = recorder_module if dies_in == "save_checkpoint" else RunStore
    real = getattr(target, dies_in)

    def dies_at_round_2(*args, **kwargs):
        if dies_in == "save_checkpoint" and args[1].name == "round-2":
            raise Killed
        if dies_in != "save_checkpoint" and getattr(args[2], "round", args[2]) == 2:  # a RoundRecord or a round
            raise Killed
        return real(*args, **kwargs)

    monkeypatch.setattr(target, dies_in, dies_at_round_2)
    monkeypatch.setattr(Recorder, "finish", lambda self, status: None)  # a killed server marks nothing
    with pytest.raises(Killed):
        run(config, recording_app({}))
    monkeypatch.undo()
    run_dir = Path(config["run-dir"]) / "killed"
    _, summary, _ = run(dict(config, **{"resume-from": str(run_dir)}), recording_app({}))
    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3, 4]
    assert [c["round"] for c in summary["checkpoints"]] == [1, 2, 3, 4]
    assert [c["head_version"] for c in summary["checkpoints"]] == [1, 2, 3, 4]
    with RunStore(str(Path(config["run-dir"]) / "fedla.db"), read_only=True) as store:
        assert [r["round"] for r in store.get_rounds("killed")] == [1, 2, 3, 4]
        assert store.get_run("killed")["status"] == "finished"


def test_resume_restores_a_round_row_an_older_server_lost(run_config, tmp_path):
    """The order of the writes used to be checkpoint first: a run killed then has a checkpoint and a round file
    but no store row. Resume puts the row back from rounds/round-N.json."""
    from server.store.run_store import RunStore

    config = dict(run_config, **{"num-server-rounds": 2, "run-id": "old-order", "fraction-evaluate": 0.0, "dp": False})
    run_dir, summary, _ = run(config, recording_app({}))
    before = summary["rounds"][1]
    with RunStore(str(Path(config["run-dir"]) / "fedla.db")) as store:
        assert store.forget_rounds_after("old-order", 1) == [2]  # as the old order's crash left it
    _, summary, _ = run(dict(config, **{"num-server-rounds": 3, "resume-from": str(run_dir)}), recording_app({}))
    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3]
    restored = summary["rounds"][1]
    assert {k: v for k, v in restored.items() if k != "recorded_at"} == {
        k: v for k, v in before.items() if k != "recorded_at"
    }


def test_a_dp_resume_without_the_clients_accountants_trains_nothing(run_config, tmp_path):
    """Issue 29: resumed without client-state-dir, simulated clients started their accountants afresh and the
    run reported epsilon 5.95 where 7.99 was spent. Now each refuses to train, saying why."""
    config = dict(run_config, **{"num-server-rounds": 1, "run-id": "no-accountants", "fraction-evaluate": 0.0})
    first_dir, _, _ = run(config, recording_app({}))
    resumed = dict(config, **{"num-server-rounds": 2, "resume-from": str(first_dir)})
    run_dir, summary, _ = run(resumed, recording_app({}))
    record = round_record(run_dir, 2)
    assert not record["aggregated"] and record["participation"]["succeeded"] == 0, record["participation"]
    failures = record["participation"]["failures"]
    assert len(failures) == 4 and all(
        "resume-from with DP needs this client's accountant" in f for f in failures.values()
    )


def test_too_few_nodes_fails_fast_with_a_clear_error(run_config):
    config = dict(run_config, **{"min-available-clients": 5, "min-train-clients": 3})
    with pytest.raises(FedLookaheadError, match="only 3 node.*min-available-clients is 5"):
        run(config, recording_app({}), nodes=3)


def test_dashboard_api_over_a_store_filled_by_a_real_simulation(run_config):
    """The dashboard reads what the real ServerApp loop wrote: two SecAgg+ DP rounds of 3 ClientApps."""
    from fastapi.testclient import TestClient

    from server.dashboard.app import create_app

    config = dict(run_config, **{"num-server-rounds": 2, "run-id": "real-sim"})
    run_dir, summary, _ = run(config, client_module.app, nodes=3)
    with TestClient(create_app(f"sqlite:///{run_dir.parent / 'fedla.db'}"), base_url=LOOPBACK_URL) as api:
        runs = api.get("/api/runs").json()
        assert [r["run_id"] for r in runs] == ["real-sim"]
        rounds = api.get("/api/runs/real-sim/rounds").json()
        assert [r["round"] for r in rounds] == [1, 2]
        assert all(r["participation"]["succeeded"] == 3 for r in rounds)
        assert 0 < rounds[0]["privacy"]["epsilon_max"] < rounds[1]["privacy"]["epsilon_max"] <= 8.0
        assert [r["metrics"]["train_loss"] for r in rounds] == [r["metrics"]["train_loss"] for r in summary["rounds"]]
        page = api.get("/runs/real-sim")
        assert page.status_code == 200 and "real-sim" in page.text
        checkpoint = api.get("/runs/real-sim/checkpoint")
        assert checkpoint.status_code == 200 and len(checkpoint.content) > 0
        assert api.get("/api/runs/nope").status_code == 404
