"""Head training: the loss, one epoch, evaluation. Shared by `fedla train-heads` and the DP client."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from common.base import BaseModel
from common.heads import DraftHeads

HEAD_LOSS_DECAY = 0.8  # Medusa-1: head k's cross-entropy weighted 0.8^k


@dataclass
class HeadMetrics:
    """Summed loss and per-head top-1 hits over a pass; `.summary()` gives the means."""

    num_heads: int
    loss_sum: float = 0.0
    batches: int = 0
    correct: list[int] = field(default_factory=list)
    total: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.correct = self.correct or [0] * self.num_heads
        self.total = self.total or [0] * self.num_heads

    def summary(self) -> dict[str, float | list[float]]:
        accuracy = [c / t if t else 0.0 for c, t in zip(self.correct, self.total)]
        return {"loss": self.loss_sum / max(1, self.batches), "head_accuracy": accuracy}


def targets_and_inputs(base: BaseModel, chunks: torch.Tensor, distill: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Base hidden states (no grad) and the token sequence the heads learn to predict.

    With `distill`, the targets are the base's own greedy choices at every position (what the lossless
    decoder must match), instead of the text itself.
    """
    hidden = base.features(chunks)
    if not distill:
        return hidden, chunks
    with torch.no_grad():
        greedy = base.model.get_output_embeddings()(hidden).argmax(-1)
    # greedy[:, t] is the base's choice for position t+1: shift so that targets[:, j] is for position j.
    return hidden, torch.cat([chunks[:, :1], greedy[:, :-1]], dim=1)


def heads_loss(
    heads: DraftHeads, hidden: torch.Tensor, targets: torch.Tensor, metrics: HeadMetrics | None = None
) -> torch.Tensor:
    """Sum over heads of 0.8^k * CE(head k at t, token t+k+1), averaged over tokens and chunks.

    Averaging every head over the same number of positions per chunk keeps the loss a mean over
    samples, which Opacus's per-sample gradient scaling assumes.
    """
    length = targets.shape[1]
    num_heads = getattr(heads, "_module", heads).num_heads  # Opacus's GradSampleModule hides attributes
    logits = heads(hidden[:, :-1], targets[:, 1:])  # (B, L-1, K, V): position t fused with token t+1
    loss = hidden.new_zeros((), dtype=torch.float32)
    for k in range(1, num_heads + 1):
        valid = length - 1 - k
        if valid <= 0:
            break
        head_logits = logits[:, :valid, k - 1].float()
        head_targets = targets[:, k + 1 :]
        loss = loss + HEAD_LOSS_DECAY**k * torch.nn.functional.cross_entropy(
            head_logits.reshape(-1, head_logits.shape[-1]), head_targets.reshape(-1)
        )
        if metrics is not None:
            metrics.correct[k - 1] += int((head_logits.argmax(-1) == head_targets).sum())
            metrics.total[k - 1] += head_targets.numel()
    if metrics is not None:
        metrics.loss_sum += loss.item()
        metrics.batches += 1
    return loss


def chunk_loader(chunks: torch.Tensor, batch_size: int, shuffle: bool, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(chunks), batch_size=batch_size, shuffle=shuffle, generator=generator)


def train_epoch(
    heads: torch.nn.Module,
    base: BaseModel,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    num_heads: int,
    distill: bool = True,
    desc: str = "training heads",
    show_progress: bool = True,
) -> HeadMetrics:
    """One pass over `loader`. `heads` may be a DraftHeads or Opacus's GradSampleModule around one."""
    metrics = HeadMetrics(num_heads)
    heads.train()
    for (batch,) in tqdm(loader, desc=desc, unit="batch", disable=not show_progress, leave=False):
        batch = batch.to(base.device)
        optimizer.zero_grad(set_to_none=True)
        if len(batch) == 0:  # Poisson sampling can draw an empty batch; Opacus still takes a noisy step
            optimizer.step()
            continue
        hidden, targets = targets_and_inputs(base, batch, distill)
        heads_loss(heads, hidden, targets, metrics).backward()
        optimizer.step()
    heads.eval()
    return metrics


@torch.no_grad()
def evaluate_heads(
    heads: DraftHeads, base: BaseModel, chunks: torch.Tensor, batch_size: int = 16, distill: bool = True
) -> dict[str, float | list[float]]:
    """Loss and per-head top-1 accuracy against the base's greedy tokens (or the text)."""
    metrics = HeadMetrics(heads.num_heads)
    heads.eval()
    for (batch,) in chunk_loader(chunks, batch_size, shuffle=False):
        hidden, targets = targets_and_inputs(base, batch.to(base.device), distill)
        heads_loss(heads, hidden, targets, metrics)
    return metrics.summary()


def train_heads(
    heads: DraftHeads,
    base: BaseModel,
    chunks: torch.Tensor,
    epochs: int = 1,
    lr: float = 1e-3,
    batch_size: int = 16,
    distill: bool = True,
    seed: int = 0,
) -> list[dict[str, float | list[float]]]:
    """Centralised (non-private) training: the baseline federated runs are compared with."""
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr)
    history = []
    for epoch in range(epochs):
        loader = chunk_loader(chunks, batch_size, shuffle=True, seed=seed + epoch)
        metrics = train_epoch(heads, base, loader, optimizer, heads.num_heads, distill, f"epoch {epoch + 1}/{epochs}")
        history.append(metrics.summary())
    return history
