"""Evaluation of the global heads each round: on the server's public held-out split, and on the clients.

`ServerEval` is also the reference evaluation of simulations/central.py (centrally trained heads are
judged on the same split, by the same code).
"""

from __future__ import annotations

import copy
import logging
import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.serverapp.grid import Grid

from common.data.chunks import chunk_files, prompts_from_files, stdlib_files
from common.data.features import base_features
from common.decoding.tau import decode_tau
from common.federation.config import FedConfig
from common.federation.protocol import EVALUATE, HEADS_CONFIG_RECORD, HEADS_RECORD, ROUND_KEY, EvalReply, ReplyError
from common.federation.records import heads_records
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel
from common.training.loop import evaluate_heads
from server.guard import array_record_bytes

log = logging.getLogger("flwr.fedla.server")


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
        summary = (
            evaluate_heads(heads, base_features(base, self.chunks), batch_size=config.batch_size)
            if len(self.chunks)
            else {"loss": 0.0, "head_accuracy": [0.0] * heads.num_heads}
        )
        tau = decode_tau(base, heads, self.prompts, config.eval_max_new_tokens)
        out = {
            "loss": float(summary["loss"]),
            "head_accuracy": [float(a) for a in summary["head_accuracy"]],
            "tau": tau,
        }
        if heads_only:
            out["tau_heads_only"] = decode_tau(base, heads, self.prompts, config.eval_max_new_tokens, ngram=False)
        return out


def client_evaluation(
    grid: Grid,
    heads: DraftHeads,
    config: FedConfig,
    server_round: int,
    nodes: list[int],
    rng: random.Random,
    final: bool = False,
) -> dict[str, Any]:
    """Push the global heads (native ArrayRecord + ConfigRecord) to a sample of clients and average their eval.

    After the last round (`final`) the heads go to every node, which keeps them; only the sampled ones measure
    them (head accuracy, and tau with client-eval-prompts), so the push costs a population no evaluation.
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
        node_cfg[EVALUATE] = node in sampled
        messages.append(
            Message(  # one heads record for every message: a population's final push would copy it per node
                RecordDict({HEADS_RECORD: arrays, HEADS_CONFIG_RECORD: node_cfg}),
                dst_node_id=node,
                message_type=MessageType.EVALUATE,
                group_id=f"eval-{server_round}",
            )
        )
    push_bytes = array_record_bytes(arrays)
    timeout = config.round_timeout or None
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    accuracy_sum = np.zeros(heads.num_heads)
    examples = 0
    taus: list[float] = []
    rejected, failed, withheld = [], 0, 0
    cap = config.weight_cap
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
        withheld += int(result.withheld)
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
        "withheld": withheld,  # devices that reveal no evaluation of their private data
        "head_accuracy": (accuracy_sum / examples).tolist() if examples else None,
        "tau": sum(taus) / len(taus) if taus else None,
        "push_bytes_per_client": push_bytes,
    }
