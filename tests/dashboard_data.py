"""Realistic synthetic run data for the dashboard tests: written only through the RunStore API, shaped like
what the ServerApp records."""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

from server.run.curve import PrivacyUtilityCurve
from server.run.folder import RunFolder
from server.run.record import RoundRecord
from server.store.run_store import RunStore

SECAGG = {
    "num_shares": 3,
    "reconstruction_threshold": 2,
    "max_weight": 1000.0,
    "clipping_range": 8.0,
    "quantization_range": 4194304,
    "modulus_range": 4294967296,
    "timeout": 30.0,
}
PRIVACY_PLAN = {
    "dp": True,
    "level": "example",
    "epsilon_budget": 4.0,
    "delta": 1e-5,
    "planned_rounds": 20,
    "verdict": None,
}
REJECT_REASONS = [
    "update has non-finite values",
    "stale head version (expected 7, got 6)",
    "reply missing 'num_examples'",
]


def write_checkpoint(directory: Path, seed: int) -> tuple[Path, int, str]:
    """A small heads.safetensors checkpoint directory; returns (dir, size of heads file, its sha256)."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    save_file(
        {
            "heads.0.proj.weight": torch.randn(64, 64, generator=g),
            "heads.1.proj.weight": torch.randn(64, 64, generator=g),
        },
        str(directory / "heads.safetensors"),
    )
    (directory / "heads_config.json").write_text('{"num_heads": 2, "hidden_size": 64}\n')
    data = (directory / "heads.safetensors").read_bytes()
    return directory, len(data), hashlib.sha256(data).hexdigest()


def fill_realistic_run(
    store: RunStore,
    run_id: str,
    *,
    rounds: int = 20,
    num_heads: int = 4,
    run_dir: Path | None = None,
    checkpoint_every: int = 5,
    finish: bool = True,
    seed: int = 0,
) -> None:
    """Record `rounds` rounds; with `run_dir`, also checkpoints where the server writes them:
    ``<run_dir>/<run_id>/checkpoints/round-<r>`` (server/run/folder.py)."""
    rng = random.Random(seed)
    config = {
        "num_rounds": rounds,
        "clients_per_round": 8,
        "num_clients": 32,
        "num_heads": num_heads,
        "local_epochs": 1,
        "lr": 0.001,
        "noise_multiplier": 0.9,
        "max_grad_norm": 1.0,
        "delta": 1e-5,
        "chunk_len": 128,
        "base": "default (stdlib Llama, 6 layers)",
    }
    store.start_run(run_id, config, SECAGG)
    store.record_plan(run_id, {"nodes": 32, "clients_per_round": 8, "privacy": PRIVACY_PLAN})
    ceilings = [0.62, 0.41, 0.29, 0.21, 0.16, 0.12][:num_heads]
    start = [c * 0.2 for c in ceilings]
    store.record_starting_heads(
        run_id,
        {"head_accuracy": start, "tau": 1 + sum(math.prod(start[: k + 1]) for k in range(num_heads)), "loss": 7.9},
    )
    for r in range(1, rounds + 1):
        progress = 1 - math.exp(-r / 6)
        acc = [max(0.0, c * (0.25 + 0.75 * progress) + rng.gauss(0, 0.008)) for c in ceilings]
        client_acc = [max(0.0, a + rng.gauss(0.01, 0.012)) for a in acc]
        tau = 1 + sum(math.prod(acc[: k + 1]) for k in range(num_heads))
        client_tau = 1 + sum(math.prod(client_acc[: k + 1]) for k in range(num_heads))
        dropped = rng.choice([0, 0, 0, 1, 1, 2])
        rejected = [{"reason": rng.choice(REJECT_REASONS)} for _ in range(rng.choice([0, 0, 0, 0, 1]))]
        succeeded = 8 - dropped - len(rejected)
        eps = 0.42 * math.sqrt(r) + 0.05 * r
        wall = round(rng.uniform(38, 52), 1)
        store.record_round(
            run_id,
            RoundRecord(
                round=r,
                train_loss=6.1 * math.exp(-r / 9) + 2.7 + rng.gauss(0, 0.04),
                head_accuracy=acc,
                tau=tau,
                client_head_accuracy=client_acc,
                client_tau=client_tau,
                tau_heads_only=tau - 0.1 if r == rounds else None,  # measured on the last round only
                sampled=8,
                succeeded=succeeded,
                dropped=dropped,
                rejected=tuple(rejected),
                epsilon_max=eps * 1.08,
                epsilon_mean=eps,
                delta=1e-5,
                wall_seconds=wall,
                bytes_down_per_client=1_082_368,
                bytes_up_per_client=1_082_368,
                eval_push_bytes_per_client=1_082_368,
                fit_seconds=round(wall * 0.7, 1),
                server_eval_seconds=round(wall * 0.2, 1),
                client_eval_seconds=round(wall * 0.1, 1),
            ),
        )
        if run_dir is not None and (r % checkpoint_every == 0 or r == rounds):
            directory, size, sha = write_checkpoint(run_dir / run_id / "checkpoints" / f"round-{r}", seed=r)
            store.record_checkpoint(run_id, r, head_version=r, path=str(directory), size_bytes=size, sha256=sha)
    if finish:
        store.finish_run(run_id, "finished")


def write_privacy_utility(folder: Path) -> None:
    """The privacy-utility curve a benchmark leaves in a run's folder, this run at epsilon 8."""
    folder.mkdir(parents=True, exist_ok=True)
    PrivacyUtilityCurve(
        epsilon=[1.0, 2.0, 4.0, 8.0],
        dp=[1.40, 1.44, 1.46, 1.49],
        references={"public_only": 1.48, "central_nodp": 1.54, "federated_nodp": 1.47},
        clients=6,
        rounds=3,
        this_run={"kind": "dp", "epsilon": 8.0, "tau": 1.49},
    ).write(RunFolder(folder).privacy_utility)
