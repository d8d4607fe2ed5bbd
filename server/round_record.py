"""A round's `RoundRecord` (server/run/record.py) from what its exchange saw, its evaluations and its timings."""

from __future__ import annotations

import math
from typing import Any

from common.federation.config import FedConfig
from common.heads.lookahead import DraftHeads
from server.guard import ExchangeLog
from server.run.record import RoundRecord


def round_record(
    config: FedConfig,
    server_round: int,
    exchange: ExchangeLog,
    server_metrics: dict,
    client_eval: dict,
    client_eps: dict[int, float],
    heads: DraftHeads,
    fit_seconds: float,
    server_eval_seconds: float,
    client_eval_seconds: float,
    wall_seconds: float,
) -> RoundRecord:
    """What a round did, from its exchange (checked by the guard), its evaluations and its timings."""
    replies = exchange.client_metrics  # node -> TrainReply, checked by the guard
    trained = {n: r for n, r in replies.items() if r.trained}
    skipped = {n: r.skip_reason for n, r in replies.items() if r.skipped}
    for node, reply in replies.items():
        if reply.epsilon is not None:
            client_eps[node] = reply.epsilon
    chunks = {n: float(exchange.weights.get(n) or 1) for n in trained}
    total = sum(chunks.values())
    if trained and total > 0:
        train_loss = sum(r.loss * chunks[n] for n, r in trained.items()) / total
        train_acc = [
            sum((r.head_accuracy[k] if k < len(r.head_accuracy) else 0.0) * chunks[n] for n, r in trained.items())
            / total
            for k in range(heads.num_heads)
        ]
        loss_source = "clients"
    else:
        train_loss, train_acc, loss_source = server_metrics["loss"], None, "server-eval (no client trained)"
    eps_values = list(client_eps.values())
    if not config.dp:
        eps_max = eps_mean = math.inf
    else:
        eps_max = max(eps_values) if eps_values else 0.0
        eps_mean = sum(eps_values) / len(eps_values) if eps_values else 0.0
    sampled = len(exchange.sampled)
    rejected_nodes = {r["node"] for r in exchange.rejected}
    succeeded = len(replies)  # replies that reached aggregation (none when SecAgg+ aborted)
    dropped = max(0, sampled - succeeded - len(rejected_nodes))
    down = exchange.bytes_down
    up = exchange.bytes_up
    bytes_down = int(sum(down) / len(down)) if down else 0
    bytes_up = int(sum(up) / len(up)) if up else 0
    return RoundRecord(
        round=server_round,
        head_version=heads.config.version,
        aggregated=exchange.aggregated,
        aggregate_note=exchange.aggregate_note,
        train_loss=float(train_loss),
        head_accuracy=server_metrics["head_accuracy"],
        tau=server_metrics["tau"],
        client_head_accuracy=client_eval.get("head_accuracy"),
        client_tau=client_eval.get("tau"),
        loss_source=loss_source,
        train_head_accuracy=train_acc,
        server_eval_loss=server_metrics["loss"],
        tau_heads_only=server_metrics.get("tau_heads_only"),
        sampled=sampled,
        succeeded=succeeded,
        dropped=dropped,
        rejected=tuple(exchange.rejected),
        failures={str(n): r for n, r in exchange.failures.items() if n not in rejected_nodes},
        skipped_budget={str(n): r for n, r in skipped.items()},
        weights={str(n): w for n, w in exchange.weights.items()},
        capped_weights={str(n): w for n, w in exchange.capped.items()},
        client_eval=client_eval,
        epsilon_max=eps_max,
        epsilon_mean=eps_mean,
        delta=config.dp_delta if config.dp else 0.0,
        target_epsilon=config.dp_target_epsilon if config.dp else None,
        epsilon_this_round={str(n): r.epsilon for n, r in replies.items() if r.epsilon is not None},
        noise_multiplier=tuple(sorted({r.noise_multiplier for r in replies.values()})),
        q=tuple(sorted({r.q for r in replies.values() if r.q > 0})),  # devices do not say theirs
        no_amplification_clients=sum(int(r.no_amplification) for r in replies.values()),
        bytes_down_per_client=bytes_down,
        bytes_up_per_client=bytes_up,
        eval_push_bytes_per_client=client_eval.get("push_bytes_per_client", 0),
        wall_seconds=wall_seconds,
        fit_seconds=fit_seconds,
        server_eval_seconds=server_eval_seconds,
        client_eval_seconds=client_eval_seconds,
        client_train_seconds=sum(r.train_seconds for r in replies.values()),
        update_norm=_update_norm_summary(exchange, config),
    )


def _update_norm_summary(exchange: ExchangeLog, config: FedConfig) -> dict[str, Any]:
    """The round's update bound and, in plain rounds (where the server sees updates), their median and max."""
    norms = sorted(exchange.update_norms.values())
    summary: dict[str, Any] = {"bound": exchange.update_bound, "checked": not config.secagg}
    if exchange.clip_bit_mean is not None:  # adaptive clipping: the noised share of updates within the bound
        summary["within_clip"] = exchange.clip_bit_mean
    if norms:
        summary.update(median=norms[len(norms) // 2], max=norms[-1])
    return summary
