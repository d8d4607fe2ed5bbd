"""The server's guard: every client reply is checked once, before anything uses it.

`GuardedGrid` sits between Flower's workflows and the real Grid. Every train reply is checked against
the stage it answers: its weight and metrics by `common.federation.protocol.TrainReply` (types, finiteness,
ranges), its update by `common.federation.records` (under SecAgg+ the masked vector's count, shapes, integer type
and modulus range; in plain FedAvg the weights' shapes, NaN/Inf and the range), and each SecAgg+
key-exchange reply for the records its stage needs (and, with `server.secagg.SecAggWitness`, for what only
the whole stage shows: replayed keys, peers an honest client names, inconsistent key shares). A bad reply is turned into an error reply and
counted as rejected with its reason; SecAgg+ then treats that client as dropped (its masks are
removed with the other clients' key shares), so the round goes on. Evaluation replies are checked by
`common.federation.protocol.EvalReply` where they are read (server/evaluation.py).

Weights: no client weighs more than `FedConfig.weight_cap` (the most train chunks an honest client can
claim: max-chunks-per-client, and never above secagg-max-weight). In plain FedAvg the server applies the
cap to the weight it averages with, so a client claiming 10**12 examples counts as one full client. Under
SecAgg+ the cap is the workflow's max_weight and a plaintext claim above it is refused (the client is
dropped and named), since the server cannot cap a weight inside a masked update.

What SecAgg+ cannot check: each client multiplies its update by its own weight factor and sends the
factor inside the masked vector, so the server only ever sees the sum of the factors. The plaintext
`num_examples` a client reports is checked and capped, but it is only what the client *says*: a
malicious client can mask a factor other than its claim (up to the modulus), and so weigh more in the
secure mean than any cap allows; nor can the server see NaN, Inf or out-of-range values inside a masked
update before unmasking. What is checked is the masked vector's structure, the plaintext metrics, and
the unmasked aggregate (finite and within the clipping range, server/rounds.py) before it becomes the
global heads.

Update norms: every train message carries the round's L2 bound (`FedConfig.update_bound`, Flower's
clipping-norm key), and honest clients clip their update (new heads minus the heads sent) to it with
Flower's `fixedclipping_mod`. In plain FedAvg the server checks it: a reply farther than the bound from
the heads it was sent is refused and named. Under SecAgg+ the server cannot: a masked update's norm is
hidden, so one hostile client can move the secure mean by up to its weight share times the clipping
range per element; only the aggregate's range is checked after unmasking.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import flwr.compat.common.recorddict_compat as compat
import numpy as np
from flwr.app import ArrayRecord, Error, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import Code, bytes_to_ndarray, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.common.secure_aggregation.secaggplus_constants import Stage as SecAggStage
from flwr.serverapp.grid import Grid
from flwr.supercore.differential_privacy import get_norm
from flwr.supercore.run import Run

from common.errors import FedLookaheadError
from common.federation.config import FedConfig
from common.federation.protocol import BAD_SHARE_SOURCES, FITINS_PARAMETERS, FITRES_PARAMETERS, ReplyError, TrainReply
from common.federation.records import validate_masked, validate_update
from common.federation.wire import decode_update, masked_dtype
from server.secagg import SecAggWitness

log = logging.getLogger(
    "flwr.fedla.server"
)  # a child of Flower's logger: its handlers stream our lines to `flwr run --stream` / `flwr log`

REJECTED_CODE = 9001  # Error.code of a reply the server refused (Flower's own codes are small integers)


@dataclass
class ExchangeLog:
    """What happened to one round's train exchange: written by that round's guarded grid and strategy,
    which are made for the round and given this log (nothing carries over between rounds)."""

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
    update_norms: dict[int, float] = field(default_factory=dict)  # node -> L2 distance of its plain update
    update_bound: float = 0.0  # the round's L2 bound on an update (FedConfig.update_bound), set by the guard
    clip_bit_mean: float | None = None  # adaptive clipping: the aggregate's clip bits (server/rounds.py)


def array_record_bytes(record: ArrayRecord) -> int:
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

    def __init__(
        self,
        grid: Grid,
        config: FedConfig,
        exchange: ExchangeLog,
        shapes: list[tuple[str, tuple[int, ...]]],
        num_heads: int | None,
        default_timeout: float | None,
        modulus_range: int | None = None,
    ) -> None:
        self._grid = grid
        self._config = config
        self.exchange = exchange
        self.shapes = shapes
        self.num_heads = num_heads
        self.default_timeout = default_timeout
        self.modulus_range = modulus_range  # SecAgg+'s modulus (common/federation/wire.py secagg_plan)
        self.secagg = SecAggWitness()
        exchange.update_bound = config.update_bound(sum(math.prod(shape) for _, shape in shapes))

    # -- delegation
    def set_run(self, run: Run) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Run:
        return self._grid.run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    # -- guarded exchange
    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        for msg in messages:
            if msg.metadata.message_type == MessageType.TRAIN and FITINS_PARAMETERS in msg.content.array_records:
                self.exchange.bytes_down.append(array_record_bytes(msg.content.array_records[FITINS_PARAMETERS]))
        wanted = {m.metadata.dst_node_id for m in messages}
        replies = list(
            self._grid.send_and_receive(messages, timeout=timeout if timeout is not None else self.default_timeout)
        )
        strangers = [r for r in replies if r.metadata.src_node_id not in wanted]
        for reply in strangers:
            log.warning("dropped a reply from node %s, which was not asked", reply.metadata.src_node_id)
        replies = [r for r in replies if r.metadata.src_node_id in wanted]
        answered = {r.metadata.src_node_id for r in replies}
        is_train = bool(messages) and messages[0].metadata.message_type == MessageType.TRAIN
        if not is_train:
            return replies
        stage = _stage(messages[0])
        self.secagg.sent(stage, messages)
        for node in wanted - answered:
            self.exchange.failures.setdefault(node, "no reply before the timeout")
        checked = [self._check(r, stage) for r in replies]
        # what only the whole stage shows: duplicated keys, accused peers, inconsistent shares
        culprits = self.secagg.culprits(stage, [r for r in checked if not r.has_error()])
        return [
            self._reject(r, culprits[r.metadata.src_node_id]) if r.metadata.src_node_id in culprits else r
            for r in checked
        ]

    def _check(self, reply: Message, stage: str | None) -> Message:
        node = reply.metadata.src_node_id
        if reply.has_error():
            self.exchange.failures[node] = short_reason(reply.error.reason or f"error code {reply.error.code}")
            return reply
        try:
            self._validate(node, reply.content, stage)
        except ReplyError as exc:
            reason = str(exc)
        except Exception as exc:  # noqa: BLE001 - a reply that breaks a check is malformed, never fatal
            reason = f"malformed reply ({type(exc).__name__}: {short_reason(str(exc), 120)})"
        else:
            return reply
        return self._reject(reply, reason)

    def _reject(self, reply: Message, reason: str) -> Message:
        """The error reply a workflow sees instead of `reply`: the client is dropped, and named with the reason."""
        node = reply.metadata.src_node_id
        log.warning("rejected the reply of node %s: %s", node, reason)
        self.exchange.rejected.append({"node": node, "reason": reason})
        self.exchange.checked.pop(node, None)
        return Message(
            metadata=copy.copy(reply.metadata), error=Error(code=REJECTED_CODE, reason=f"rejected: {reason}")
        )

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
            expected = self.secagg.neighbours.get(node, set()) - {node}
            if node in self.secagg.neighbours and (len(set(dsts)) != len(dsts) or set(dsts) != expected):
                raise ReplyError(
                    "SecAgg+ share-keys reply is not addressed to this node's neighbours (replayed from another node?)"
                )
        elif stage == SecAggStage.COLLECT_MASKED_VECTORS:
            self._validate_fitres(node, content, masked=True)
        elif stage == SecAggStage.UNMASK:
            nids = _list_of(cfg.get(SecAggKey.NODE_ID_LIST), int, "SecAgg+ node id list")
            shares = _list_of(cfg.get(SecAggKey.SHARE_LIST), bytes, "SecAgg+ share list")
            if len(nids) != len(shares):
                raise ReplyError(f"SecAgg+ unmask reply: {len(nids)} node ids for {len(shares)} shares")
            unknown = set(nids) - set(self.exchange.sampled)
            if unknown:
                raise ReplyError(f"SecAgg+ unmask reply names {len(unknown)} node(s) outside this round")
            if len(set(nids)) != len(nids):
                raise ReplyError("SecAgg+ unmask reply gives two shares for one node")
            if node in self.secagg.asked and set(nids) != self.secagg.asked[node]:
                raise ReplyError("SecAgg+ unmask reply does not give the shares it was asked for")
            for owner, share in zip(nids, shares):
                reason = self.secagg.malformed_share(share)
                if reason:
                    raise ReplyError(f"SecAgg+ unmask reply: the share for node {owner} is {reason}")
        if stage == SecAggStage.COLLECT_MASKED_VECTORS and BAD_SHARE_SOURCES in cfg:
            accused = _list_of(cfg.get(BAD_SHARE_SOURCES), int, "SecAgg+ bad share sources")
            if not set(accused) <= self.secagg.neighbours.get(node, set(accused)) - {node}:
                raise ReplyError("SecAgg+ reply names peers that are not its neighbours")

    def _validate_fitres(self, node: int, content: RecordDict, masked: bool) -> None:
        """A legacy FitRes reply: its weight and metrics (protocol), its update (plain) or masked vector."""
        reply = TrainReply.from_content(content, self.num_heads)  # every value, with a one-line reason
        fitres = compat.recorddict_to_fitres(content, keep_input=True)  # what the workflow will call
        if fitres.status.code != Code.OK:
            raise ReplyError(f"client status {fitres.status.code.name}: {short_reason(fitres.status.message, 120)}")
        if masked:
            # The masked weight factor is hidden from the server (see the module docstring); the
            # plaintext count is not, and an honest client never claims more than the weight cap, the
            # workflow's max_weight (a cap the server could not apply to a masked update).
            if reply.num_examples > self._config.weight_cap:
                raise ReplyError(
                    f"weight {reply.num_examples} above the weight cap {self._config.weight_cap} "
                    "(max-chunks-per-client, secagg-max-weight)"
                )
            payload = content.config_records[RECORD_KEY_CONFIGS].get(SecAggKey.MASKED_PARAMETERS)
            if not isinstance(payload, list) or not all(isinstance(b, bytes) for b in payload):
                raise ReplyError("SecAgg+ reply has no masked vector")
            self.exchange.bytes_up.append(sum(len(b) for b in payload))
            try:
                arrays = [bytes_to_ndarray(b) for b in payload]
            except Exception as exc:  # noqa: BLE001 - anything undecodable is a malformed reply
                raise ReplyError(f"undecodable masked vector ({type(exc).__name__})") from None
            if self.modulus_range is None:
                raise ReplyError("masked vector sent to a round without SecAgg+")
            reason = validate_masked(arrays, self.shapes, self.modulus_range)
            if reason:
                raise ReplyError(reason)
            wanted = masked_dtype(self.modulus_range)  # Flower sums in the vectors' own type: it must wrap right
            if any(np.asarray(a).dtype != wanted for a in arrays):
                raise ReplyError(f"masked vector must be {wanted} for modulus {self.modulus_range}")
        else:
            if self._config.secagg:
                raise ReplyError("plain update sent to a SecAgg+ round")
            self.exchange.bytes_up.append(array_record_bytes(content.array_records[FITRES_PARAMETERS]))
            try:  # the update, new heads minus the heads sent, in int8 (common/federation/wire.py)
                arrays = decode_update(parameters_to_ndarrays(fitres.parameters))
            except FedLookaheadError as exc:
                raise ReplyError(f"malformed update: {exc}") from None
            except Exception as exc:  # noqa: BLE001
                raise ReplyError(f"undecodable update ({type(exc).__name__})") from None
            reason = validate_update(arrays, self.shapes, bound=None)
            if reason:
                raise ReplyError(reason)
            if not reply.skipped:
                norm = get_norm([np.asarray(a, dtype=np.float64) for a in arrays])
                if norm > self.exchange.update_bound * 1.01:  # stochastic int8 rounding lengthens a clipped update
                    raise ReplyError(
                        f"update norm {norm:.4g} above the bound {self.exchange.update_bound:.4g} (update-max-norm)"
                    )
                self.exchange.update_norms[node] = norm
        self.exchange.checked[node] = reply


def short_reason(reason: str, limit: int = 300) -> str:
    """The last line of a reason (Flower wraps client exceptions in a repr and a traceback)."""
    lines = [line for line in str(reason).strip().splitlines() if line.strip()]
    last = (lines[-1] if lines else str(reason)).strip()
    if last.endswith("'>"):  # the simulation runtime wraps the message as "<class ...>:<'...'>"
        last = last[:-2]
    return last[:limit]
