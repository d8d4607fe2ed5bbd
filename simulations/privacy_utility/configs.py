"""The benchmark's scales and the run configurations (pyproject keys) of its federated runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.data.packages import PRIVATE_PACKAGES

EPSILONS = (1, 2, 4, 8)
DELTA = 1e-5
TRICK_EPSILON = 8


@dataclass(frozen=True)
class Scale:
    clients: int = 4
    rounds: int = 2
    chunk_len: int = 64
    max_chunks_per_client: int = 600  # 450 to train: DP-SGD needs data (docs/benchmarks.md: the signal-to-noise)
    heldout_fraction: float = 0.25
    batch_size: int = 16
    lr: float = 1e-3
    max_files_per_package: int = 0  # 0: every .py file
    packages: tuple[str, ...] = PRIVATE_PACKAGES
    tricks: bool = True
    user_dp: bool = True
    validate_prompts: int = 3
    validate_tokens: int = 32
    public_files: int = 400  # the public heads: stdlib train files, chunks and seconds of training
    public_chunks: int = 1000
    public_seconds: float = 600.0


QUICK = Scale(
    clients=4,
    rounds=2,
    chunk_len=32,
    max_chunks_per_client=24,
    heldout_fraction=0.25,
    batch_size=4,
    lr=1e-3,
    max_files_per_package=3,
    packages=PRIVATE_PACKAGES[:8],
    tricks=False,
    user_dp=True,
    validate_prompts=1,
    validate_tokens=8,
    public_files=40,
    public_chunks=64,
    public_seconds=10.0,
)


def base_run_config(scale: Scale, base_dir: Path, data_dir: Path, heads_dir: Path, out_dir: Path) -> dict:
    """The product's run config (pyproject keys) shared by every federated configuration."""
    n = scale.clients
    return {
        "base-model-dir": str(base_dir),
        "data-source": str(data_dir),
        "partitioning": "package",
        "init-heads": str(heads_dir),
        "num-server-rounds": scale.rounds,
        "min-train-clients": n,
        "min-available-clients": n,
        "node-wait-seconds": 0.0,
        "chunk-len": scale.chunk_len,
        "max-chunks-per-client": scale.max_chunks_per_client,
        "local-heldout-fraction": scale.heldout_fraction,
        "batch-size": scale.batch_size,
        "lr": scale.lr,
        "local-epochs": 1,
        "num-heads": 4,
        "dp-delta": DELTA,
        "secagg": True,
        "fraction-evaluate": 0.0,
        "server-eval-chunks": 0,
        "eval-prompts": 1,
        "eval-max-new-tokens": 0,
        "client-eval-prompts": 0,
        "run-dir": str(out_dir / "runs"),
        "store-url": f"sqlite:///{out_dir / 'runs' / 'privacy_utility.db'}",
    }


def dp_run_config(run_config: dict, eps: float, recipe: dict) -> dict:
    """`run_config` with example-level DP-SGD at `eps` and a recipe of DP tricks (run-config overrides)."""
    return dict(run_config, **{"dp": True, "dp-target-epsilon": float(eps)}, **recipe)


def user_dp_run_config(run_config: dict) -> dict:
    """`run_config` with user-level DP (Flower's fixed clipping, noise shares added on the devices) at the tricks' epsilon."""
    return dict(
        run_config,
        **{"dp": True, "dp-level": "user", "update-max-norm": 0.1, "dp-target-epsilon": float(TRICK_EPSILON)},
    )
