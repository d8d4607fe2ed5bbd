"""What `fedla client` is asked to do (DaemonOptions), its one-line error and its exit codes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

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
    heads_dir: Optional[Path] = None  # None: common.decoding.default_heads_dir()
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
