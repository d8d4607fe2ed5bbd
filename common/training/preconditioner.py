"""SGD on the heads with per-coordinate steps from public gradients: the client optimizer of user-level DP.

The heads' loss is very sharp along its gradient (a plain SGD step of norm 0.03 raised validation loss
by 1.25, issue 28), and AdamW's per-client moments are private and restart every round. So each step is
`lr * grad / rms`, where `rms` is the root mean square of the heads' gradients on small batches of
*public* code (the stdlib's train split): no privacy cost, and the same for every client, so the
clients' updates stay comparable and sum well. Matrices keep Adafactor's factored form (a row and a
column mean of the squared gradients, Shazeer & Stern 2018), so the server sends it in kilobytes;
vectors keep theirs whole. The smallest rms are floored at its 1% quantile: a coordinate that public
code never moves would otherwise take an unbounded step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.data.features import Features
from common.errors import FedLookaheadError
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel

PUBLIC_BATCHES = 160  # batches of public chunks averaged
CHUNKS_PER_BATCH = 2  # a client's round sees a few chunks: gradients of that size set the scale
FLOOR_QUANTILE = 0.01


@dataclass
class Preconditioner:
    """Per-parameter mean squared public gradients, factored for matrices: (rows, cols) or a full vector."""

    factors: dict[str, tuple[torch.Tensor, ...]]
    floor: float  # the smallest rms a step divides by

    def denominators(self) -> dict[str, torch.Tensor]:
        """Each parameter's rms (the step's divisor), floored."""
        out = {}
        for name, parts in self.factors.items():
            squares = (
                torch.outer(parts[0], parts[1]) / parts[0].mean().clamp_min(1e-30) if len(parts) == 2 else parts[0]
            )
            out[name] = squares.sqrt().clamp_min(self.floor)
        return out

    def update_scale(self) -> list[np.ndarray]:
        """Per-coordinate scale of the coordinates a public-sgd update travels, is clipped and is noised in (in
        the heads' parameter order, which is the wire order: common/federation/records.py): u = scale * y with scale = (rms / mean rms)^(-1/2). Noise isotropic in y is
        smaller where public code moves the heads most, the directions the loss is sharpest in (public
        preconditioning before privatisation, as AdaDPS does: Li et al. 2022); the mean keeps norms comparable."""
        rms = self.denominators()
        mean = torch.cat([r.flatten() for r in rms.values()]).mean()
        return [(r / mean).rsqrt().numpy().astype(np.float32) for r in rms.values()]

    def to_bytes(self) -> bytes:
        """float32 factors in the heads' parameter order, then the floor: what the train config carries."""
        flat = [part.numpy().astype(np.float32).ravel() for parts in self.factors.values() for part in parts]
        return np.concatenate([*flat, np.array([self.floor], np.float32)]).tobytes()

    @classmethod
    def from_bytes(cls, blob: bytes, heads: DraftHeads) -> Preconditioner:
        """The preconditioner a server sent, sized by `heads`; a clear error when it does not fit them."""
        values = np.frombuffer(blob, dtype=np.float32)
        factors, start = {}, 0
        for name, parameter in heads.named_parameters():
            sizes = parameter.shape if parameter.dim() == 2 else (parameter.numel(),)
            parts = []
            for size in sizes:
                parts.append(torch.from_numpy(values[start : start + size].copy()))
                start += size
            factors[name] = tuple(parts)
        if start + 1 != len(values) or not np.all(np.isfinite(values)) or values.min() < 0:
            raise FedLookaheadError(
                f"the public preconditioner does not fit these heads ({len(values)} values, expected {start + 1}, "
                "all finite and non-negative)"
            )
        return cls(factors, float(values[-1]))


def whitened(received: list[np.ndarray], trained: list[np.ndarray], scale: list[np.ndarray]) -> list[np.ndarray]:
    """What a public-sgd client sends as its new heads: `received` plus its update in the scaled coordinates,
    so the clip, the noise share and SecAgg+ all act on (trained - received) / scale."""
    return [r + (t - r) / s for r, t, s in zip(received, trained, scale)]


def unwhitened(current: list[np.ndarray], mean: list[np.ndarray], scale: list[np.ndarray]) -> list[np.ndarray]:
    """The server's inverse of `whitened` on the clients' mean: back to the heads' own coordinates."""
    return [c + (m - c) * s for c, m, s in zip(current, mean, scale)]


def public_preconditioner(heads: DraftHeads, public: Features, batches: int = PUBLIC_BATCHES) -> Preconditioner:
    """Mean squared gradients of `heads` over `batches` batches of public chunks, factored, with its floor."""
    from common.training.loop import heads_loss

    if len(public) < CHUNKS_PER_BATCH:
        raise FedLookaheadError(f"a public preconditioner needs at least {CHUNKS_PER_BATCH} public chunks")
    batches = min(batches, len(public) // CHUNKS_PER_BATCH)
    parameters = dict(heads.named_parameters())
    squares = {name: torch.zeros_like(p) for name, p in parameters.items()}
    was_training = heads.training
    heads.train()
    for index in range(batches):
        batch = public.subset(slice(index * CHUNKS_PER_BATCH, (index + 1) * CHUNKS_PER_BATCH))
        heads.zero_grad(set_to_none=True)
        heads_loss(heads, batch.hidden, batch.tokens, batch.greedy).backward()
        for name, p in parameters.items():
            if p.grad is not None:
                squares[name] += p.grad.detach().float() ** 2 / batches
    heads.zero_grad(set_to_none=True)
    heads.train(was_training)
    factors = {name: (v.mean(1), v.mean(0)) if v.dim() == 2 else (v.flatten(),) for name, v in squares.items()}
    unfloored = Preconditioner(factors, 0.0).denominators()
    rms = torch.cat([d.flatten() for d in unfloored.values()])
    floor = float(rms.kthvalue(max(1, int(FLOOR_QUANTILE * rms.numel()))).values)
    return Preconditioner(factors, max(floor, 1e-12))


class PreconditionedSGD(torch.optim.Optimizer):
    """p <- p - lr * grad / rms, with `rms` from `Preconditioner.denominators` (one per parameter)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], denominators: dict[str, torch.Tensor], lr: float):
        missing = [name for name, _ in named if name not in denominators]
        if missing:
            raise FedLookaheadError(
                f"the public preconditioner has no entry for {missing[0]} (and {len(missing) - 1} more)"
            )
        super().__init__([{"params": [p], "rms": denominators[name]} for name, p in named], {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's Optimizer signature
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / group["rms"].to(p.device), alpha=-group["lr"])
        return loss


def stdlib_preconditioner(heads: DraftHeads, base: BaseModel, chunk_len: int, seed: int) -> Preconditioner:
    """The preconditioner of `heads` on a seeded draw of the stdlib's train split (the public data), its
    features cached like any other (common/data/features.py)."""
    from common.data.chunks import drawn_chunks, stdlib_files
    from common.data.features import base_features

    generator = torch.Generator().manual_seed(seed)
    chunks = drawn_chunks(
        stdlib_files("train"),
        base.tokenizer,
        chunk_len,
        PUBLIC_BATCHES * CHUNKS_PER_BATCH,
        generator,
        files_per_batch=16,
    )
    return public_preconditioner(heads, base_features(base, chunks))
