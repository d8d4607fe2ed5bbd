"""A simulated client's accountant (no `state-dir`): it follows the run config, one history per run, in
`context.state` and, with `client-state-dir`, in a JSON file per partition and run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

from flwr.app import Context

from client.node_config import NodeConfig
from client.training.dp import PrivacyState
from common.durable import write_json
from common.federation.config import FedConfig

STATE_RECORD = "fedla-privacy"


def state_file(config: FedConfig, node_config: Mapping[str, Any], run_key: str) -> Path | None:
    """Where a simulated client's accountant for this run lives on disk (`client-state-dir`), if anywhere."""
    if not config.client_state_dir:
        return None
    safe_key = re.sub(r"[^A-Za-z0-9._-]", "_", run_key)
    partition = int(NodeConfig.from_mapping(node_config).partition_id)
    return Path(config.client_state_dir).expanduser() / f"partition-{partition}" / f"privacy-{safe_key}.json"


def load_state(context: Context, path: Path | None, run_key: str) -> PrivacyState:
    """The disk copy when there is one (it survives restarts), else context.state, else a fresh state."""
    if path is not None and path.is_file():
        state = PrivacyState.from_json(json.loads(path.read_text()))
        if state.run_key == run_key:
            return state
    record = context.state.config_records.get(STATE_RECORD)
    if record is not None:
        state = PrivacyState.from_record(record)
        if state.run_key == run_key:
            return state
    return PrivacyState(run_key)


def save_state(context: Context, path: Path | None, state: PrivacyState) -> None:
    context.state.config_records[STATE_RECORD] = state.to_record()
    if path is not None:
        write_json(path, state.to_json(), durable=True)
