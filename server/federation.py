"""The federated loop behind the ServerApp: FedAvg of draft heads through SecAgg+, guarded and recorded.

Flower 1.42 offers SecAgg+ only in its legacy workflow API (`flwr.server.workflow.SecAggPlusWorkflow`
with a `LegacyContext` and a legacy `Strategy`); the new `flwr.serverapp.strategy` classes have no
secure aggregation. So each round runs Flower's own `SecAggPlusWorkflow` (or, with secagg=false,
`default_fit_workflow`) as the fit step, while this module owns the loop around it (instead of
`DefaultWorkflow`), which is what makes resuming from a checkpoint, per-round server evaluation,
a client evaluation round pushing the new heads, checkpoints and the run store possible.

Guarding replies: `GuardedGrid` sits between the workflows and the real Grid. Every train reply is
checked once, before a workflow can use it: its weight and metrics by `common.protocol.TrainReply`
(types, finiteness, ranges), its update by `common.params` (under SecAgg+ the masked vector's count,
shapes, integer type and modulus range; in plain FedAvg the weights' shapes, NaN/Inf and the range),
and each SecAgg+ key-exchange reply for the records its stage needs. A bad reply is turned into an
error reply and counted as rejected with its reason; SecAgg+ then treats that client as dropped (its
masks are removed with the other clients' key shares), so the round goes on. Evaluation replies are
checked by `common.protocol.EvalReply` the same way. The aggregate itself is checked again before it
becomes the global heads.

Weights: no client weighs more than `weight_cap` (the most train chunks an honest client can claim:
max-chunks-per-client, and never above secagg-max-weight). In plain FedAvg the server applies the cap
to the weight it averages with, so a client claiming 10**12 examples counts as one full client.

What SecAgg+ cannot check: each client multiplies its update by its own weight factor and sends the
factor inside the masked vector, so the server only ever sees the sum of the factors. The plaintext
`num_examples` a client reports is checked and capped, but it is only what the client *says*: a
malicious client can mask a factor other than its claim (up to the modulus), and so weigh more in the
secure mean than any cap allows; nor can the server see NaN, Inf or out-of-range values inside a masked
update before unmasking. What is checked is the masked vector's structure, the plaintext metrics, and
the unmasked aggregate (finite and within the clipping range) before it becomes the global heads: a
round whose aggregate fails that check keeps the old heads and says so (`aggregate_note`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import flwr.compat.common.recorddict_compat as compat
import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import (
    Code,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    bytes_to_ndarray,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.common.secure_aggregation.secaggplus_constants import Stage as SecAggStage
from flwr.server.client_manager import ClientManager, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.app_utils import start_update_client_manager_thread
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.server_config import ServerConfig
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.default_workflows import default_fit_workflow
from flwr.serverapp.grid import Grid

from common.base import BaseModel, FedLookaheadError, load_base
from common.data import chunk_files, prompts_from_files, stdlib_files
from common.default_model import ensure_default_base
from common.draft_vocab import public_draft_vocab
from common.features import base_features
from common.fedconfig import FedConfig, secagg_shares_and_threshold
from common.fedeval import decode_tau
from common.heads import WEIGHTS_FILE, DraftHeads
from common.params import (
    expected_shapes,
    heads_config_dict,
    heads_records,
    heads_to_ndarrays,
    load_ndarrays,
    validate_masked,
    validate_update,
)
from common.protocol import (
    FAIL_KEY,
    FITRES_PARAMETERS,
    HEADS_CONFIG_RECORD,
    HEADS_RECORD,
    MEASURE_TAU,
    ROUND_KEY,
    RUN_KEY,
    EvalReply,
    ReplyError,
    TrainReply,
)
from common.training import DEFAULT_DRAFT_VOCAB, evaluate_heads
from server import server_optimizer

log = logging.getLogger("flwr.fedla.server")  # a child of Flower's logger: its handlers stream our lines to `flwr run --stream` / `flwr log`

REJECTED_CODE = 9001  # Error.code of a reply the server refused (Flower's own codes are small integers)


# ------------------------------------------------------------------------------------------ round log


@dataclass
class RoundLog:
    """What happened to one round's train exchange, filled in by the strategy and the guarded grid."""

    sampled: list[int] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)  # node -> error reason (dropouts, refusals)
    rejected: list[dict] = field(default_factory=list)  # {"node": id, "reason": str}
    checked: dict[int, TrainReply] = field(default_factory=dict)  # node -> its reply, as the guard parsed it
    client_metrics: dict[int, TrainReply] = field(default_factory=dict)  # replies that reached aggregation
    weights: dict[int, int] = field(default_factory=dict)  # node -> the weight the aggregate used (capped)
    capped: dict[int, int] = field(default_factory=dict)  # node -> the larger weight it claimed
    bytes_down: list[int] = field(default_factory=list)
    bytes_up: list[int] = field(default_factory=list)
    aggregated: bool = False
    aggregate_note: str = ""
    induced_failures: list[int] = field(default_factory=list)


def _array_record_bytes(record) -> int:
    return sum(len(array.data) for array in record.values())


def _stage(msg: Message) -> str | None:
    """The SecAgg+ stage a train message asks for, None for a plain FedAvg train message."""
    cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS) if msg.has_content() else None
    stage = cfg.get(SecAggKey.STAGE) if cfg is not None else None
    return str(stage) if stage is not None else None


def _list_of(value: Any, kind: type, name: str) -> list:
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise ReplyError(f"{name} must be a list of {kind.__name__}")
    return value


class GuardedGrid(Grid):
    """A Grid that validates every train reply before a workflow sees it, and counts bytes.

    Each reply is checked once, here, against the stage it answers (plain FedAvg, or a SecAgg+ stage),
    so that nothing a client sends can raise inside Flower's workflow or our strategy. Everything
    else is delegated to the wrapped grid.
    """

    def __init__(self, grid: Grid, config: FedConfig, default_timeout: float | None) -> None:
        self._grid = grid
        self._config = config
        self.default_timeout = default_timeout
        self.shapes: list[tuple[str, tuple[int, ...]]] = []
        self.num_heads: int | None = None
        self.round_log = RoundLog()

    # -- delegation
    def set_run(self, run) -> None:
        self._grid.set_run(run)

    @property
    def run(self):
        return self._grid.run

    def create_message(self, *args, **kwargs):
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def push_messages(self, messages):
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids):
        return self._grid.pull_messages(message_ids)

    # -- guarded exchange
    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        for msg in messages:
            if msg.metadata.message_type == MessageType.TRAIN and "fitins.parameters" in msg.content.array_records:
                self.round_log.bytes_down.append(_array_record_bytes(msg.content.array_records["fitins.parameters"]))
        wanted = {m.metadata.dst_node_id for m in messages}
        replies = list(self._grid.send_and_receive(messages, timeout=timeout if timeout is not None else self.default_timeout))
        strangers = [r for r in replies if r.metadata.src_node_id not in wanted]
        for reply in strangers:
            log.warning("dropped a reply from node %s, which was not asked", reply.metadata.src_node_id)
        replies = [r for r in replies if r.metadata.src_node_id in wanted]
        answered = {r.metadata.src_node_id for r in replies}
        is_train = bool(messages) and messages[0].metadata.message_type == MessageType.TRAIN
        if not is_train:
            return replies
        stage = _stage(messages[0])
        for node in wanted - answered:
            self.round_log.failures.setdefault(node, "no reply before the timeout")
        return [self._check(r, stage) for r in replies]

    def _check(self, reply: Message, stage: str | None) -> Message:
        node = reply.metadata.src_node_id
        if reply.has_error():
            self.round_log.failures[node] = _short(reply.error.reason or f"error code {reply.error.code}")
            return reply
        try:
            self._validate(node, reply.content, stage)
        except ReplyError as exc:
            reason = str(exc)
        except Exception as exc:  # noqa: BLE001 - a reply that breaks a check is malformed, never fatal
            reason = f"malformed reply ({type(exc).__name__}: {_short(str(exc), 120)})"
        else:
            return reply
        log.warning("rejected the reply of node %s: %s", node, reason)
        self.round_log.rejected.append({"node": node, "reason": reason})
        return Message(metadata=copy.copy(reply.metadata), error=Error(code=REJECTED_CODE, reason=f"rejected: {reason}"))

    def _validate(self, node: int, content: RecordDict, stage: str | None) -> None:
        """Raise ReplyError unless `content` is a well-formed answer to `stage` (None: plain FedAvg)."""
        if stage is None:
            self._validate_fitres(node, content, masked=False)
            return
        cfg = content.config_records.get(RECORD_KEY_CONFIGS)
        if cfg is None:
            raise ReplyError(f"SecAgg+ {stage} reply has no {RECORD_KEY_CONFIGS} record")
        if stage == SecAggStage.SETUP:
            for key in (SecAggKey.PUBLIC_KEY_1, SecAggKey.PUBLIC_KEY_2):
                if not isinstance(cfg.get(key), bytes):
                    raise ReplyError(f"SecAgg+ setup reply has no public key {key}")
        elif stage == SecAggStage.SHARE_KEYS:
            dsts = _list_of(cfg.get(SecAggKey.DESTINATION_LIST), int, "SecAgg+ destination list")
            ctxts = _list_of(cfg.get(SecAggKey.CIPHERTEXT_LIST), bytes, "SecAgg+ ciphertext list")
            if len(dsts) != len(ctxts):
                raise ReplyError(f"SecAgg+ share-keys reply: {len(dsts)} destinations for {len(ctxts)} ciphertexts")
        elif stage == SecAggStage.COLLECT_MASKED_VECTORS:
            self._validate_fitres(node, content, masked=True)
        elif stage == SecAggStage.UNMASK:
            nids = _list_of(cfg.get(SecAggKey.NODE_ID_LIST), int, "SecAgg+ node id list")
            shares = _list_of(cfg.get(SecAggKey.SHARE_LIST), bytes, "SecAgg+ share list")
            if len(nids) != len(shares):
                raise ReplyError(f"SecAgg+ unmask reply: {len(nids)} node ids for {len(shares)} shares")
            unknown = set(nids) - set(self.round_log.sampled)
            if unknown:
                raise ReplyError(f"SecAgg+ unmask reply names {len(unknown)} node(s) outside this round")

    def _validate_fitres(self, node: int, content: RecordDict, masked: bool) -> None:
        """A legacy FitRes reply: its weight and metrics (protocol), its update (plain) or masked vector."""
        reply = TrainReply.from_content(content, self.num_heads)  # every value, with a one-line reason
        fitres = compat.recorddict_to_fitres(content, keep_input=True)  # what the workflow will call
        if fitres.status.code != Code.OK:
            raise ReplyError(f"client status {fitres.status.code.name}: {_short(fitres.status.message, 120)}")
        if masked:
            # The masked weight factor is hidden from the server (see the module docstring); the
            # plaintext count is not, and an honest client never claims more than secagg-max-weight
            # (beyond it, its factor would overflow the quantised sum).
            if reply.num_examples > self._config.secagg_max_weight:
                raise ReplyError(f"weight {reply.num_examples} above secagg-max-weight {self._config.secagg_max_weight:g}")
            payload = content.config_records[RECORD_KEY_CONFIGS].get(SecAggKey.MASKED_PARAMETERS)
            if not isinstance(payload, list) or not all(isinstance(b, bytes) for b in payload):
                raise ReplyError("SecAgg+ reply has no masked vector")
            self.round_log.bytes_up.append(sum(len(b) for b in payload))
            try:
                arrays = [bytes_to_ndarray(b) for b in payload]
            except Exception as exc:  # noqa: BLE001 - anything undecodable is a malformed reply
                raise ReplyError(f"undecodable masked vector ({type(exc).__name__})") from None
            reason = validate_masked(arrays, self.shapes, _MOD_RANGE)
            if reason:
                raise ReplyError(reason)
        else:
            if self._config.secagg:
                raise ReplyError("plain update sent to a SecAgg+ round")
            self.round_log.bytes_up.append(_array_record_bytes(content.array_records[FITRES_PARAMETERS]))
            try:
                arrays = parameters_to_ndarrays(fitres.parameters)
            except Exception as exc:  # noqa: BLE001
                raise ReplyError(f"undecodable update ({type(exc).__name__})") from None
            reason = validate_update(arrays, self.shapes, self._config.secagg_clipping_range)
            if reason:
                raise ReplyError(reason)
        self.round_log.checked[node] = reply


def weight_cap(config: FedConfig) -> int:
    """The largest weight the server gives one client: the most train chunks an honest client can have
    (max-chunks-per-client, 0: unbounded) and never above secagg-max-weight (clients cap their SecAgg+
    factor there), at least 1 so that a trained reply never weighs 0."""
    cap = int(config.secagg_max_weight)
    if config.max_chunks_per_client:
        cap = min(cap, config.max_chunks_per_client)
    return max(1, cap)


_MOD_RANGE = 4294967296  # SecAggPlusWorkflow's modulus_range (its default; we never change it)


def _short(reason: str, limit: int = 300) -> str:
    """The last line of a reason (Flower wraps client exceptions in a repr and a traceback)."""
    lines = [line for line in str(reason).strip().splitlines() if line.strip()]
    last = (lines[-1] if lines else str(reason)).strip()
    if last.endswith("'>"):  # the simulation runtime wraps the message as "<class ...>:<'...'>"
        last = last[:-2]
    return last[:limit]


# ------------------------------------------------------------------------------------------ strategy


class HeadsStrategy(Strategy):
    """FedAvg of head weights, weighted by train chunks capped at `weight_cap`; budget-skipped replies
    (weight 0) add nothing, and a round where every client skipped keeps the heads and says so.

    It reads only what the guard checked (`RoundLog.checked`), never the raw FitRes metrics. Under
    SecAgg+ the workflow has already computed the weighted mean: every result carries it, and this
    strategy only records the plaintext metrics. In plain mode it computes the mean itself.
    """

    def __init__(self, config: FedConfig, grid: GuardedGrid, fit_config: dict[str, Any]) -> None:
        self.config = config
        self.grid = grid
        self.fit_config = fit_config
        self.rng = random.Random(config.seed)

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return None

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        available = client_manager.num_available()
        deadline = time.monotonic() + self.config.node_wait_seconds
        while available < self.config.min_train_clients and time.monotonic() < deadline:
            time.sleep(1.0)  # nodes left since round 1: give them node-wait-seconds to come back
            available = client_manager.num_available()
        if available < self.config.min_train_clients:
            raise FedLookaheadError(f"round {server_round}: only {available} node(s) connected, fewer than "
                                    f"min-train-clients ({self.config.min_train_clients})")
        wanted = min(self.config.clients_this_round(available), available)
        # min_num_clients = what is there: Flower's sample() would otherwise block for up to a day
        clients = client_manager.sample(num_clients=wanted, min_num_clients=wanted)
        log_ = self.grid.round_log
        log_.sampled = [c.node_id for c in clients]
        failing: set[int] = set()
        if self.config.dropout_rate > 0:  # simulation: exactly this share of the sampled clients crashes
            count = int(round(self.config.dropout_rate * len(clients)))
            failing = {c.node_id for c in self.rng.sample(clients, count)}
            log_.induced_failures = sorted(failing)
        instructions = []
        for client in clients:
            config = dict(self.fit_config, **{ROUND_KEY: server_round})
            if client.node_id in failing:
                config[FAIL_KEY] = True
            instructions.append((client, FitIns(parameters, config)))
        return instructions

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures):
        log_ = self.grid.round_log
        cap = weight_cap(self.config)
        weighted: list[tuple[FitRes, int]] = []
        for proxy, res in results:
            reply = log_.checked.get(proxy.node_id)
            if reply is None:  # cannot happen: the guard turned every unchecked reply into an error
                log.error("round %s: node %s reached aggregation unchecked; ignored", server_round, proxy.node_id)
                continue
            weight = min(reply.num_examples, cap)
            if weight < reply.num_examples:
                log_.capped[proxy.node_id] = reply.num_examples
                log.warning("round %s: node %s claims weight %d, capped at %d", server_round,
                            proxy.node_id, reply.num_examples, cap)
            log_.client_metrics[proxy.node_id] = reply
            log_.weights[proxy.node_id] = weight
            weighted.append((res, weight))
        total = sum(w for _, w in weighted)
        if not weighted:
            log_.aggregate_note = "no client result to aggregate"
            return None, {}
        if total <= 0:  # weight 0 only with skipped=1 (the protocol rejects anything else)
            log_.aggregate_note = (f"all {len(weighted)} client(s) skipped training (privacy budget): "
                                   "heads unchanged")
            return None, {}
        if self.config.secagg:
            arrays = parameters_to_ndarrays(results[0][1].parameters)  # SecAgg+ put the weighted mean in each
        else:
            arrays = _weighted_mean(weighted, total)
        reason = validate_update([np.asarray(a, dtype=np.float32) for a in arrays], self.grid.shapes,
                                 self.config.secagg_clipping_range * (1 + 1e-6))
        if reason:
            log.error("round %s: aggregate rejected, heads unchanged: %s", server_round, reason)
            log_.aggregate_note = f"aggregate rejected: {reason}"
            return None, {}
        log_.aggregated = True
        return ndarrays_to_parameters([np.asarray(a, dtype=np.float32) for a in arrays]), {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []  # client evaluation is sent by the loop (native messages), not by a legacy workflow

    def aggregate_evaluate(self, server_round, results: list[tuple[ClientProxy, EvaluateRes]], failures):
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters):
        return None  # the loop evaluates centrally itself, with the decoder


def _weighted_mean(weighted: list[tuple[FitRes, int]], total: int) -> list[np.ndarray]:
    """The mean of the updates, each weighted by its (capped) weight over `total`."""
    per_client = [(parameters_to_ndarrays(res.parameters), weight) for res, weight in weighted if weight]
    out = []
    for index in range(len(per_client[0][0])):
        acc = np.zeros(per_client[0][0][index].shape, dtype=np.float64)
        for arrays, weight in per_client:
            acc += arrays[index].astype(np.float64) * (weight / total)
        out.append(acc.astype(np.float32))
    return out


# ------------------------------------------------------------------------------------------ run setup


def wait_for_nodes(grid: Grid, config: FedConfig) -> list[int]:
    """Node ids once min-available-clients are connected; a clear error instead of Flower's silent wait."""
    deadline = time.monotonic() + config.node_wait_seconds
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= config.min_available_clients or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if len(nodes) < config.min_available_clients:
        raise FedLookaheadError(
            f"only {len(nodes)} node(s) connected after {config.node_wait_seconds:g}s but min-available-clients is "
            f"{config.min_available_clients}: the strategy would wait forever (start more SuperNodes, or lower it)"
        )
    return nodes


def check_federation(config: FedConfig, num_nodes: int) -> dict[str, Any]:
    """Up-front checks that Flower itself does not make (its strategies hang or abort mid-run instead)."""
    if config.min_train_clients > num_nodes:
        raise FedLookaheadError(
            f"min-train-clients ({config.min_train_clients}) exceeds the {num_nodes} connected node(s): "
            "the round would wait forever"
        )
    if config.clients_per_round > num_nodes:
        raise FedLookaheadError(f"clients-per-round ({config.clients_per_round}) exceeds the {num_nodes} node(s)")
    sampled = min(config.clients_this_round(num_nodes), num_nodes)
    info: dict[str, Any] = {"nodes": num_nodes, "clients_per_round": sampled}
    if config.secagg:
        if sampled < 2:
            raise FedLookaheadError("SecAgg+ needs at least 2 clients per round (Flower aborts with fewer)")
        shares, threshold = secagg_shares_and_threshold(config, sampled)
        neighbours = min(shares, sampled)
        if threshold > neighbours:
            raise FedLookaheadError(
                f"SecAgg+ threshold {threshold} exceeds the {neighbours} neighbours each client has "
                f"({sampled} clients per round, {shares} shares): every round would abort"
            )
        tolerated = neighbours - threshold
        info.update(num_shares=shares, threshold=threshold, tolerated_dropouts=tolerated)
        planned_drops = int(round(config.dropout_rate * sampled))
        if planned_drops > tolerated:
            log.warning("dropout-rate %.2f drops %d of %d clients, more than the %d SecAgg+ tolerates: "
                        "those rounds will abort", config.dropout_rate, planned_drops, sampled, tolerated)
    return info


def server_base(config: FedConfig) -> BaseModel:
    path = Path(config.base_model_dir).expanduser() if config.base_model_dir else ensure_default_base()
    return load_base(path, device=config.device)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    found = []
    for path in (run_dir / "checkpoints").glob("round-*"):
        suffix = path.name.removeprefix("round-")
        if suffix.isdigit() and (path / WEIGHTS_FILE).is_file():
            found.append((int(suffix), path))
    return max(found) if found else None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class ServerEval:
    chunks: torch.Tensor
    prompts: list[torch.Tensor]

    @classmethod
    def build(cls, base: BaseModel, config: FedConfig) -> ServerEval:
        """The server's public evaluation split: stdlib held-out files (never in any client's data)."""
        files = stdlib_files("heldout")
        random.Random(config.seed).shuffle(files)
        parts, have = [], 0
        for start in range(0, len(files), 16):  # tokenise only as many files as the sample needs
            if have >= 4 * config.server_eval_chunks:
                break
            block = chunk_files(files[start : start + 16], base.tokenizer, config.chunk_len)
            parts.append(block)
            have += len(block)
        chunks = torch.cat(parts) if parts else torch.empty(0, config.chunk_len, dtype=torch.long)
        order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(config.seed))
        prompts = prompts_from_files(files, base.tokenizer, config.eval_prompts, config.eval_prompt_len)
        return cls(chunks[order[: config.server_eval_chunks]], prompts)

    def run(self, heads: DraftHeads, base: BaseModel, config: FedConfig, heads_only: bool = False) -> dict[str, Any]:
        """Loss, per-head accuracy and AMS-LD tau; with `heads_only` also tau without the n-gram drafter
        (what the heads alone contribute: costs another decoding pass, so only done on the last round)."""
        summary = evaluate_heads(heads, base_features(base, self.chunks), batch_size=config.batch_size) if len(self.chunks) else \
            {"loss": 0.0, "head_accuracy": [0.0] * heads.num_heads}
        tau = decode_tau(base, heads, self.prompts, config.eval_max_new_tokens)
        out = {"loss": float(summary["loss"]), "head_accuracy": [float(a) for a in summary["head_accuracy"]], "tau": tau}
        if heads_only:
            out["tau_heads_only"] = decode_tau(base, heads, self.prompts, config.eval_max_new_tokens, ngram=False)
        return out


# ------------------------------------------------------------------------------------------ the loop


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def client_evaluation(grid: Grid, heads: DraftHeads, config: FedConfig, server_round: int,
                      nodes: list[int], rng: random.Random, final: bool = False) -> dict[str, Any]:
    """Push the global heads (native ArrayRecord + ConfigRecord) to a sample of clients and average their eval.

    After the last round (`final`) the heads go to every node; the sampled ones also measure tau.
    """
    if (config.fraction_evaluate <= 0 and not final) or not nodes:
        return {"evaluated": 0}
    count = max(1, int(math.ceil(config.fraction_evaluate * len(nodes)))) if config.fraction_evaluate > 0 else 0
    sampled = set(rng.sample(nodes, min(count, len(nodes))))
    targets = sorted(nodes) if final else sorted(sampled)
    arrays, cfg = heads_records(heads, **{ROUND_KEY: server_round})
    messages = []
    for node in targets:
        node_cfg = copy.deepcopy(cfg)
        node_cfg[MEASURE_TAU] = node in sampled
        messages.append(Message(RecordDict({HEADS_RECORD: copy.deepcopy(arrays), HEADS_CONFIG_RECORD: node_cfg}),
                                dst_node_id=node, message_type=MessageType.EVALUATE, group_id=f"eval-{server_round}"))
    push_bytes = _array_record_bytes(arrays)
    timeout = config.round_timeout or None
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    accuracy_sum = np.zeros(heads.num_heads)
    examples = 0
    taus: list[float] = []
    rejected, failed = [], 0
    cap = weight_cap(config)
    for reply in replies:
        if reply.has_error():
            failed += 1
            continue
        try:
            result = EvalReply.from_content(reply.content, heads.num_heads)
        except ReplyError as exc:
            rejected.append(str(exc))
            log.warning("rejected evaluation reply of node %s: %s", reply.metadata.src_node_id, exc)
            continue
        weight = min(result.num_examples, cap)  # the same cap as training weights
        if weight and result.head_accuracy:
            accuracy_sum += np.asarray(result.head_accuracy) * weight
            examples += weight
        if result.tau is not None:
            taus.append(result.tau)
    return {
        "evaluated": len(replies) - failed - len(rejected),
        "pushed_to": len(targets),
        "failed": failed + (len(targets) - len(replies)),
        "rejected": rejected,
        "head_accuracy": (accuracy_sum / examples).tolist() if examples else None,
        "tau": sum(taus) / len(taus) if taus else None,
        "push_bytes_per_client": push_bytes,
    }


def run_federation(grid: Grid, context: Context, config: FedConfig, store_factory=None) -> Path:
    """The whole federated run; returns runs/<run-id>. Raises (after marking the run failed) on fatal errors."""
    from server.store import RunStore  # the run store (written by the store/dashboard side)

    base = server_base(config)
    run_root = Path(config.run_dir).expanduser().resolve()
    start_round = 1
    if config.resume_from:
        run_dir = Path(config.resume_from).expanduser().resolve()
        if not run_dir.is_dir():
            raise FedLookaheadError(f"resume-from: no run folder {run_dir}")
        run_id = run_dir.name
        found = latest_checkpoint(run_dir)
        if found is None:
            raise FedLookaheadError(f"resume-from: no checkpoint under {run_dir / 'checkpoints'}")
        last_round, ckpt = found
        heads = DraftHeads.load(ckpt, base)  # refuses a checkpoint for another base
        start_round = last_round + 1
        log.info("resuming run %s after round %d (head version %d)", run_id, last_round, heads.config.version)
    else:
        run_id = config.run_id or f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{context.run_id}"
        run_dir = run_root / run_id
        if config.init_heads:
            heads = DraftHeads.load(config.init_heads, base)
        else:  # fresh heads still score only a public draft vocabulary: the full LM head makes DP training ~6x slower
            heads = DraftHeads.fresh(base, config.num_heads,
                                     draft_vocab=public_draft_vocab(base, DEFAULT_DRAFT_VOCAB, seed=config.seed))
        if heads.num_heads != config.num_heads:
            raise FedLookaheadError(f"init-heads has {heads.num_heads} heads but num-heads is {config.num_heads}")
    (run_dir / "rounds").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)

    store_url = config.store_url or os.environ.get("FEDLA_DB") or str(run_root / "fedla.db")
    store = store_factory() if store_factory else RunStore(store_url)
    secagg_info = {"enabled": config.secagg, "num_shares": config.secagg_num_shares,
                   "reconstruction_threshold": config.secagg_reconstruction_threshold,
                   "clipping_range": config.secagg_clipping_range,
                   "quantization_range": config.secagg_quantization_range,
                   "max_weight": config.secagg_max_weight}
    store.start_run(run_id, _jsonable(config.to_dict()), secagg_info)
    guarded = GuardedGrid(grid, config, default_timeout=config.round_timeout or None)
    stop = None
    try:
        nodes = wait_for_nodes(grid, config)
        plan = check_federation(config, len(nodes))
        if config.dp and config.dp_level == "user":  # issue 12: fl-dp-sa user-level DP (server/user_dp.py)
            from server.user_dp import plan_user_dp
            plan["user_dp"] = plan_user_dp(config, plan["clients_per_round"], len(nodes))
        log.info("run %s: %d nodes, plan %s, %d head parameters, base %s", run_id, len(nodes), plan,
                 heads.num_trainable(), base.fingerprint)
        (run_dir / "run.json").write_text(json.dumps(_jsonable({
            "run_id": run_id, "flower_run_id": context.run_id, "config": config.to_dict(), "plan": plan,
            "base_fingerprint": base.fingerprint, "base_dir": str(base.path),
            "head_parameters": heads.num_trainable(), "head_bytes": sum(a.nbytes for a in heads_to_ndarrays(heads)),
            "resumed_from_round": start_round - 1}), indent=2))
        server_eval = ServerEval.build(base, config)
        guarded.shapes = expected_shapes(heads)
        guarded.num_heads = heads.num_heads
        client_manager = SimpleClientManager()
        thread, stop, ready = start_update_client_manager_thread(guarded, client_manager)
        ready.wait()
        fit_config = {**heads_config_dict(heads), RUN_KEY: run_id}
        strategy = HeadsStrategy(config, guarded, fit_config)
        outer = strategy
        if "user_dp" in plan:  # issue 12: Flower's DifferentialPrivacyClientSideFixedClipping around it
            from server.user_dp import wrap_strategy
            outer = wrap_strategy(strategy, plan["user_dp"])
        server_opt = server_optimizer.from_config(config)  # issue 12: fedavg | fedavgm | fedadam
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=config.num_server_rounds),
                               strategy=outer, client_manager=client_manager)
        workflow = None
        if config.secagg:
            workflow = SecAggPlusWorkflow(
                num_shares=config.secagg_num_shares, reconstruction_threshold=config.secagg_reconstruction_threshold,
                max_weight=config.secagg_max_weight, clipping_range=config.secagg_clipping_range,
                quantization_range=config.secagg_quantization_range, timeout=config.round_timeout or None)
        eval_rng = random.Random(config.seed + 1)
        client_eps: dict[int, float] = {}
        for server_round in range(start_round, config.num_server_rounds + 1):
            started = time.perf_counter()
            guarded.round_log = RoundLog()
            strategy.fit_config = {**heads_config_dict(heads), RUN_KEY: run_id}
            current = heads_to_ndarrays(heads)
            legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
                ndarrays_to_parameters(current), keep_input=True)
            legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
                {WorkflowKey.CURRENT_ROUND: server_round, WorkflowKey.START_TIME: time.time()})
            log.info("[ROUND %d/%d] %s", server_round, config.num_server_rounds,
                     "SecAgg+ FedAvg" if config.secagg else "plain FedAvg")
            (workflow or default_fit_workflow)(guarded, legacy)
            fit_seconds = time.perf_counter() - started
            round_log = guarded.round_log
            if round_log.aggregated:
                new = compat.arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
                load_ndarrays(heads, server_opt.step(current, parameters_to_ndarrays(new)))  # issue 12
                heads.config.version = server_round
            elif not round_log.aggregate_note:
                round_log.aggregate_note = ("SecAgg+ aborted: too few clients answered for the reconstruction "
                                            "threshold" if config.secagg else "no aggregate")
            if not round_log.aggregated:
                log.warning("round %d: global heads unchanged (%s)", server_round, round_log.aggregate_note)

            eval_started = time.perf_counter()
            server_metrics = server_eval.run(heads, base, config,
                                             heads_only=server_round == config.num_server_rounds)
            server_eval_seconds = time.perf_counter() - eval_started
            eval_started = time.perf_counter()
            client_eval = client_evaluation(guarded, heads, config, server_round, sorted(grid.get_node_ids()), eval_rng,
                                            final=server_round == config.num_server_rounds)
            client_eval_seconds = time.perf_counter() - eval_started

            ckpt_dir = heads.save(run_dir / "checkpoints" / f"round-{server_round}")
            weights_path = ckpt_dir / WEIGHTS_FILE
            size = sum(p.stat().st_size for p in ckpt_dir.iterdir() if p.is_file())
            store.record_checkpoint(run_id, server_round, head_version=heads.config.version, path=str(ckpt_dir),
                                    size_bytes=size, sha256=file_sha256(weights_path))

            record = _round_record(config, server_round, round_log, server_metrics, client_eval, client_eps,
                                   heads, fit_seconds, server_eval_seconds, client_eval_seconds,
                                   time.perf_counter() - started)
            (run_dir / "rounds" / f"round-{server_round}.json").write_text(json.dumps(_jsonable(record), indent=2))
            store.record_round(run_id, server_round, metrics=record["metrics"],
                               participation={k: record["participation"][k] for k in ("sampled", "succeeded", "dropped")}
                               | {"rejected": [{"reason": r["reason"]} for r in round_log.rejected]},
                               privacy={k: record["privacy"][k] for k in ("epsilon_max", "epsilon_mean", "delta")},
                               wall_seconds=record["wall_seconds"], bytes_per_client=record["bytes_per_client"])
            store.write_summary(run_id, run_dir / "summary.json")
            log.info("round %d: %s", server_round, json.dumps(_jsonable({
                "tau": record["metrics"]["tau"], "acc": record["metrics"]["head_accuracy"],
                "train_loss": record["metrics"]["train_loss"], "participation": record["participation"],
                "eps_max": record["privacy"]["epsilon_max"], "seconds": round(record["wall_seconds"], 1)})))
        store.finish_run(run_id, "finished")
        store.write_summary(run_id, run_dir / "summary.json")
        try:
            from server.report import plot_run

            plot_run(run_dir)
        except Exception as exc:  # noqa: BLE001 - a plot never fails a finished run
            log.warning("could not plot %s: %s", run_dir, exc)
        return run_dir
    except BaseException:
        store.finish_run(run_id, "failed")
        store.write_summary(run_id, run_dir / "summary.json")
        raise
    finally:
        if stop is not None:
            stop.set()
        if hasattr(store, "close"):
            store.close()


def _round_record(config: FedConfig, server_round: int, round_log: RoundLog, server_metrics: dict,
                  client_eval: dict, client_eps: dict[int, float], heads: DraftHeads, fit_seconds: float,
                  server_eval_seconds: float, client_eval_seconds: float, wall_seconds: float) -> dict[str, Any]:
    replies = round_log.client_metrics  # node -> TrainReply, checked by the guard
    trained = {n: r for n, r in replies.items() if r.trained}
    skipped = {n: r.skip_reason for n, r in replies.items() if r.skipped}
    for node, reply in replies.items():
        if reply.epsilon is not None:
            client_eps[node] = reply.epsilon
    chunks = {n: float(round_log.weights.get(n) or 1) for n in trained}
    total = sum(chunks.values())
    if trained and total > 0:
        train_loss = sum(r.loss * chunks[n] for n, r in trained.items()) / total
        train_acc = [sum((r.head_accuracy[k] if k < len(r.head_accuracy) else 0.0) * chunks[n]
                         for n, r in trained.items()) / total for k in range(heads.num_heads)]
        loss_source = "clients"
    else:
        train_loss, train_acc, loss_source = server_metrics["loss"], None, "server-eval (no client trained)"
    eps_values = list(client_eps.values())
    if not config.dp:
        eps_max = eps_mean = math.inf
    else:
        eps_max = max(eps_values) if eps_values else 0.0
        eps_mean = sum(eps_values) / len(eps_values) if eps_values else 0.0
    sampled = len(round_log.sampled)
    rejected_nodes = {r["node"] for r in round_log.rejected}
    succeeded = len(replies)  # replies that reached aggregation (none when SecAgg+ aborted)
    dropped = max(0, sampled - succeeded - len(rejected_nodes))
    down = round_log.bytes_down
    up = round_log.bytes_up
    bytes_down = int(sum(down) / len(down)) if down else 0
    bytes_up = int(sum(up) / len(up)) if up else 0
    return {
        "round": server_round,
        "head_version": heads.config.version,
        "aggregated": round_log.aggregated,
        "aggregate_note": round_log.aggregate_note,
        "metrics": {
            "train_loss": float(train_loss),
            "head_accuracy": server_metrics["head_accuracy"],
            "tau": server_metrics["tau"],
            "client_head_accuracy": client_eval.get("head_accuracy"),
            "client_tau": client_eval.get("tau"),
        },
        "train": {"loss_source": loss_source, "head_accuracy": train_acc, "server_eval_loss": server_metrics["loss"]},
        "tau_heads_only": server_metrics.get("tau_heads_only"),
        "participation": {
            "sampled": sampled, "succeeded": succeeded, "dropped": dropped,
            "rejected": round_log.rejected, "failures": {str(n): r for n, r in round_log.failures.items()
                                                          if n not in rejected_nodes},
            "induced_failures": round_log.induced_failures, "skipped_budget": skipped,
            "weights": {str(n): w for n, w in round_log.weights.items()},
            "capped_weights": {str(n): w for n, w in round_log.capped.items()},
        },
        "client_eval": client_eval,
        "privacy": {
            "epsilon_max": eps_max, "epsilon_mean": eps_mean, "delta": config.dp_delta if config.dp else 0.0,
            "target_epsilon": config.dp_target_epsilon if config.dp else None,
            "epsilon_this_round": {str(n): r.epsilon for n, r in replies.items() if r.epsilon is not None},
            "noise_multiplier": sorted({r.noise_multiplier for r in replies.values()}),
            "q": sorted({r.q for r in replies.values()}),
            "no_amplification_clients": sum(int(r.no_amplification) for r in replies.values()),
        },
        "bytes_per_client": bytes_down + bytes_up,
        "bytes": {"down_per_client": bytes_down, "up_per_client": bytes_up,
                  "eval_push_per_client": client_eval.get("push_bytes_per_client", 0)},
        "wall_seconds": wall_seconds,
        "seconds": {"fit": fit_seconds, "server_eval": server_eval_seconds, "client_eval": client_eval_seconds,
                    "client_train_sum": sum(r.train_seconds for r in replies.values())},
    }
