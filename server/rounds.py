"""One federated round: the train exchange through Flower's workflow, then both evaluations -> RoundRecord.

Flower 1.42 offers SecAgg+ only in its legacy workflow API (`flwr.server.workflow.SecAggPlusWorkflow`
with a `LegacyContext` and a legacy `Strategy`); the new `flwr.serverapp.strategy` classes have no
secure aggregation. So each round runs Flower's `SecAggPlusWorkflow` (server/secagg.py's subclass, which
survives a client dropped before its key shares went out; or, with secagg=false, `default_fit_workflow`)
as its fit step, over a `GuardedGrid` and a `HeadsStrategy` made for that
round and sharing only that round's `ExchangeLog`. The run's loop (server/federation.py) calls
`run_round` once per round and hands the record to the recorder.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import flwr.compat.common.recorddict_compat as compat
import numpy as np
from flwr.app import ConfigRecord, Context
from flwr.common import EvaluateRes, FitIns, FitRes, Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.server_config import ServerConfig
from flwr.server.strategy import Strategy
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.default_workflows import default_fit_workflow
from flwr.serverapp.grid import Grid
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from common.errors import FedLookaheadError
from common.federation.config import FedConfig
from common.federation.protocol import CLIP_BIT_SHAPE, HEADS_CODEC, ROUND_KEY, RUN_KEY
from common.federation.records import (
    heads_config_dict,
    heads_to_ndarrays,
    load_ndarrays,
    validate_update,
    wire_shapes,
)
from common.federation.wire import decode_update, encode_heads
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel
from common.training.preconditioner import unwhitened
from server.evaluation import ServerEval, client_evaluation
from server.guard import ExchangeLog, GuardedGrid, short_reason
from server.round_record import round_record
from server.run.record import RoundRecord
from server.secagg import TolerantSecAggPlusWorkflow

log = logging.getLogger("flwr.fedla.server")


@dataclass
class RoundContext:
    """What every round of a run uses: the grid and Flower's client manager, the workflow, the server
    optimiser, the evaluation data, and the run's random streams and privacy history."""

    grid: Grid
    context: Context
    client_manager: ClientManager
    config: FedConfig
    base: BaseModel
    run_id: str
    server_eval: ServerEval
    optimizer: Any  # server.server_optimizer: step(current, mean) -> new arrays
    workflow: TolerantSecAggPlusWorkflow | None = None  # None: plain FedAvg (default_fit_workflow)
    user_dp: dict[str, Any] | None = None  # dp-level=user: server.user_dp's plan
    # the run's constant train-config keys: the devices' noise settings, the public preconditioner
    fit_extras: dict[str, Any] = field(default_factory=dict)
    clip: float = 0.0  # adaptive clipping: this round's clip (starts at update-max-norm)
    update_scale: list[np.ndarray] | None = None  # its coordinates, in which those clients send their updates
    eval_rng: random.Random = field(default_factory=random.Random)  # which nodes evaluate
    client_eps: dict[int, float] = field(default_factory=dict)  # node -> its latest cumulative epsilon


def run_round(ctx: RoundContext, heads: DraftHeads, server_round: int) -> RoundRecord:
    """Train (heads become the new global heads when the round aggregates), evaluate, and say what happened."""
    config = ctx.config
    started = time.perf_counter()
    exchange = ExchangeLog()
    shapes = wire_shapes(heads) + ([CLIP_BIT_SHAPE] if config.adaptive_clip else [])
    guarded = GuardedGrid(
        ctx.grid,
        config,
        exchange,
        shapes,
        heads.num_heads,
        default_timeout=config.round_timeout or None,
        modulus_range=ctx.workflow.modulus_range if ctx.workflow is not None else None,
    )
    if config.adaptive_clip:  # this round's clip, sent to every client as the clipping norm
        exchange.update_bound = ctx.clip
    _fit(ctx, guarded, heads, server_round)
    fit_seconds = time.perf_counter() - started

    eval_started = time.perf_counter()
    server_metrics = ctx.server_eval.run(heads, ctx.base, config, heads_only=server_round == config.num_server_rounds)
    server_eval_seconds = time.perf_counter() - eval_started
    eval_started = time.perf_counter()
    client_eval = client_evaluation(
        guarded,
        heads,
        config,
        server_round,
        sorted(ctx.grid.get_node_ids()),
        ctx.eval_rng,
        final=server_round == config.num_server_rounds,
    )
    client_eval_seconds = time.perf_counter() - eval_started
    return round_record(
        config,
        server_round,
        exchange,
        server_metrics,
        client_eval,
        ctx.client_eps,
        heads,
        fit_seconds,
        server_eval_seconds,
        client_eval_seconds,
        time.perf_counter() - started,
    )


def _fit(ctx: RoundContext, guarded: GuardedGrid, heads: DraftHeads, server_round: int) -> None:
    """One train exchange through Flower's workflow; on a good aggregate the server optimiser moves `heads`."""
    config = ctx.config
    exchange = guarded.exchange
    current = heads_to_ndarrays(heads)
    fit_config = {**heads_config_dict(heads), RUN_KEY: ctx.run_id, HEADS_CODEC: config.heads_codec, **ctx.fit_extras}
    strategy: Strategy = HeadsStrategy(config, exchange, wire_shapes(heads), fit_config, current)
    if ctx.user_dp is not None and config.user_dp_noise == "server":  # Flower's fl-dp-sa wrapper noises the sum
        from server.user_dp import wrap_strategy

        strategy = wrap_strategy(strategy, ctx.user_dp)
    legacy = LegacyContext(
        context=ctx.context,
        config=ServerConfig(num_rounds=config.num_server_rounds),
        strategy=strategy,
        client_manager=ctx.client_manager,
    )
    legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters(current), keep_input=True
    )
    legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
        {WorkflowKey.CURRENT_ROUND: server_round, WorkflowKey.START_TIME: time.time()}
    )
    mode = "SecAgg+ FedAvg" if config.secagg else "plain FedAvg"
    log.info("[ROUND %d/%d] %s", server_round, config.num_server_rounds, mode)
    try:
        (ctx.workflow or default_fit_workflow)(guarded, legacy)
    except Exception as exc:  # noqa: BLE001 - what clients sent may still break Flower's workflow: lose the round, not the run
        log.exception("round %d: the train exchange failed", server_round)
        exchange.aggregated = False
        exchange.aggregate_note = f"round aborted: {type(exc).__name__}: {short_reason(str(exc), 200)}"
    if exchange.aggregated:
        new = compat.arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
        mean = parameters_to_ndarrays(new)
        if ctx.update_scale is not None:  # public-sgd clients sent their updates in the scaled coordinates
            mean = unwhitened(current, mean, ctx.update_scale)
        stepped = ctx.optimizer.checked_step(current, mean, config.secagg_clipping_range)  # issue 12
        if stepped is None:
            exchange.aggregated = False
            exchange.aggregate_note = (
                f"server step rejected: it would take the heads past +-{config.secagg_clipping_range:g} or to "
                "NaN/Inf (noise carried by the server's momentum)"
            )
        else:
            load_ndarrays(heads, stepped)
        if stepped is not None and config.adaptive_clip and exchange.clip_bit_mean is not None:
            from common.federation.user_dp import next_clip  # opacus configures the root logger when imported

            within = (
                exchange.clip_bit_mean / ctx.user_dp["bit_scale"] + 0.5
            )  # the noised share within the clip = exchange.clip_bit_mean / ctx.user_dp["bit_scale"] + 0.5
            ctx.clip = next_clip(
                ctx.clip, within, config.user_dp_clip_quantile, config.user_dp_clip_lr, config.update_max_norm
            )
            exchange.clip_bit_mean = within
        if stepped is not None:
            heads.config.version = server_round
    elif not exchange.aggregate_note:
        exchange.aggregate_note = (
            "SecAgg+ aborted: too few clients answered for the reconstruction threshold"
            if config.secagg
            else "no aggregate"
        )
    if not exchange.aggregated:
        log.warning("round %d: global heads unchanged (%s)", server_round, exchange.aggregate_note)


class HeadsStrategy(Strategy):
    """FedAvg of the clients' updates, weighted by train chunks capped at `FedConfig.weight_cap`, added to the
    global heads; budget-skipped replies (weight 0) add nothing, and a round where every client skipped keeps
    the heads and says so.

    The heads go out in `heads-codec` and the updates come back as new heads minus the heads decoded
    (common/federation/wire.py); the mean update is added to the float32 `current` heads, so the global
    heads never lose precision to the wire. It reads only what the guard checked (`ExchangeLog.checked`),
    never the raw FitRes metrics. Under SecAgg+ the workflow has already computed the weighted mean update:
    every result carries it, and this strategy only records the plaintext metrics. In plain mode it computes
    the mean itself. One strategy serves one round: it writes that round's `exchange`.
    """

    def __init__(
        self,
        config: FedConfig,
        exchange: ExchangeLog,
        shapes: list[tuple[str, tuple[int, ...]]],
        fit_config: dict[str, Any],
        current: list[np.ndarray],
    ) -> None:
        self.config = config
        self.exchange = exchange
        self.shapes = shapes
        self.fit_config = fit_config
        self.current = current

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return None

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        available = client_manager.num_available()
        deadline = time.monotonic() + self.config.node_wait_seconds
        while available < self.config.min_train_clients and time.monotonic() < deadline:
            time.sleep(1.0)  # nodes left since round 1: give them node-wait-seconds to come back
            available = client_manager.num_available()
        if available < self.config.min_train_clients:
            raise FedLookaheadError(
                f"round {server_round}: only {available} node(s) connected, fewer than "
                f"min-train-clients ({self.config.min_train_clients})"
            )
        wanted = min(self.config.clients_this_round(available), available)
        # min_num_clients = what is there: Flower's sample() would otherwise block for up to a day
        clients = client_manager.sample(num_clients=wanted, min_num_clients=wanted)
        log_ = self.exchange
        log_.sampled = [c.node_id for c in clients]
        sent = ndarrays_to_parameters(encode_heads(parameters_to_ndarrays(parameters), self.config.heads_codec))
        instructions = []
        for client in clients:
            # honest clients clip their update to the guard's bound (Flower's fixedclipping_mod, client/client_app.py)
            config = dict(self.fit_config, **{ROUND_KEY: server_round, KEY_CLIPPING_NORM: log_.update_bound})
            instructions.append((client, FitIns(sent, config)))
        return instructions

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: list[Any]
    ) -> tuple[Parameters | None, dict[str, Any]]:
        log_ = self.exchange
        cap = self.config.weight_cap
        weighted: list[tuple[FitRes, int]] = []
        for proxy, res in results:
            reply = log_.checked.get(proxy.node_id)
            if reply is None:  # cannot happen: the guard turned every unchecked reply into an error
                log.error("round %s: node %s reached aggregation unchecked; ignored", server_round, proxy.node_id)
                continue
            weight = min(reply.num_examples, cap)
            if weight < reply.num_examples:
                log_.capped[proxy.node_id] = reply.num_examples
                log.warning(
                    "round %s: node %s claims weight %d, capped at %d",
                    server_round,
                    proxy.node_id,
                    reply.num_examples,
                    cap,
                )
            log_.client_metrics[proxy.node_id] = reply
            log_.weights[proxy.node_id] = weight
            weighted.append((res, weight))
        total = sum(w for _, w in weighted)
        if not weighted:
            log_.aggregate_note = "no client result to aggregate"
            return None, {}
        if total <= 0:  # weight 0 only with skipped=1 (the protocol rejects anything else)
            log_.aggregate_note = f"all {len(weighted)} client(s) skipped training (privacy budget): heads unchanged"
            return None, {}
        if self.config.secagg:
            mean = parameters_to_ndarrays(results[0][1].parameters)  # SecAgg+ put the weighted mean in each
        else:
            mean = _weighted_mean(weighted, total)
        if self.config.adaptive_clip:  # the last masked array: the mean of the clients' noised, centred clip bits
            *mean, bits = mean
            log_.clip_bit_mean = float(np.asarray(bits).ravel()[0])
        arrays = [np.asarray(c, np.float64) + np.asarray(m, np.float64) for c, m in zip(self.current, mean)]
        reason = validate_update(
            [np.asarray(a, dtype=np.float32) for a in arrays],
            self.shapes,
            self.config.secagg_clipping_range * (1 + 1e-6),
        )
        if reason:
            log.error("round %s: aggregate rejected, heads unchanged: %s", server_round, reason)
            log_.aggregate_note = f"aggregate rejected: {reason}"
            return None, {}
        log_.aggregated = True
        return ndarrays_to_parameters([np.asarray(a, dtype=np.float32) for a in arrays]), {}

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager) -> list[Any]:
        return []  # client evaluation is sent by the loop (native messages), not by a legacy workflow

    def aggregate_evaluate(
        self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]], failures: list[Any]
    ) -> tuple[float | None, dict[str, Any]]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        return None  # the loop evaluates centrally itself, with the decoder


def _weighted_mean(weighted: list[tuple[FitRes, int]], total: int) -> list[np.ndarray]:
    """The mean of the updates, each weighted by its (capped) weight over `total`, read one client at a time."""
    out: list[np.ndarray] = []
    for res, weight in weighted:
        if not weight:
            continue
        arrays = decode_update(parameters_to_ndarrays(res.parameters))  # the guard has checked it decodes
        if not out:
            out = [np.zeros(a.shape, dtype=np.float64) for a in arrays]
        for acc, array in zip(out, arrays):
            acc += array.astype(np.float64) * (weight / total)
    return out
