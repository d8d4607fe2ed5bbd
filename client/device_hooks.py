"""What the ClientApp asks a device to keep at each step: the global heads it was sent
(client/kept_heads.py) and one event line (client/events.py). A simulated node (no state dir) keeps nothing.
"""

from __future__ import annotations

from typing import Any, Mapping

from client.events import record_event
from client.kept_heads import keep_global_heads
from client.state import state_dir_of
from common.federation.protocol import ROUND_KEY, RUN_KEY, VERSION


def train_started(context, fit_config: Mapping[str, Any], heads) -> None:
    """Top of a local training round: keep the global heads it brought, note the start."""
    node_config = context.node_config
    if state_dir_of(node_config) is None:
        return
    server_round = fit_config.get(ROUND_KEY)
    keep_global_heads(heads, node_config, context.run_id, server_round)
    record_event(
        node_config,
        "train-start",
        run=int(context.run_id),
        fedla_run=fit_config.get(RUN_KEY),
        round=server_round,
        version=int(heads.config.version),
    )


def train_finished(context, fit_config: Mapping[str, Any], metrics: Mapping[str, Any], weight: int) -> None:
    if state_dir_of(context.node_config) is None:
        return
    record_event(
        context.node_config,
        "train-done",
        run=int(context.run_id),
        round=fit_config.get(ROUND_KEY),
        weight=int(weight),
        metrics=dict(metrics),  # the wire's own keys (common.federation.protocol), not renamed
    )


def heads_received(context, heads, heads_config: Mapping[str, Any]) -> None:
    """An evaluation message carries the new global heads: keep them."""
    keep_global_heads(heads, context.node_config, context.run_id, heads_config.get(ROUND_KEY))


def evaluated(context, heads_config: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
    """An evaluation ran; `final` when it was the run's last round (its heads are the run's result)."""
    if state_dir_of(context.node_config) is None:
        return
    server_round = heads_config.get(ROUND_KEY)
    try:
        final = int(server_round) >= int(context.run_config.get("num-server-rounds", 0)) > 0
    except (TypeError, ValueError):
        final = False
    record_event(
        context.node_config,
        "eval",
        run=int(context.run_id),
        round=server_round,
        version=heads_config.get(VERSION),
        final=int(final),
        metrics=dict(metrics),  # the wire's own keys (common.federation.protocol), not renamed
    )
