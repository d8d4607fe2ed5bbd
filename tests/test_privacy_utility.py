"""Issue 12: the privacy-utility benchmark end to end (tiny base), its epsilon accounting against Opacus,
user-level DP (Flower's client-side fixed clipping under SecAgg+), the server optimisers, fewer trainable
parameters."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import flwr.compat.common.recorddict_compat as compat
import numpy as np
import pytest
import torch
from flwr.app import Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.clientapp import ClientApp
from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM
from flwr.supercore.task_identity import TaskIdentity
from opacus.accountants import RDPAccountant

from client.client_app import (
    fixedclipping_when_asked,
    heads_decoded,
    secaggplus_when_needed,
    train_handler,
    update_sent,
)
from client.training.dp import PrivacyState
from client.training.local_round import train_round
from common.data.chunks import stdlib_dir
from common.data.features import base_features
from common.federation import user_dp
from common.federation.config import FedConfig
from common.federation.records import heads_to_ndarrays
from common.federation.user_dp import epsilon_after, noise_multiplier
from common.heads.lookahead import DraftHeads
from server.federation import run_federation
from server.server_optimizer import ServerOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # simulations/ is a folder of scripts
from simulations.inprocess import InProcessGrid  # noqa: E402
from simulations.privacy_utility.__main__ import main  # noqa: E402
from simulations.privacy_utility.configs import QUICK  # noqa: E402
from simulations.privacy_utility.tau import chain_acceptance  # noqa: E402


@pytest.fixture(scope="module")
def quick_result(tiny_base_dir, tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("privacy-utility") / "out.json"
    assert main(["--packages", "--quick", "--base", str(tiny_base_dir), "--json", str(out)]) == 0
    return json.loads(out.read_text()), out


@pytest.fixture(scope="module")
def grid_result(tiny_base_dir, tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("privacy-utility-grid") / "out.json"
    assert main(["--quick", "--base", str(tiny_base_dir), "--json", str(out)]) == 0
    return json.loads(out.read_text()), out


def test_the_population_grid_writes_the_issue_json_labels_emulated_points_and_checks_the_verdict(grid_result):
    """Issue 28's shape: user_dp[eps][cohort][population] with z and the emulated label (a cohort beyond the
    real clients that give the signal, or a population beyond the real one), the forecast beside the
    outcome at every point, the true run through the apps against its emulated seeds, and the plot."""
    result, out = grid_result
    assert result["population_real"] == 24 and result["rounds"] == 2
    check_entry(result["public_only"], heads=2)
    check_entry(result["federated_nodp"], heads=2)
    points = result["user_dp"]["8"]
    assert set(points) == {"4", "8"} and set(points["4"]) == {"24", "100000"}
    assert points["4"]["24"]["emulated"] is False  # 4 real clients give a cohort of 4 its whole signal
    assert points["8"]["24"]["emulated"] is True and points["4"]["100000"]["emulated"] is True
    for cohort, population in (("4", "24"), ("8", "100000")):
        entry = points[cohort][population]
        check_entry(entry, heads=2)
        z = user_dp.noise_multiplier(8.0, 1 / int(population), int(cohort) / int(population), 2)
        assert entry["noise_multiplier"] == pytest.approx(z, rel=1e-4)
        assert entry["forecast"] == user_dp.expected_outcome(entry["signal_to_noise"])
        assert entry["verdict_agrees"] == (entry["forecast"] == entry["outcome"])
    true = result["true_run"]
    assert true["cohort"] == 8 and len(true["emulated_seeds"]) == 2
    assert true["noise_multiplier"] == pytest.approx(true["emulated_noise_multiplier"], rel=1e-3)  # one accounting
    check_entry({"tau_heads_only": true["tau_heads_only"], "acc": true["acc"]}, heads=2)
    assert "8" in result["example_dp"]
    assert out.with_suffix(".png").stat().st_size > 10_000


def check_entry(entry: dict, heads: int = 4) -> None:
    assert isinstance(entry["tau_heads_only"], float) and 1.0 <= entry["tau_heads_only"] <= 1 + heads
    assert len(entry["acc"]) == heads and all(0.0 <= a <= 1.0 for a in entry["acc"])


def test_quick_run_writes_the_issue_json_shape_and_a_plot(quick_result):
    result, out = quick_result
    assert result["clients"] == QUICK.clients and result["rounds"] == QUICK.rounds
    for name in ("public_only", "federated_nodp", "central_nodp"):
        check_entry(result[name])
    assert sorted(result["dp"], key=float) == ["1", "2", "4", "8"]
    for entry in result["dp"].values():
        check_entry(entry)
    assert out.with_suffix(".png").stat().st_size > 10_000
    # per-client figures average to the reported mean
    for entry in (result["public_only"], result["dp"]["8"]):
        clients = entry["per_client"]
        assert len(clients) == result["clients"]
        assert entry["tau_heads_only"] == pytest.approx(
            sum(c["tau_heads_only"] for c in clients) / len(clients), abs=1e-3
        )
    # the chain estimate is validated against a real heads-only AMS-LD decode
    for check in result["tau_validation"].values():
        assert check["decoded_ams_heads_only"] >= 1.0 and check["chain_estimate_same_chunks"] >= 1.0


def test_every_federated_run_folder_carries_the_curve_for_the_dashboard(quick_result):
    """The benchmark leaves the product's curve record in each run's folder, with that run on it (the
    dashboard reads only that record)."""
    from dataclasses import asdict

    from server.run.curve import curve_of_run

    result, _ = quick_result
    run_dir = Path(result["dp"]["2"]["run_dir"])
    curve = asdict(curve_of_run([run_dir]))
    assert curve["epsilon"] == [1.0, 2.0, 4.0, 8.0]
    assert curve["dp"] == [result["dp"][e]["tau_heads_only"] for e in ("1", "2", "4", "8")]
    assert curve["references"]["public_only"] == result["public_only"]["tau_heads_only"]
    assert curve["this_run"] == {"kind": "dp", "epsilon": 2.0, "tau": result["dp"]["2"]["tau_heads_only"]}
    nodp = Path(result["federated_nodp"]["run_dir"])
    assert curve_of_run([nodp]).this_run["kind"] == "federated_nodp"


def test_epsilon_composed_over_all_rounds_matches_opacus_and_stays_under_target(quick_result):
    result, _ = quick_result
    meta = result["meta"]
    batch = meta["scale"]["batch_size"]
    for target, entry in result["dp"].items():
        privacy = entry["privacy"]
        assert privacy["aggregated_rounds"] == result["rounds"] and privacy["skipped_budget"] == 0
        assert 0 < privacy["epsilon_max"] <= float(target) + 1e-6
        # recompute each client's epsilon from its (sigma, q, steps) with Opacus's own accountant
        (sigma,) = privacy["noise_multiplier"]  # one sigma for the whole run
        worst = 0.0
        for chunks in meta["train_chunks"]:
            batches = math.ceil(chunks / batch)
            accountant = RDPAccountant()
            accountant.history = [(sigma, 1 / batches, batches * result["rounds"])]
            worst = max(worst, accountant.get_epsilon(1e-5))
        assert worst == pytest.approx(privacy["epsilon_max"], rel=1e-3, abs=1e-3)
        assert worst <= float(target) + 1e-3
    user = result["user_dp"]["8"]["privacy"]["user_dp"]
    assert user["epsilon"] <= 8.0 + 1e-6 and user["noise_added_by"] == "device"


def test_the_teacher_forced_chain_estimate_counts_leading_hits(tiny_base):
    """tau = 1 + mean number of leading heads that agree with the base's greedy token, by hand."""
    torch.manual_seed(0)
    heads = DraftHeads.fresh(tiny_base, 3)
    features = base_features(tiny_base, torch.randint(0, tiny_base.vocab_size, (3, 12)))
    got = chain_acceptance(heads, features)
    logits = heads(features.hidden.float(), features.tokens)
    length, k_max = 12, 3
    accepted = []
    for b in range(3):
        for t in range(length - k_max):
            n = 0
            for k in range(1, k_max + 1):
                if int(heads.draft_ids[logits[k - 1][b, t].argmax()]) != int(features.greedy[b, t + k]):
                    break
                n += 1
            accepted.append(n)
    assert got["tau_heads_only"] == pytest.approx(1 + sum(accepted) / len(accepted))


# ------------------------------------------------------------------------------ user-level DP


def train_message(global_arrays: list[np.ndarray], config: dict) -> Message:
    # A Message takes its sender's identity from the process; Flower's runtime (or the in-process grid) sets it.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(global_arrays), config), keep_input=True)
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN, group_id="1")


def test_fixed_clipping_bounds_the_update_only_when_the_server_asks():
    rng = np.random.default_rng(0)
    global_arrays = [rng.normal(size=(8, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)]
    update = [rng.normal(scale=5.0, size=a.shape).astype(np.float32) for a in global_arrays]

    def handler(msg, context):
        fitres = FitRes(
            Status(Code.OK, ""), ndarrays_to_parameters([g + u for g, u in zip(global_arrays, update)]), 10, {}
        )
        return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)

    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    norm = math.sqrt(sum(float((u.astype(np.float64) ** 2).sum()) for u in update))
    for clip in (0.1, 1.0):
        reply = fixedclipping_when_asked(train_message(global_arrays, {KEY_CLIPPING_NORM: clip}), context, handler)
        sent = parameters_to_ndarrays(compat.recorddict_to_fitres(reply.content, keep_input=True).parameters)
        delta = [s.astype(np.float64) - g for s, g in zip(sent, global_arrays)]
        clipped = math.sqrt(sum(float((d**2).sum()) for d in delta))
        assert clipped == pytest.approx(clip, rel=1e-4)  # norm 5*sqrt(72) >> clip: scaled down to exactly clip
        for d, u in zip(delta, update):  # direction kept
            np.testing.assert_allclose(d, u * clip / norm, rtol=1e-3, atol=1e-5)
    reply = fixedclipping_when_asked(train_message(global_arrays, {}), context, handler)  # example-level runs
    sent = parameters_to_ndarrays(compat.recorddict_to_fitres(reply.content, keep_input=True).parameters)
    np.testing.assert_allclose(sent[0], global_arrays[0] + update[0], rtol=1e-6)


def test_user_level_noise_calibration_against_opacus():
    config = FedConfig.from_mapping(
        {"dp-level": "user", "update-max-norm": 0.1, "dp-target-epsilon": 4.0, "num-server-rounds": 5}
    )
    sigma = noise_multiplier(config.dp_target_epsilon, config.dp_delta, 4 / 8, config.num_server_rounds)
    accountant = RDPAccountant()
    accountant.history = [(sigma, 0.5, 5)]
    assert accountant.get_epsilon(1e-5) <= 4.0 + 1e-3
    assert epsilon_after(sigma, 4 / 8, 5, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5))
    accountant.history = [(sigma * 0.9, 0.5, 5)]  # the calibrated sigma is the smallest that fits
    assert accountant.get_epsilon(1e-5) > 4.0


def test_user_level_dp_round_clips_every_update_and_noises_the_secure_mean(
    tiny_base_dir, tiny_base, tmp_path, one_thread
):
    """Under SecAgg+ with dp-level=user: every client's update has norm <= update-max-norm (Flower's
    fixedclipping_mod, before masking), the clients weigh the same, and the new heads are the plain mean
    of the clipped updates plus Gaussian noise of std sigma * clip / n (Flower's server wrapper)."""
    clip, nodes = 0.05, 4
    run_config = {
        "base-model-dir": str(tiny_base_dir),
        "data-source": str(stdlib_dir() / "json"),
        "num-server-rounds": 1,
        "chunk-len": 32,
        "max-chunks-per-client": 12,
        "num-heads": 2,
        "batch-size": 4,
        "lr": 0.01,
        "min-train-clients": nodes,
        "min-available-clients": nodes,
        "node-wait-seconds": 0.0,
        "server-eval-chunks": 0,
        "eval-prompts": 1,
        "eval-max-new-tokens": 0,
        "fraction-evaluate": 0.0,
        "run-dir": str(tmp_path / "runs"),
        "init-heads": "fresh",
        "dp-level": "user",
        "user-dp-noise": "server",
        "update-max-norm": clip,
        "dp-target-epsilon": 8.0,
        "heads-codec": "float32",  # the clients' starting heads are the server's exactly: the noise is all that differs
    }
    sent: dict = {}
    received: dict = {}

    def recorder(msg, context, call_next):  # between the update's mod and the clipping mod: sees the clipped heads
        reply = call_next(msg, context)
        fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
        received[context.node_id] = parameters_to_ndarrays(fitins.parameters)
        fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
        sent[context.node_id] = (parameters_to_ndarrays(fitres.parameters), fitres.num_examples, fitres.metrics)
        return reply

    app = ClientApp()

    @app.train(mods=[heads_decoded, secaggplus_when_needed, update_sent, recorder, fixedclipping_when_asked])
    def train(msg: Message, context: Context) -> Message:
        fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
        fitres = train_handler(dict(fitins.config), parameters_to_ndarrays(fitins.parameters), context)
        return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)

    grid = InProcessGrid(app, nodes, run_config)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    run_dir = run_federation(grid, context, FedConfig.from_mapping(run_config))
    plan = json.loads((run_dir / "run.json").read_text())["plan"]["user_dp"]
    assert plan["clip"] == clip and plan["clients_per_round"] == nodes and plan["epsilon"] <= 8.0 + 1e-6
    assert len(sent) == nodes
    global_arrays = next(iter(received.values()))
    deltas = []
    for arrays, _weight, metrics in sent.values():
        assert metrics["dp"] == 0  # no Opacus on the client: the noise is the server's
        delta = [a.astype(np.float64) - g for a, g in zip(arrays, global_arrays)]
        assert math.sqrt(sum(float((d**2).sum()) for d in delta)) <= clip * (1 + 1e-4)
        deltas.append(delta)
    assert len({w for _, w, _ in sent.values()}) == 1  # equal weights: sensitivity clip / n
    new = heads_to_ndarrays(DraftHeads.load(run_dir / "checkpoints" / "round-1", tiny_base))
    noise = np.concatenate(
        [(n - g - sum(d[i] for d in deltas) / nodes).ravel() for i, (n, g) in enumerate(zip(new, global_arrays))]
    )
    expected_std = plan["noise_multiplier"] * clip / nodes
    assert plan["noise_std"] == pytest.approx(expected_std)
    assert abs(float(noise.mean())) < 0.05 * expected_std
    assert float(noise.std()) == pytest.approx(expected_std, rel=0.05)


# ------------------------------------------------------------------------------ tricks


def test_server_optimizers_against_their_update_rules():
    current = [np.zeros(3, np.float32)]
    means = [[np.array([1.0, -2.0, 0.5], np.float32)], [np.array([2.0, -1.0, 0.5], np.float32)]]
    avg = ServerOptimizer("fedavg")
    assert np.array_equal(avg.step(current, means[0])[0], means[0][0])  # FedAvg: the mean itself
    m = ServerOptimizer("fedavgm", lr=0.5, momentum=0.9)
    x1 = m.step(current, means[0])
    np.testing.assert_allclose(x1[0], 0.5 * means[0][0])
    x2 = m.step(x1, [x1[0] + means[1][0]])  # delta of round 2 = means[1]
    np.testing.assert_allclose(x2[0], x1[0] + 0.5 * (0.9 * means[0][0] + means[1][0]), rtol=1e-6)
    adam = ServerOptimizer("fedadam", lr=0.1, momentum=0.9, beta2=0.99, tau=1e-3)
    d = means[0][0].astype(np.float64)
    mom, var = 0.1 * d, 0.01 * d * d
    np.testing.assert_allclose(adam.step(current, means[0])[0], 0.1 * mom / (np.sqrt(var) + 1e-3), rtol=1e-5)


def test_fusion_only_dp_training_leaves_the_other_heads_untouched(tiny_base, one_thread):
    torch.manual_seed(0)
    heads = DraftHeads.fresh(tiny_base, 2)
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    features = base_features(tiny_base, torch.randint(0, tiny_base.vocab_size, (16, 16)))
    config = FedConfig.from_mapping({"dp-trainable": "fusion", "batch-size": 4, "dp-target-epsilon": 8.0})
    result = train_round(heads, features, config, PrivacyState("t"))
    assert result.steps > 0 and 0 < result.epsilon <= 8.0
    after = heads.state_dict()
    for name, value in after.items():
        changed = not torch.equal(value, before[name])
        assert changed == name.startswith("fusion"), name


def test_low_rank_dp_training_changes_each_linear_by_a_rank_r_update(tiny_base, one_thread):
    """dp-trainable=lowrank: Opacus trains rank-r factors of every Linear, merged after the round, so the
    heads keep their parameter names and each weight moves by a matrix of rank <= r."""
    torch.manual_seed(0)
    heads = DraftHeads.fresh(tiny_base, 2)
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    features = base_features(tiny_base, torch.randint(0, tiny_base.vocab_size, (16, 16)))
    config = FedConfig.from_mapping(
        {"dp-trainable": "lowrank", "dp-rank": 2, "batch-size": 4, "dp-target-epsilon": 8.0, "lr": 1e-2}
    )
    result = train_round(heads, features, config, PrivacyState("t"))
    assert result.steps > 0 and 0 < result.epsilon <= 8.0
    after = heads.state_dict()
    assert after.keys() == before.keys() and all(p.requires_grad for p in heads.parameters())
    linear_weights = {f"{n}.weight" for n, m in heads.named_modules() if type(m) is torch.nn.Linear}
    assert linear_weights
    for name, value in after.items():
        delta = (value - before[name]).float()
        if name in linear_weights:
            assert 0 < int(torch.linalg.matrix_rank(delta)) <= 2, name
        else:  # biases, norms: frozen under lowrank
            assert torch.equal(value, before[name]), name


def test_a_large_expected_batch_is_taken_in_physical_pieces(tiny_base, one_thread, monkeypatch):
    """Opacus's BatchMemoryManager splits a logical batch above PHYSICAL_BATCH chunks into pieces, with
    one noisy step per logical batch: the accountant counts the planned steps, not the pieces."""
    import client.training.local_round as local_round

    monkeypatch.setattr(local_round, "PHYSICAL_BATCH", 4)
    heads = DraftHeads.fresh(tiny_base, 2)
    features = base_features(tiny_base, torch.randint(0, tiny_base.vocab_size, (32, 16)))
    config = FedConfig.from_mapping({"batch-size": 16, "dp-target-epsilon": 8.0})
    state = PrivacyState("t")
    forwards = []
    heads.register_forward_hook(lambda *_: forwards.append(1))
    result = train_round(heads, features, config, state)
    assert result.steps == 2 and [steps for _, _, steps in state.history] == [2]
    assert len(forwards) > 2  # the two logical batches of ~16 chunks ran as pieces of at most 4


def test_a_server_step_that_would_leave_the_clients_range_is_refused_and_forgotten():
    """Momentum over noised means can carry the heads to NaN or past the range clients accept: the step is
    refused and the optimizer's state left as it was, so the next round starts from the kept heads."""
    current = [np.zeros(3, np.float32)]
    optimizer = ServerOptimizer("fedavgm", lr=1.0, momentum=0.9)
    assert optimizer.checked_step(current, [np.full(3, 0.5, np.float32)], bound=8.0) is not None
    kept = [m.copy() for m in optimizer.m]
    assert optimizer.checked_step(current, [np.full(3, 20.0, np.float32)], bound=8.0) is None
    assert optimizer.checked_step(current, [np.array([0.0, np.nan, 0.0], np.float32)], bound=8.0) is None
    assert all(np.array_equal(a, b) for a, b in zip(optimizer.m, kept))


def test_the_grid_leaves_a_declining_client_out_of_the_mean(tiny_base, one_thread):
    """A client that declines (its budget) has weight 0 in the ServerApp: the grid's emulation leaves it out,
    and a round where every client declines keeps the heads."""
    from common.federation.records import heads_to_ndarrays as arrays_of
    from simulations.privacy_utility.population_grid import Users, federate

    chunks = base_features(tiny_base, torch.randint(0, 200, (4, 16)))
    users = Users([chunks.subset(slice(i, i + 1)) for i in range(4)], chunks)
    config = FedConfig.from_mapping({"dp": False, "update-max-norm": 0.5, "server-optimizer": "fedavgm"})
    start = DraftHeads.fresh(tiny_base, 2)

    def decline(heads, user):
        return False

    heads, refused = federate(start, users, config, decline, None, 2, 2, 0.0, 0, "declined")
    assert refused == 0 and all(np.array_equal(a, b) for a, b in zip(arrays_of(heads), arrays_of(start)))
