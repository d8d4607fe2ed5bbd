"""The FedLookahead ClientApp: trains the draft heads on the client's own text with DP, under SecAgg+.

Train messages use Flower's legacy FitIns/FitRes record layout because SecAgg+ in Flower 1.42
exists only in the legacy workflow API (`SecAggPlusWorkflow`): `secaggplus_mod` masks the FitRes
parameters, so the train handler reads `compat.recorddict_to_fitins` and replies with
`compat.fitres_to_recorddict` (a new-style ArrayRecord reply fails under it with
`KeyError: 'fitres.parameters'`). The heads still travel as a Flower ArrayRecord (`fitins.parameters`)
next to a ConfigRecord (`fitins.config`) carrying the base fingerprint and head version.
The mod is applied only to SecAgg+ stage messages, so the same handler also serves plain FedAvg.

Evaluate messages are native: an ArrayRecord of named head tensors plus a ConfigRecord, answered
with a MetricRecord.

What a device (node config `state-dir`) tells the server is its own floor's rule, not the run's
(docs/deploy.md, "What a device reveals"): its update (DP-SGD, charged to its ledger; under SecAgg+
only inside the sum), its privacy spending (epsilon, delta, sigma, whether it skipped), and nothing
else about its data. Its training loss and accuracy, chunk count, sampling rate, steps and seconds stay
in its own event log; its plaintext weight is the cap whatever its chunk count (under SecAgg+ the true
weight stays inside the masked vector); and it answers evaluation with nothing measured on its private
data (it evaluates for its own log only). Simulated clients report everything: the run is theirs.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

import flwr.compat.common.recorddict_compat as compat
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.client.mod import fixedclipping_mod, secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Stage as SecAggStage

from client import device_hooks, secagg
from client.noise_share import Share, noise_share_added, set_clip_bit, set_share, wants_clip_bit
from client.state import state_dir_of
from common.federation import protocol as P
from common.federation.protocol import (
    EVALUATE,
    HEADS_CONFIG_RECORD,
    HEADS_RECORD,
    RUN_KEY,
    EvalReply,
    TrainReply,
)

# torch, transformers, Opacus and datasets are imported inside the handlers, not here: a deployed
# SuperNode starts one ClientApp process per message, and the SecAgg+ key-exchange and unmasking
# stages (handled by the mod alone) would otherwise pay ~7 s of imports each on a small CPU.
if TYPE_CHECKING:
    from client.training.floor import UserNoise
    from common.federation.config import FedConfig
    from common.heads.lookahead import DraftHeads
    from common.training.preconditioner import Preconditioner


# the train metrics a device sends: its privacy spending, none of its data's statistics
DEVICE_TRAIN_METRICS = (P.SKIPPED, P.SKIP_REASON, P.EPSILON, P.DELTA, P.DP, P.NOISE_MULTIPLIER)


def secaggplus_when_needed(msg: Message, context: Context, call_next):
    """`secaggplus_mod` for SecAgg+ stage messages, made robust to a hostile peer's key shares (client/secagg.py);
    plain FedAvg train messages go straight through."""
    stage = secagg.secagg_stage(msg)
    if stage is None:
        return call_next(msg, context)
    if stage == SecAggStage.COLLECT_MASKED_VECTORS:
        bad = secagg.screen_ciphertexts(msg, context)
        return secagg.packed(secagg.name_bad_sources(secaggplus_mod(msg, context, call_next), bad), context)
    return secaggplus_mod(msg, context, call_next)


def heads_decoded(msg: Message, context: Context, call_next):
    """The global heads as float32 before anything reads them: the server sends them in its `heads-codec`
    (common/federation/wire.py), and the update is measured from exactly these."""
    from common.federation.wire import decode_heads

    if msg.metadata.message_type != MessageType.TRAIN or P.FITINS_PARAMETERS not in msg.content.array_records:
        return call_next(msg, context)
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    codec = str(fitins.config.get(P.HEADS_CODEC, "float32"))
    decoded = decode_heads(parameters_to_ndarrays(fitins.parameters), codec)
    msg.content.array_records[P.FITINS_PARAMETERS] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters(decoded), keep_input=False
    )
    return call_next(msg, context)


def update_sent(msg: Message, context: Context, call_next):
    """The reply carries the update (new heads minus the heads received), not the heads: small and centred, it
    survives SecAgg+'s quantization (which `secaggplus_mod` applies next) and, in plain FedAvg, int8
    (common/federation/wire.py)."""
    reply = call_next(msg, context)
    if reply.has_error() or P.FITRES_PARAMETERS not in reply.content.array_records:
        return reply
    from common.federation.wire import encode_update

    received = parameters_to_ndarrays(compat.recorddict_to_fitins(msg.content, keep_input=True).parameters)
    fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
    sent = parameters_to_ndarrays(fitres.parameters)
    # past the heads' arrays, what the inner mods appended travels as it is (adaptive clipping's noised bit)
    update = [new - old for new, old in zip(sent, received)] + sent[len(received) :]
    # secaggplus_mod quantizes a float32 update itself (it took the stage key out but left its config record)
    if RECORD_KEY_CONFIGS not in msg.content.config_records:
        update = encode_update(update)
    reply.content.array_records[P.FITRES_PARAMETERS] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters(update), keep_input=False
    )
    return reply


def fixedclipping_when_asked(msg: Message, context: Context, call_next):
    """Flower's `fixedclipping_mod` when the server sent a clipping norm (every FedLookahead round does: the
    update bound, server/guard.py, which is also the dp-level=user clip); inside SecAgg+, so the update is
    clipped before it is masked."""
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, get_norm

    if (
        msg.metadata.message_type != MessageType.TRAIN
        or KEY_CLIPPING_NORM not in compat.recorddict_to_fitins(msg.content, keep_input=True).config
    ):
        return call_next(msg, context)

    def train_unless_skipped(inner_msg: Message, inner_context: Context) -> Message:
        reply = call_next(inner_msg, inner_context)
        if not reply.has_error() and reply.content.config_records[P.FITRES_METRICS].get(P.SKIPPED):
            raise _NothingToClip(reply)  # its update is zero, which Flower's clip would divide by
        if not reply.has_error() and wants_clip_bit(inner_context):  # adaptive clipping: within the clip?
            fitins = compat.recorddict_to_fitins(inner_msg.content, keep_input=True)
            fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
            pairs = zip(parameters_to_ndarrays(fitres.parameters), parameters_to_ndarrays(fitins.parameters))
            norm = get_norm([new - old for new, old in pairs])  # the norm Flower's clip measures
            set_clip_bit(inner_context, norm <= float(fitins.config[KEY_CLIPPING_NORM]))
        return reply

    try:
        return fixedclipping_mod(msg, context, train_unless_skipped)
    except _NothingToClip as unchanged:
        return unchanged.reply


class _NothingToClip(Exception):
    def __init__(self, reply: Message) -> None:
        super().__init__("a skipped round sends the heads it was sent")
        self.reply = reply


def device_weight_hidden(msg: Message, context: Context, call_next):
    """A device's plaintext weight is the weight cap, whatever its chunk count: in plain FedAvg every device
    weighs the same, and under SecAgg+ (this mod runs outside `secaggplus_mod`) its true weight stays inside
    the masked vector, where the server sees only the sum."""
    from common.federation.config import FedConfig

    reply = call_next(msg, context)
    if state_dir_of(context.node_config) is None or not reply.has_content():
        return reply
    counts = reply.content.metric_records.get(P.FITRES_NUM_EXAMPLES)
    if counts is not None and int(counts.get("num_examples", 0)) > 0:
        counts["num_examples"] = FedConfig.from_mapping(context.run_config, context.node_config).weight_cap
    return reply


def client_config(context: Context) -> FedConfig:
    """The run config with this node's overrides; on a device, made no weaker than its privacy floor."""
    from client.training.floor import DeviceFloor
    from common.federation.config import FedConfig

    config = FedConfig.from_mapping(context.run_config, context.node_config)
    floor = DeviceFloor.from_node_config(context.node_config)
    return floor.apply(config) if floor is not None else config


def train_handler(fit_config: dict, arrays: list, context: Context) -> FitRes:
    """Local training for one round; raises (an error reply) on a base mismatch or malformed heads."""
    from client.base_cache import cached_base
    from client.local_data import client_data, client_features
    from client.training.floor import DeviceFloor
    from client.training.local_round import device_round, train_round
    from client.training.run_state import load_state, save_state, state_file
    from common.errors import FedLookaheadError
    from common.federation.records import (
        heads_from_config,
        heads_to_ndarrays,
        load_ndarrays,
        validate_update,
        wire_shapes,
    )

    config = client_config(context)
    base = cached_base(config, body=False)  # heads train on cached features: no decoder layer is needed
    heads = heads_from_config(fit_config, base)  # BaseMismatchError when fingerprints differ
    load_ndarrays(heads, arrays)
    device_hooks.train_started(context, fit_config, heads)  # a device keeps the global heads it was sent
    data = client_data(config, base, dict(context.node_config))
    if len(data.train) == 0:
        raise FedLookaheadError("this client has no training chunks")
    run_key = str(fit_config.get(RUN_KEY, context.run_id))
    features = client_features(config, base, data.train, dict(context.node_config))
    preconditioner = sent_preconditioner(config, fit_config, heads)
    floor = DeviceFloor.from_node_config(context.node_config)
    # a device takes user-level DP only as its own noise share at its floor's terms, else keeps DP-SGD
    device_user = floor.user_level(config, fit_config) if floor is not None else None
    user_level = config.dp and config.dp_level == "user" and (floor is None or device_user is not None)
    if user_level and floor is None:  # no per-chunk noise: fixedclipping_mod clips the whole update
        config = replace(config, dp=False)
    if floor is not None:  # a device: its own ledger and lifetime budget
        result = device_round(heads, features, config, floor, run_key, device_user, preconditioner)
    else:  # a simulated client: the run config governs
        path = state_file(config, context.node_config, run_key) if config.dp else None
        if config.dp and config.resume_from and path is None:  # a resumed run is a new Flower run: empty context
            raise FedLookaheadError(
                "resume-from with DP needs this client's accountant of the earlier rounds, which only "
                "client-state-dir keeps: without it epsilon would restart at this round's"
            )
        state = load_state(context, path, run_key) if config.dp else None
        result = train_round(heads, features, config, state, preconditioner=preconditioner)
        if state is not None and not result.skipped:
            save_state(context, path, state)
    set_share(context, *(Share() if result.skipped or not user_level else share_of(config, fit_config, device_user)))
    sent = heads_to_ndarrays(heads) if not result.skipped else arrays
    if preconditioner is not None and not result.skipped:  # clipped, noised and masked in the scaled coordinates
        from common.training.preconditioner import whitened

        sent = whitened(arrays, sent, preconditioner.update_scale())
    bound = config.secagg_clipping_range if config.secagg else None
    reason = validate_update(sent, wire_shapes(heads), bound)
    if reason:  # never send something the secure sum would silently clip or that would poison it
        raise FedLookaheadError(f"refusing to send a malformed update: {reason}")
    # capped as the server caps it (under SecAgg+: weight / max_weight <= 1, and a larger claim is refused)
    weight = 0 if result.skipped else min(len(data.train), config.weight_cap)
    if user_level and not result.skipped:  # every client weighs the same: one moves the sum by at most the clip
        weight = config.weight_cap
    summary = result.metrics.summary() if result.metrics is not None else None
    metrics = TrainReply(
        num_examples=weight,
        skipped=bool(result.skipped),
        skip_reason=result.skipped,
        epsilon=float(result.epsilon),
        delta=float(result.delta),
        dp=config.dp,
        q=float(result.q),
        no_amplification=config.dp and result.q >= 1.0,  # q = 1: every step sees all data
        noise_multiplier=float(result.noise_multiplier),
        steps=int(result.steps),
        num_train_chunks=len(data.train),
        train_seconds=float(result.seconds),
        loss=None if summary is None else float(summary["loss"]),
        head_accuracy=() if summary is None else tuple(float(a) for a in summary["head_accuracy"]),
    ).to_metrics()
    device_hooks.train_finished(context, fit_config, metrics, weight)  # the whole story stays on the device
    if floor is not None:
        metrics = {key: metrics[key] for key in DEVICE_TRAIN_METRICS}
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(sent), weight, metrics)


def sent_preconditioner(config: FedConfig, fit_config: dict, heads: DraftHeads) -> Preconditioner | None:
    """client-optimizer=public-sgd: the public preconditioner the server sent with the heads (public data's
    statistics, so nothing private); else None (AdamW)."""
    from common.errors import FedLookaheadError
    from common.training.preconditioner import Preconditioner

    if config.client_optimizer != "public-sgd":
        return None
    blob = fit_config.get(P.PUBLIC_PRECONDITIONER)
    if not isinstance(blob, bytes):
        raise FedLookaheadError("client-optimizer=public-sgd but the train config carries no public preconditioner")
    return Preconditioner.from_bytes(blob, heads)


def share_of(config: FedConfig, fit_config: dict, device_user: UserNoise | None) -> Share:
    """This round's noise share (client/noise_share.py): none when the server adds the noise; a device's from
    its floor's terms; a simulated client's from the run's settings in the train config."""
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

    from client.training.floor import UserNoise
    from common.errors import FedLookaheadError
    from common.federation.user_dp import share_std

    if config.user_dp_noise != "device":
        return Share()
    noise = device_user or UserNoise.from_fit_config(fit_config)
    try:
        clip = float(fit_config[KEY_CLIPPING_NORM])
    except (KeyError, TypeError, ValueError) as exc:
        raise FedLookaheadError(f"user-dp-noise=device but the train config has no clipping norm ({exc})") from exc
    if noise is None or not clip > 0:
        raise FedLookaheadError("user-dp-noise=device but the train config's noise settings are missing or malformed")
    if config.adaptive_clip and noise.bit_scale <= 0:
        raise FedLookaheadError("user-dp-clip-quantile > 0 but the train config carries no clip-bit noise")
    return Share(
        share_std(noise.noise_multiplier, clip, noise.shares), noise.bit_noise / noise.shares**0.5, noise.bit_scale
    )


def train(msg: Message, context: Context) -> Message:
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    fitres = train_handler(dict(fitins.config), parameters_to_ndarrays(fitins.parameters), context)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)


def evaluate(msg: Message, context: Context) -> Message:
    from client.base_cache import cached_base
    from client.local_data import client_data, client_features
    from common.decoding.tau import chunk_prompts, decode_tau
    from common.federation.records import heads_from_records
    from common.training.loop import evaluate_heads

    config = client_config(context)
    asked = bool(msg.content[HEADS_CONFIG_RECORD].get(EVALUATE, True))
    measure_tau = asked and config.client_eval_prompts > 0
    base = cached_base(config, body=measure_tau)  # decoding needs the layers; head accuracy needs features only
    heads = heads_from_records(msg.content[HEADS_RECORD], msg.content[HEADS_CONFIG_RECORD], base)
    device_hooks.heads_received(context, heads, msg.content[HEADS_CONFIG_RECORD])
    if not asked:  # a push of the final heads: kept, not measured
        return Message(
            RecordDict({P.EVAL_METRICS_RECORD: MetricRecord(EvalReply(num_examples=0).to_metrics())}), reply_to=msg
        )
    data = client_data(config, base, dict(context.node_config))
    started = time.perf_counter()
    summary, tau = None, None
    if len(data.heldout):
        summary = evaluate_heads(
            heads, client_features(config, base, data.heldout, dict(context.node_config)), batch_size=config.batch_size
        )
        if measure_tau:
            prompts = chunk_prompts(data.heldout, config.client_eval_prompts, config.eval_prompt_len)
            tau = decode_tau(base, heads, prompts, config.eval_max_new_tokens)
    measured = EvalReply(
        num_examples=len(data.heldout),
        loss=None if summary is None else float(summary["loss"]),
        head_accuracy=() if summary is None else tuple(float(a) for a in summary["head_accuracy"]),
        tau=tau,
        eval_seconds=time.perf_counter() - started,
    )
    metrics = measured.to_metrics()
    device_hooks.evaluated(context, msg.content[HEADS_CONFIG_RECORD], metrics)
    if state_dir_of(context.node_config) is not None:  # a device: measured for its own log only
        metrics = EvalReply(num_examples=0, withheld=True).to_metrics()
    return Message(RecordDict({P.EVAL_METRICS_RECORD: MetricRecord(metrics)}), reply_to=msg)


# outermost first: decode the heads, hide a device's weight, mask (SecAgg+), send the update, noise it, clip it
TRAIN_MODS = (
    heads_decoded,
    device_weight_hidden,
    secaggplus_when_needed,
    update_sent,
    noise_share_added,
    fixedclipping_when_asked,
)


def client_app(mods: Sequence[Mod] = ()) -> ClientApp:
    """The ClientApp; `mods` wrap both handlers outside the product's own (simulations inject faults so)."""
    built = ClientApp(mods=list(mods))
    built.train(mods=list(TRAIN_MODS))(train)
    built.evaluate()(evaluate)
    return built


app = client_app()
