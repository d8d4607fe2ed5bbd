"""Federated building blocks without a federation: config, wire format and checks, DP accounting, clipping, budget."""

from __future__ import annotations

import copy
import json
import math
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant

from client.client_app import train_handler
from client.node_config import NUM_PARTITIONS_KEY, PARTITION_ID_KEY
from client.partitions import PackagePartitioner
from client.training.dp import PrivacyState, epsilon_of
from client.training.run_state import load_state, save_state
from common.data.chunks import stdlib_dir
from common.data.features import compute_features, fast_feature_dtype
from common.errors import FedLookaheadError
from common.federation.config import DEFAULTS, HELP, FedConfig
from common.federation.protocol import ReplyError, TrainReply
from common.federation.records import (
    BaseMismatchError,
    check_base,
    heads_config_dict,
    heads_from_records,
    heads_records,
    heads_to_ndarrays,
    load_ndarrays,
    validate_masked,
    validate_update,
    wire_shapes,
)
from common.heads.lookahead import DraftHeads
from common.training.loop import feature_loader, heads_loss, mixed_precision_autocast, upcast_grad_samples
from server.federation import FRESH_DP_VERDICT, NO_DP_VERDICT, privacy_plan

REPO = Path(__file__).resolve().parents[1]


def test_pyproject_run_config_is_fedconfig():
    """Flower reads the defaults from pyproject.toml; FedConfig is their source: same keys, order, values, help."""
    text = (REPO / "pyproject.toml").read_text()
    table = tomllib.loads(text)["tool"]["flwr"]["app"]["config"]
    assert table == DEFAULTS and list(table) == list(DEFAULTS)
    section = text.split("[tool.flwr.app.config]\n", 1)[1].split("\n[", 1)[0]
    comments = dict(re.findall(r"^([a-z0-9-]+) = .*?  # (.*)$", section, re.M))
    assert comments == HELP
    assert FedConfig.from_mapping({}) == FedConfig()  # the dataclass's own defaults are a valid run
    assert "federations" not in tomllib.loads(text)["tool"]["flwr"]


@pytest.mark.parametrize(
    "knobs, budget, verdict",
    [
        ({"init-heads": "fresh"}, 8.0, FRESH_DP_VERDICT),
        ({"init-heads": "public"}, 8.0, None),
        ({"init-heads": "public", "dp-noise-multiplier": 1.2}, None, None),  # a fixed sigma has no target
        ({"init-heads": "fresh", "dp": False}, None, NO_DP_VERDICT),
    ],
)
def test_the_privacy_plan_states_budget_and_verdict_before_round_1(knobs, budget, verdict):
    plan = privacy_plan(FedConfig.from_mapping(knobs), start_round=1)
    assert plan["epsilon_budget"] == budget and plan["verdict"] == verdict and plan["dp"] == knobs.get("dp", True)
    assert privacy_plan(FedConfig.from_mapping({"init-heads": "fresh"}), start_round=3)["verdict"] is None  # resumed


def test_config_rejects_unknown_keys_and_impossible_minimums():
    with pytest.raises(FedLookaheadError, match="unknown run-config"):
        FedConfig.from_mapping({"num-rounds": 3})
    with pytest.raises(FedLookaheadError, match="min-train-clients"):
        FedConfig.from_mapping({"min-train-clients": 5, "min-available-clients": 3})
    with pytest.raises(FedLookaheadError, match="below secagg-num-shares"):
        FedConfig.from_mapping({"secagg-num-shares": 4, "secagg-reconstruction-threshold": 4})
    device = FedConfig.from_mapping({}, {"dp-target-epsilon": 2.0, PARTITION_ID_KEY: 3})
    assert device.dp_target_epsilon == 2.0  # a device may be stricter than the run


def test_heads_roundtrip_and_base_check(tiny_base):
    heads = DraftHeads.fresh(tiny_base, 2)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    arrays, config = heads_records(heads)
    again = heads_from_records(arrays, config, tiny_base)
    for a, b in zip(heads_to_ndarrays(heads), heads_to_ndarrays(again)):
        np.testing.assert_array_equal(a, b)
    other = dict(heads_config_dict(heads), **{"base-fingerprint": "0123456789abcdef"})
    with pytest.raises(BaseMismatchError, match="base model mismatch.*0123456789abcdef"):
        check_base(other, tiny_base)


@pytest.mark.parametrize("arch", ["parallel", "recurrent", "eagle"])
def test_the_wire_order_is_the_state_dicts(tiny_base, arch):
    heads = DraftHeads.fresh(tiny_base, 2, arch=arch)
    assert wire_shapes(heads) == [(name, tuple(t.shape)) for name, t in heads.state_dict().items()]


def test_validation_names_the_problem(tiny_base):
    heads = DraftHeads.fresh(tiny_base, 2)
    shapes = wire_shapes(heads)
    good = heads_to_ndarrays(heads)
    assert validate_update(good, shapes, bound=8.0) is None
    nan = [a.copy() for a in good]
    nan[1][0] = np.nan
    assert "non-finite" in validate_update(nan, shapes, 8.0)
    inf = [a.copy() for a in good]
    inf[0][0, 0] = np.inf
    assert "non-finite" in validate_update(inf, shapes, 8.0)
    big = [a.copy() for a in good]
    big[2][0, 0] = 100.0
    assert "out-of-range" in validate_update(big, shapes, 8.0)
    assert "wrong shape" in validate_update([good[0][:-1]] + good[1:], shapes, 8.0)
    assert "wrong number" in validate_update(good[:-1], shapes, 8.0)
    assert "dtype" in validate_update([good[0].astype(np.int64)] + good[1:], shapes, 8.0)
    masked = [np.array([5])] + [np.zeros(s, dtype=np.int64) for _, s in shapes]
    assert validate_masked(masked, shapes, 2**32) is None
    assert "out-of-range" in validate_masked([np.array([-1])] + masked[1:], shapes, 2**32)
    assert "wrong shape" in validate_masked(masked[:1] + [np.zeros((3, 3), dtype=np.int64)] + masked[2:], shapes, 2**32)
    assert "integers" in validate_masked(masked[:1] + [m.astype(np.float32) for m in masked[1:]], shapes, 2**32)
    assert TrainReply.from_metrics(1, {"epsilon": math.inf, "loss": 1.0}).epsilon == math.inf  # no DP is honest
    with pytest.raises(ReplyError, match="non-finite"):
        TrainReply.from_metrics(1, {"loss": float("nan")})
    with pytest.raises(ReplyError, match="out-of-range"):
        TrainReply.from_metrics(1, {"acc-1": 1.5})
    with pytest.raises(FedLookaheadError, match="non-finite"):
        load_ndarrays(heads, nan)


def test_restored_accountant_equals_a_continuous_one(tmp_path):
    """Opacus golden: sigma 1, q 0.05, 10 rounds x 20 steps, delta 1e-5 -> eps 5.37 (summing rounds gives 24.8)."""
    continuous = RDPAccountant()
    path = tmp_path / "privacy-run.json"
    for round_ in range(10):
        context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
        state = load_state(context, path, "run")  # a fresh process each round: only the disk copy survives
        assert sum(n for _, _, n in state.history) == 20 * round_
        engine = PrivacyEngine(accountant="rdp")
        engine.accountant.history = list(state.history)
        for _ in range(20):
            engine.accountant.step(noise_multiplier=1.0, sample_rate=0.05)
            continuous.step(noise_multiplier=1.0, sample_rate=0.05)
        state.history = [
            tuple(h) for h in engine.accountant.history
        ]  # what client.training.local_round.train_round keeps
        state.noise_multiplier = 1.0
        save_state(context, path, state)
        restored = PrivacyState.from_record(context.state.config_records["fedla-privacy"])
        assert restored.history == state.history
    final = load_state(Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}), path, "run")
    expected = continuous.get_epsilon(1e-5)
    assert expected == pytest.approx(5.37, abs=0.01)
    assert epsilon_of(final.history, 1e-5) == pytest.approx(expected, rel=1e-9)
    fresh_engine = PrivacyEngine(accountant="rdp")
    fresh_engine.accountant.history = list(final.history)
    assert fresh_engine.accountant.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
    naive = sum(epsilon_of([(1.0, 0.05, 20)], 1e-5) for _ in range(10))
    assert naive == pytest.approx(24.8, abs=0.1)  # what a fresh PrivacyEngine per round would (wrongly) add up to
    assert sum(n for _, _, n in json.loads(path.read_text())["history"]) == 200


def _per_sample_gradients(heads: DraftHeads, features, clip: float, mixed: bool):
    """Opacus's per-sample gradients of one batch (as training casts them) and its DP optimizer."""
    optimizer = torch.optim.SGD(heads.parameters(), lr=0.1)
    module, dp_optimizer, _ = PrivacyEngine(accountant="rdp").make_private(
        module=heads,
        optimizer=optimizer,
        data_loader=feature_loader(features, 4, False),
        noise_multiplier=0.0,
        max_grad_norm=clip,
        poisson_sampling=True,
    )
    with mixed_precision_autocast(features.hidden.device, mixed):
        loss = heads_loss(module, features.hidden, features.tokens, features.greedy)
    loss.backward()
    params = [p for p in heads.parameters() if p.requires_grad]
    computed_in = {p.grad_sample.dtype for p in params}
    upcast_grad_samples(module)
    per_sample = torch.cat([p.grad_sample.reshape(len(features), -1) for p in params], dim=1)
    return module, dp_optimizer, params, per_sample, computed_in


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-autocast"])
def test_per_sample_clipping_bound(tiny_base, mixed):
    """Clipping bounds every chunk's gradient, also when the forward runs under bf16 autocast (the
    per-sample gradients are computed in bf16 there and cast to fp32 before Opacus takes their norms)."""
    if mixed and fast_feature_dtype(tiny_base.device) != torch.bfloat16:
        pytest.skip("this device has no native bf16: training never autocasts here")
    torch.manual_seed(0)
    heads = DraftHeads.fresh(tiny_base, 2)
    chunks = torch.randint(0, tiny_base.vocab_size, (12, 16))
    clip = 0.05
    features = compute_features(tiny_base, chunks, progress=False)
    reference = copy.deepcopy(heads)
    module, dp_optimizer, params, per_sample, computed_in = _per_sample_gradients(heads, features, clip, mixed)
    assert computed_in == {torch.bfloat16 if mixed else torch.float32}
    assert all(p.grad_sample.dtype == torch.float32 for p in params)
    norms = per_sample.norm(dim=1)
    assert (norms > clip).all()  # the bound actually binds in this test
    dp_optimizer.clip_and_accumulate()
    summed = torch.cat([p.summed_grad.reshape(-1) for p in params])
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    expected = (per_sample * factors[:, None]).sum(0)
    torch.testing.assert_close(summed, expected, rtol=1e-4, atol=1e-7)
    assert ((per_sample * factors[:, None]).norm(dim=1) <= clip * (1 + 1e-5)).all()
    assert "embed" not in dict(heads.named_modules()) and len(list(heads.parameters())) == len(params)
    module._close()
    if mixed:  # bf16 products: the same gradients to within bf16 rounding
        exact = _per_sample_gradients(reference, features, clip, mixed=False)[3]
        assert ((per_sample - exact).norm(dim=1) / exact.norm(dim=1)).max() < 0.02


def _client_context(tiny_base_dir, **overrides) -> Context:
    run_config = {
        "base-model-dir": str(tiny_base_dir),
        "chunk-len": 32,
        "max-chunks-per-client": 12,
        "num-heads": 2,
        "batch-size": 4,
        "num-server-rounds": 2,
        "dp-target-epsilon": 8.0,
        "data-source": str(stdlib_dir() / "json"),
        **overrides,
    }
    return Context(
        run_id=7,
        node_id=3,
        node_config={PARTITION_ID_KEY: 0, NUM_PARTITIONS_KEY: 1},
        state=RecordDict(),
        run_config=run_config,
    )


def test_client_past_its_budget_does_not_train(tiny_base, tiny_base_dir):
    context = _client_context(tiny_base_dir)
    heads = DraftHeads.fresh(tiny_base, 2)
    fit_config = {**heads_config_dict(heads), "fedla-run-id": "budget-test", "server-round": 1}
    arrays = heads_to_ndarrays(heads)
    eps = []
    for _ in range(2):  # the planned rounds: train, within budget
        res = train_handler(fit_config, arrays, context)
        assert res.metrics["skipped"] == 0 and res.num_examples > 0
        eps.append(res.metrics["epsilon"])
    assert eps[0] < eps[1] <= 8.0
    assert eps[1] > 7.0  # sigma was calibrated for exactly the planned rounds
    res = train_handler(fit_config, arrays, context)  # a third round would exceed epsilon 8
    assert res.metrics["skipped"] == 1 and res.num_examples == 0
    assert "privacy budget" in res.metrics["skip-reason"]
    assert res.metrics["epsilon"] == pytest.approx(eps[1])
    from flwr.common import parameters_to_ndarrays

    for sent, original in zip(parameters_to_ndarrays(res.parameters), arrays):
        np.testing.assert_array_equal(sent, original)  # nothing learned from its data is sent


def test_client_refuses_another_base(tiny_base, tiny_base_dir):
    context = _client_context(tiny_base_dir)
    heads = DraftHeads.fresh(tiny_base, 2)
    fit_config = {**heads_config_dict(heads), "base-fingerprint": "feedfacefeedface"}
    with pytest.raises(BaseMismatchError, match="base model mismatch"):
        train_handler(fit_config, heads_to_ndarrays(heads), context)


def test_package_partitioner_keeps_packages_whole():
    import datasets

    groups = ["a"] * 5 + ["b"] * 3 + ["c"] * 3 + ["d"] * 1
    partitioner = PackagePartitioner(2)
    partitioner.dataset = datasets.Dataset.from_dict({"idx": list(range(len(groups))), "group": groups})
    parts = [set(partitioner.load_partition(p)["group"]) for p in range(2)]
    assert parts[0].isdisjoint(parts[1]) and parts[0] | parts[1] == {"a", "b", "c", "d"}
    sizes = [len(partitioner.load_partition(p)) for p in range(2)]
    assert sorted(sizes) == [6, 6]
    with pytest.raises(FedLookaheadError, match="at least one package per client"):
        too_many = PackagePartitioner(5)
        too_many.dataset = partitioner.dataset
        too_many.load_partition(0)


@pytest.mark.parametrize("pattern", ["steady", "spike"])
def test_the_update_bound_by_rule_holds_for_honest_adamw(pattern):
    """update-max-norm = 0: the bound is the most AdamW (torch's defaults, as clients train) can move the weights
    in a round, so the clip it sets never bites an honest client. Checked on a steady push and on the worst
    case of Adam's step (small gradients, then a spike)."""
    config = FedConfig.from_mapping({"lr": 0.01, "max-chunks-per-client": 64, "batch-size": 4, "dp": False})
    steps = config.local_epochs * 16
    weights = torch.nn.Parameter(torch.full((1000,), 7.9))
    start = weights.detach().clone()
    optimizer = torch.optim.AdamW([weights], lr=config.lr)
    for step in range(steps):
        scale = 1e4 if pattern == "spike" and step == steps - 1 else 1e-3
        weights.grad = torch.full_like(weights, -scale)
        optimizer.step()
    moved = float((weights.detach() - start).norm())
    bound = config.update_bound(weights.numel())
    assert (
        bound / 4 < moved <= bound
    )  # about 3.5x loose on these: the worst case is a long run of small steps, then a spike
    assert FedConfig.from_mapping({"update-max-norm": 0.5}).update_bound(10**6) == 0.5
    with pytest.raises(FedLookaheadError, match="dp-level=user needs update-max-norm > 0"):
        FedConfig.from_mapping({"dp-level": "user"})


def test_a_scenario_takes_its_client_count_from_the_command_line():
    from simulations.run import load_scenario, scenario_settings

    run_config, federation = scenario_settings(load_scenario("iid-10"), ["clients-per-round=50"], rounds=2, clients=200)
    assert federation["num-supernodes"] == 200 and run_config["min-available-clients"] == 200
    assert run_config["clients-per-round"] == 50 and run_config["num-server-rounds"] == 2
    assert run_config["min-train-clients"] == 10  # the scenario's own
    FedConfig.from_mapping(run_config).validate()
    run_config, _ = scenario_settings(load_scenario("iid-10"), [], clients=4)
    assert run_config["min-train-clients"] == 4 and run_config["min-available-clients"] == 4  # fewer than it asks
