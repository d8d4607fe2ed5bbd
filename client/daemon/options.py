"""What `fedla client` is asked to do (DaemonOptions), its one-line error and its exit codes, and the node
config those options amount to (the keys: client/node_config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from client.node_config import (
    BASE_MODEL_DIR_KEY,
    BUDGET_KEY,
    DATA_DIR_KEY,
    DEVICE_KEY,
    HEADS_DIR_KEY,
    MAX_DELTA_KEY,
    MAX_GRAD_NORM_KEY,
    MIN_CHUNK_LEN_KEY,
    MIN_NOISE_KEY,
    STATE_DIR_KEY,
    NodeConfig,
)
from common.errors import FedLookaheadError

# exit codes of `fedla client` (also documented in docs/deploy.md)
EXIT_OK = 0
EXIT_BAD_INPUT = 2  # checked before connecting
EXIT_REFUSED = 3  # the SuperLink does not know this node's key
EXIT_TLS = 4  # the SuperLink's certificate is not trusted / does not match
EXIT_UNREACHABLE = 5  # gave up reconnecting


class DaemonError(FedLookaheadError):
    """A final error of the daemon: one line, and the exit code it ends with."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class DaemonOptions:
    superlink: str
    data: Path
    base: Optional[str | Path] = None  # a model folder, `smollm2` or `toy`; None: the embedded default
    device: str = "auto"
    budget_eps: Optional[float] = None  # lifetime epsilon budget; None: DeviceFloor's default
    max_delta: float | None = None  # None: DeviceFloor's defaults, for these three too
    max_grad_norm: float | None = None
    min_noise_multiplier: float | None = None
    min_chunk_len: int | None = None
    root_certificates: Optional[Path] = None
    auth_key: Optional[Path] = None
    state_dir: Optional[Path] = None
    heads_dir: Optional[Path] = None  # None: common.paths.default_heads_dir()
    publish_heads: bool = True
    insecure: bool = False
    max_retries: int = 10  # flower-supernode's own reconnection tries per start
    max_wait_time: float = 60.0  # flower-supernode's own reconnection time limit per start
    restarts: int = 5  # failed starts in a row before giving up (0: never give up)
    refused_patience: float = 75.0  # seconds of refused activations before calling the key unregistered
    runtime_port: int = 0  # the SuperNode's local runtime API port (0: a free one)
    node_config: str = ""  # extra `k=v ...` node config (any FedConfig client-side key)
    serve_port: int = 0  # > 0: also serve the local OpenAI-compatible endpoint on 127.0.0.1:PORT
    prepare: bool = True  # tokenise the device's files (and base features, when cheap) before joining


def parse_node_config(text: str) -> dict:
    """`--node-config "k=v ..."` with TOML values, as Flower parses it."""
    if not text:
        return {}
    from flwr.common.config import parse_config_args

    try:
        return parse_config_args([text])
    except Exception as exc:  # noqa: BLE001 - click/tomli errors
        raise DaemonError(f"--node-config {text!r} is not `k=v ...` with TOML values: {exc}") from exc


def floor_values(opts: DaemonOptions) -> dict:
    """This device's privacy floor as node config keys (client.training.floor.DeviceFloor; unset options: its defaults)."""
    defaults = NodeConfig()
    chosen = {
        BUDGET_KEY: (opts.budget_eps, defaults.budget_epsilon),
        MAX_DELTA_KEY: (opts.max_delta, defaults.max_dp_delta),
        MAX_GRAD_NORM_KEY: (opts.max_grad_norm, defaults.max_dp_grad_norm),
        MIN_NOISE_KEY: (opts.min_noise_multiplier, defaults.min_dp_noise_multiplier),
    }
    values = {key: float(default if value is None else value) for key, (value, default) in chosen.items()}
    values[MIN_CHUNK_LEN_KEY] = int(defaults.min_chunk_len if opts.min_chunk_len is None else opts.min_chunk_len)
    return values


def node_config_values(opts: DaemonOptions, state_dir: Path, base_dir: Path | None = None) -> dict:
    """The node config of this device; `base_dir` is the prepared base (else --base when it is a folder)."""
    from common.model.default import NAMED_BASES

    if base_dir is None and opts.base is not None and str(opts.base) not in ("", *NAMED_BASES):
        base_dir = Path(opts.base)
    values: dict = {
        DATA_DIR_KEY: str(opts.data.expanduser().resolve()),
        STATE_DIR_KEY: str(state_dir.expanduser().resolve()),
        DEVICE_KEY: opts.device,
        BASE_MODEL_DIR_KEY: str(base_dir.expanduser().resolve()) if base_dir is not None else "",
    }
    if opts.publish_heads:
        if opts.heads_dir is None:
            from common.paths import default_heads_dir

            values[HEADS_DIR_KEY] = str(default_heads_dir().resolve())
        else:
            values[HEADS_DIR_KEY] = str(opts.heads_dir.expanduser().resolve())
    values.update(floor_values(opts))
    values.update(parse_node_config(opts.node_config))
    return values
