"""User-level DP with noise added on the devices (common/federation/user_dp.py, client/noise_share.py): the
accounting, the share a device adds, a device's floor, its ledger entry, and the plan's forecast."""

from __future__ import annotations

import json
import math

import flwr.compat.common.recorddict_compat as compat
import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM
from flwr.supercore.task_identity import TaskIdentity
from opacus.accountants import RDPAccountant

from client.client_app import train_handler
from client.node_config import MIN_NOISE_COHORT_KEY, NUM_PARTITIONS_KEY, PARTITION_ID_KEY, STATE_DIR_KEY
from client.noise_share import SHARE_STATE, noise_share_added, set_clip_bit, set_share, wants_clip_bit
from client.training.floor import DeviceFloor, UserNoise
from client.training.ledger import load_ledger
from common.data.chunks import stdlib_dir
from common.errors import FedLookaheadError
from common.federation import user_dp
from common.federation.config import FedConfig
from common.federation.protocol import (
    USER_DP_BIT_NOISE,
    USER_DP_BIT_SCALE,
    USER_DP_NOISE_COHORT,
    USER_DP_NOISE_MULTIPLIER,
    USER_DP_SAMPLE_RATE,
)
from common.federation.records import heads_config_dict, heads_to_ndarrays
from common.heads.lookahead import DraftHeads
from server.federation import check_federation, privacy_plan


def test_shares_sum_to_the_accounted_noise_and_the_multiplier_fits_the_budget():
    z = user_dp.noise_multiplier(8.0, 1e-5, 0.01, 10)
    accountant = RDPAccountant()
    accountant.history = [(z, 0.01, 10)]
    assert accountant.get_epsilon(1e-5) <= 8.0 + 1e-3
    assert user_dp.epsilon_after(z, 0.01, 10, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5))
    shares = user_dp.noise_cohort(1024, 0.3)
    assert shares == 717
    std = user_dp.share_std(z, 0.5, shares)
    rng = np.random.default_rng(0)
    total = rng.normal(0.0, std, (shares, 20_000)).sum(axis=0)  # exactly `shares` survive: the accounted noise
    assert total.std() == pytest.approx(z * 0.5, rel=0.03)


def test_the_forecast_says_when_noise_swamps_the_signal():
    weak = user_dp.signal_to_noise(64, 2.0, 2_000_000, 0.1)
    strong = user_dp.signal_to_noise(4096, 0.5, 2_000_000, 0.1)
    assert weak == pytest.approx(0.1 * 64 / (2.0 * math.sqrt(2e6)))
    assert "will not improve" in user_dp.verdict(weak, 64, 2000) and "grow the cohort" in user_dp.verdict(
        weak, 64, 2000
    )
    assert "keep the non-private gain" in user_dp.verdict(strong, 4096, 100_000)
    middle = user_dp.verdict(0.1, 256, 100_000)
    assert "part of the gain" in middle and "2x larger" in middle


def test_the_server_plan_sizes_shares_masking_and_verdict_before_round_1():
    config = FedConfig.from_mapping(
        {"dp-level": "user", "update-max-norm": 0.5, "clients-per-round": 256, "num-server-rounds": 10}
    )
    info = check_federation(config, 100_000, 2_000_000)
    plan = info["user_dp"]
    assert plan["noise_added_by"] == "device" and plan["noise_cohort"] == user_dp.noise_cohort(256, 0.3)
    assert plan["share_std"] == pytest.approx(user_dp.share_std(plan["noise_multiplier"], 0.5, plan["noise_cohort"]))
    assert info["secagg"]["clipping_range"] == pytest.approx(0.5 + user_dp.NOISE_TAIL_DEVIATIONS * plan["share_std"])
    assert plan["epsilon"] <= 8.0 + 1e-3 and plan["sample_rate"] == pytest.approx(256 / 100_000)
    assert privacy_plan(config, 1, plan)["verdict"] == plan["verdict"]
    with pytest.raises(FedLookaheadError, match="needs secagg=true"):
        FedConfig.from_mapping({"dp-level": "user", "update-max-norm": 0.5, "secagg": False})


def test_the_share_mod_noises_the_clipped_heads_and_nothing_else():
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    heads = [np.zeros((200, 100), np.float32)]
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0  # the runtime sets it
    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(heads), {}), keep_input=True)
    msg = Message(content, dst_node_id=1, message_type=MessageType.TRAIN, group_id="1")

    def reply_to(request: Message) -> Message:
        res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(heads), 1, {})
        return Message(compat.fitres_to_recorddict(res, keep_input=False), reply_to=request)

    def with_share(request: Message, ctx: Context) -> Message:
        set_share(ctx, 0.25)
        return reply_to(request)

    def sent(reply: Message) -> np.ndarray:
        return parameters_to_ndarrays(compat.recorddict_to_fitres(reply.content, keep_input=True).parameters)[0]

    noised = sent(noise_share_added(msg, context, with_share))
    assert noised.std() == pytest.approx(0.25, rel=0.03) and SHARE_STATE not in context.state.config_records
    assert np.array_equal(sent(noise_share_added(msg, context, lambda m, c: reply_to(m))), heads[0])  # no share set


@pytest.mark.parametrize("cohort, user_level", [(128, True), (32, False), (None, False)])
def test_a_device_takes_user_level_only_as_its_own_share_at_its_floor(
    tiny_base, tiny_base_dir, tmp_path, one_thread, cohort, user_level
):
    """A device adds its own share only in a sum sized for at least its min-noise-cohort; its ledger is
    charged a user-level round at its floor's sampling rate (1: it trusts no claimed population; at the
    floor's sigma 0.5 that one round alone would exceed its budget 8, and it declines). Below its
    floor, or when the server sends no noise settings (it never trusts server-added noise), it keeps its
    example-level DP-SGD and reports its epsilon: never no DP."""
    node_config = {
        STATE_DIR_KEY: str(tmp_path / "state"),
        MIN_NOISE_COHORT_KEY: 64,
        PARTITION_ID_KEY: 0,
        NUM_PARTITIONS_KEY: 1,
    }
    run_config = {
        "base-model-dir": str(tiny_base_dir),
        "data-source": str(stdlib_dir() / "json"),
        "chunk-len": 32,
        "max-chunks-per-client": 12,
        "num-heads": 2,
        "batch-size": 4,
        "dp-level": "user",
        "update-max-norm": 0.1,
    }
    context = Context(run_id=7, node_id=3, node_config=node_config, state=RecordDict(), run_config=run_config)
    heads = DraftHeads.fresh(tiny_base, 2)
    fit_config = {
        **heads_config_dict(heads),
        "fedla-run-id": "user-run",
        "server-round": 1,
        KEY_CLIPPING_NORM: 0.1,
    }
    if cohort is not None:
        fit_config |= {
            USER_DP_NOISE_MULTIPLIER: 2.0,
            USER_DP_NOISE_COHORT: cohort,
            USER_DP_SAMPLE_RATE: 0.001,  # a claimed population the device does not take on trust
        }
    metrics = train_handler(fit_config, heads_to_ndarrays(heads), context).metrics
    (run_key,) = load_ledger(tmp_path / "state").runs  # the device keys its runs itself
    state = load_ledger(tmp_path / "state").runs[run_key]
    share = float(context.state.config_records[SHARE_STATE]["std"])
    assert metrics["dp"] == 1 and metrics["skipped"] == 0
    if user_level:
        assert state.level == "user" and state.history == [(2.0, 1.0, 1)]
        assert share == pytest.approx(user_dp.share_std(2.0, 0.1, cohort))
        assert metrics["epsilon"] == pytest.approx(user_dp.epsilon_after(2.0, 1.0, 1, 1e-5))
    else:
        assert state.level == "example" and share == 0.0 and state.history[0][2] > 1  # Opacus DP-SGD steps
        assert metrics["noise-multiplier"] > 0 and 0 < metrics["epsilon"] < math.inf
    saved = json.loads((tmp_path / "state" / "privacy-ledger.json").read_text())
    assert saved["runs"][run_key]["level"] == state.level


def test_the_simulation_runner_prints_the_verdict_once_the_server_has_planned(tmp_path, capsys):
    """simulations.run prints the plan's verdict from run.json as soon as the server writes it (before round 1):
    it waits through a missing file and a run.json without its plan yet."""
    import threading

    from server.run.folder import RunFolder
    from simulations.run import announce_verdict

    folder = RunFolder(tmp_path)
    stop = threading.Event()
    announcer = threading.Thread(target=announce_verdict, args=(folder, stop, 0.01))
    announcer.start()
    folder.run_file.write_text(json.dumps({"run_id": "r"}))
    line = user_dp.verdict(0.01, 64, 2000)
    folder.run_file.write_text(json.dumps({"plan": {"privacy": {"verdict": line}}}))
    announcer.join(timeout=5)
    assert not announcer.is_alive()
    assert capsys.readouterr().out == f"privacy plan: {line}\n"


def test_adaptive_clipping_splits_one_gaussian_mechanism_between_the_update_and_the_bits():
    z, bit_std = 1.2, user_dp.bit_noise_std(256)
    z_update = user_dp.update_noise_multiplier(z, bit_std)
    assert z_update > z and user_dp.combined_noise_multiplier(z_update, bit_std) == pytest.approx(z)
    with pytest.raises(ValueError, match="too small"):
        user_dp.update_noise_multiplier(2.0, 0.5)
    assert user_dp.next_clip(0.4, 0.8, 0.5, 0.2, 1.0) < 0.4 < user_dp.next_clip(0.4, 0.2, 0.5, 0.2, 1.0)
    assert user_dp.next_clip(0.99, 0.0, 0.5, 0.2, 1.0) == 1.0  # never above the cap SecAgg+ is sized for


def test_a_clip_bit_travels_centred_scaled_and_after_the_heads():
    """The clip mod records whether the update was within the clip; the share mod appends the centred bit
    times its scale (noise 0 here, to read it exactly) as one more array, after the noised heads."""
    heads = [np.zeros(3, np.float32)]
    for within, expected in ((True, 0.5), (False, -0.5)):
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})

        def handler(msg, context, within=within):
            set_share(context, 1e-9, bit_std=0.0, bit_scale=2.0)
            assert wants_clip_bit(context)
            set_clip_bit(context, within)
            res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(heads), 1, {})
            return Message(compat.fitres_to_recorddict(res, keep_input=False), reply_to=msg)

        msg = Message(
            compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(heads), {}), keep_input=False),
            dst_node_id=1,
            message_type=MessageType.TRAIN,
        )
        reply = noise_share_added(msg, ctx, handler)
        arrays = parameters_to_ndarrays(compat.recorddict_to_fitres(reply.content, keep_input=True).parameters)
        assert len(arrays) == 2 and arrays[1].shape == (1,) and arrays[1][0] == pytest.approx(2.0 * expected)


def test_a_device_charges_the_combined_mechanism_and_raises_both_noises_to_its_floor(tmp_path):
    fit_config = {
        USER_DP_NOISE_MULTIPLIER: 0.3,
        USER_DP_NOISE_COHORT: 128,
        USER_DP_SAMPLE_RATE: 0.01,
        USER_DP_BIT_NOISE: 6.4,
        USER_DP_BIT_SCALE: 0.05,
    }
    noise = UserNoise.from_fit_config(fit_config)
    assert noise.charged == pytest.approx(user_dp.combined_noise_multiplier(0.3, 6.4))
    assert UserNoise.from_fit_config({**fit_config, USER_DP_BIT_SCALE: 0.0}) is None  # a bit needs both
    floor = DeviceFloor.from_node_config({STATE_DIR_KEY: str(tmp_path), MIN_NOISE_COHORT_KEY: 64})
    config = FedConfig.from_mapping({"dp-level": "user", "update-max-norm": 0.1})
    taken = floor.user_level(config, fit_config)
    assert taken.charged == pytest.approx(max(noise.charged, floor.min_noise_multiplier))
    assert taken.bit_noise / taken.noise_multiplier == pytest.approx(6.4 / 0.3)  # both raised alike
    assert taken.sample_rate == 1.0  # the claimed population is not taken on trust


def test_adaptive_clipping_moves_the_clip_from_the_secure_sum_of_bits(tiny_base_dir, tmp_path, one_thread):
    """Through the ServerApp and ClientApp under SecAgg+ with the devices' shares: the plan splits the noise,
    round 1 clips at update-max-norm, and round 2's clip is the geometric step from round 1's noised bits."""
    from client.client_app import app
    from server.federation import run_federation
    from simulations.inprocess import InProcessGrid

    nodes, cap = 8, 0.05
    run_config = {
        "base-model-dir": str(tiny_base_dir),
        "data-source": str(stdlib_dir() / "json"),
        "num-server-rounds": 2,
        "chunk-len": 32,
        "max-chunks-per-client": 8,
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
        "dp-noise-multiplier": 0.5,
        "update-max-norm": cap,
        "user-dp-clip-quantile": 0.5,
    }
    grid = InProcessGrid(app, nodes, run_config)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    run_dir = run_federation(grid, context, FedConfig.from_mapping(run_config))
    plan = json.loads((run_dir / "run.json").read_text())["plan"]["user_dp"]
    assert plan["bit_noise_std"] == pytest.approx(nodes / 20)
    assert plan["update_noise_multiplier"] == pytest.approx(user_dp.update_noise_multiplier(0.5, nodes / 20))
    rounds = [json.loads((run_dir / "rounds" / f"round-{r}.json").read_text()) for r in (1, 2)]
    assert all(r["aggregated"] for r in rounds)
    first, second = (r["update_norm"] for r in rounds)
    assert first["bound"] == cap
    assert second["bound"] == pytest.approx(user_dp.next_clip(cap, first["within_clip"], 0.5, 0.2, cap))
