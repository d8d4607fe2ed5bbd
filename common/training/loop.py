"""Head training: the loss, one epoch, evaluation. Shared by `fedla train-heads` and the DP client.

Training reads cached base features (common/data/features.py), never the base itself. The targets are
the ones decoding will check: at position t the heads fuse the real next token x_{t+1} (then, step
by step, x_{t+2}, ...) and head k must predict the base's own greedy choice after x_{t+k}, which is
what verification accepts, rather than the text (a small base disagrees with the text about half
the time).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from common.data.distill import greedy_continuations
from common.data.features import Features, base_features, fast_feature_dtype
from common.heads.draft_vocab import build_draft_vocab, coverage
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel

DEFAULT_DRAFT_VOCAB = (
    8192  # heads score the 8,192 most frequent greedy tokens (measured: see simulations/bench_heads.py)
)
HEAD_LOSS_DECAY = 0.8  # Medusa-1: head k's cross-entropy weighted 0.8^k


@dataclass
class HeadMetrics:
    """Summed loss and per-head top-1 hits over a pass; `.summary()` gives the means."""

    num_heads: int
    loss_sum: float = 0.0
    batches: int = 0
    tokens: int = 0
    correct: list[int] = field(default_factory=list)
    total: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.correct = self.correct or [0] * self.num_heads
        self.total = self.total or [0] * self.num_heads

    def summary(self) -> dict[str, float | list[float]]:
        accuracy = [c / t if t else 0.0 for c, t in zip(self.correct, self.total)]
        return {"loss": self.loss_sum / max(1, self.batches), "head_accuracy": accuracy, "tokens": self.tokens}


def heads_loss(
    heads: torch.nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    greedy: torch.Tensor,
    metrics: HeadMetrics | None = None,
) -> torch.Tensor:
    """Sum over heads of 0.8^k * CE(head k at t, the base's greedy choice after x_{t+k}).

    Each chunk's loss is its own mean over a fixed number of positions per head (targets outside
    the draft vocabulary count as zero loss but as misses), then chunks are averaged: the loss is a
    mean over samples, as Opacus's per-sample gradient scaling assumes.
    """
    plain = getattr(heads, "_module", heads)  # Opacus's GradSampleModule hides attributes
    length = tokens.shape[1]
    logits = heads(hidden.float(), tokens)  # K x (B, L-1, N)
    loss = hidden.new_zeros((), dtype=torch.float32)
    for k in range(1, plain.num_heads + 1):
        positions = length - k  # t = 0 .. L-1-k have a target greedy[t + k]
        if positions <= 0:
            break
        head_logits = logits[k - 1][:, :positions].float()
        target_ids = greedy[:, k:]
        targets = plain.to_draft[target_ids]
        per_position = torch.nn.functional.cross_entropy(
            head_logits.reshape(-1, head_logits.shape[-1]), targets.clamp_min(0).reshape(-1), reduction="none"
        ).view(targets.shape)
        per_chunk = (per_position * (targets >= 0)).sum(dim=1) / positions
        loss = loss + HEAD_LOSS_DECAY**k * per_chunk.mean()
        if metrics is not None:
            predicted = plain.draft_ids[head_logits.argmax(-1)]
            metrics.correct[k - 1] += int((predicted == target_ids).sum())
            metrics.total[k - 1] += target_ids.numel()
    if metrics is not None:
        metrics.loss_sum += loss.item()
        metrics.batches += 1
        metrics.tokens += tokens.numel()
    return loss


def feature_loader(features: Features, batch_size: int, shuffle: bool, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(features.dataset(), batch_size=batch_size, shuffle=shuffle, generator=generator)


def mixed_precision_autocast(device: torch.device, enabled: bool = True) -> torch.autocast:
    """bf16 autocast where the device computes bf16 natively (else a disabled one): the forward's
    matrix products run in bf16, the loss and the parameters stay fp32."""
    return torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=enabled and fast_feature_dtype(device) == torch.bfloat16
    )


def upcast_grad_samples(module: torch.nn.Module) -> None:
    """Cast Opacus's per-sample gradients to their parameters' dtype (a no-op outside DP and autocast).

    Under autocast they come out in bf16, and Opacus's optimizer computes the per-sample norms before
    it casts them; norms taken in bf16 can read up to ~0.4% low, so a clipped gradient could exceed
    the clip bound that the noise is calibrated to. Cast first, and the bound holds for exactly the
    values that are summed.
    """
    for parameter in module.parameters():
        sample = getattr(parameter, "grad_sample", None)
        if isinstance(sample, torch.Tensor) and sample.dtype != parameter.dtype:
            parameter.grad_sample = sample.to(parameter.dtype)


def train_epoch(
    heads: torch.nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    num_heads: int,
    desc: str = "training heads",
    show_progress: bool = True,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    deadline: float = math.inf,
) -> HeadMetrics:
    """One pass over `loader` (stopping early at `deadline`, a perf_counter time).

    `heads` may be a DraftHeads or Opacus's GradSampleModule around one; batches go to the heads'
    device. The forward runs under bf16 autocast where the device computes bf16 natively (about 1.5x
    without DP and 1.7x under DP-SGD on this 2-core CPU: the draft-vocabulary matrix products dominate).
    """
    metrics = HeadMetrics(num_heads)
    device = next(heads.parameters()).device
    autocast = mixed_precision_autocast(device)
    heads.train()
    for hidden, tokens, greedy in tqdm(loader, desc=desc, unit="batch", disable=not show_progress, leave=False):
        optimizer.zero_grad(set_to_none=True)
        if len(tokens) == 0:  # Poisson sampling can draw an empty batch; Opacus still takes a noisy step
            optimizer.step()
            continue
        with autocast:
            loss = heads_loss(heads, hidden.to(device), tokens.to(device), greedy.to(device), metrics)
        loss.backward()
        upcast_grad_samples(heads)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if time.perf_counter() > deadline:
            break
    heads.eval()
    return metrics


@torch.no_grad()
def evaluate_heads(heads: DraftHeads, features: Features, batch_size: int = 16) -> dict[str, float | list[float]]:
    """Loss and per-head top-1 accuracy against the base's greedy choices."""
    metrics = HeadMetrics(heads.num_heads)
    heads.eval()
    device = next(heads.parameters()).device
    for hidden, tokens, greedy in feature_loader(features, batch_size, shuffle=False):
        heads_loss(heads, hidden.to(device), tokens.to(device), greedy.to(device), metrics)
    return metrics.summary()


def train_heads(
    heads: DraftHeads,
    features: Features,
    epochs: int = 1,
    lr: float = 1e-3,
    batch_size: int = 16,
    seed: int = 0,
    max_seconds: float = math.inf,
    show_progress: bool = True,
) -> list[dict[str, float | list[float]]]:
    """Centralised (non-private) training with AdamW and a cosine schedule; stops at `max_seconds`."""
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    total_steps = max(1, epochs * math.ceil(len(features) / batch_size))
    warmup = min(50, total_steps // 10 + 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)),
    )
    deadline = time.perf_counter() + max_seconds
    history = []
    for epoch in range(epochs):
        loader = feature_loader(features, batch_size, shuffle=True, seed=seed + epoch)
        metrics = train_epoch(
            heads,
            loader,
            optimizer,
            heads.num_heads,
            f"epoch {epoch + 1}/{epochs}",
            show_progress,
            scheduler,
            deadline,
        )
        history.append(metrics.summary())
        if time.perf_counter() > deadline:
            break
    return history


def fit_heads(
    base: BaseModel,
    chunks: torch.Tensor,
    heldout: torch.Tensor,
    num_heads: int = 4,
    arch: str = "recurrent",
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB,
    epochs: int = 1,
    lr: float = 2e-3,
    batch_size: int = 16,
    max_seconds: float = math.inf,
    seed: int = 0,
    show_progress: bool = True,
    distill_chunks: int = 0,
    other_heldout: dict[str, torch.Tensor] | None = None,
) -> tuple[DraftHeads, dict]:
    """Fresh heads trained centrally (non-private) on public `chunks`; a report with held-out accuracy
    and the cost of each stage. The base's features are cached, and the draft vocabulary is built from
    the same public chunks (draft_vocab_size 0: the whole vocabulary).

    `distill_chunks` > 0 adds that many self-distilled chunks: the first half of a public chunk
    followed by the base's own greedy continuation (common/data/distill.py).
    `other_heldout`: more held-out sets by name, each reported as "heldout_<name>".
    """
    started = time.perf_counter()
    distilled = chunks[:0]
    if distill_chunks:
        prompts = chunks[torch.randperm(len(chunks), generator=torch.Generator().manual_seed(seed))[:distill_chunks]]
        half = chunks.shape[1] // 2
        distilled = greedy_continuations(base, prompts[:, :half], chunks.shape[1] - half, progress=show_progress)
    distill_seconds = time.perf_counter() - started
    started = time.perf_counter()
    features = base_features(base, chunks, progress=show_progress)  # its own cache entry: reused without distillation
    if len(distilled):
        features = features + base_features(base, distilled, progress=show_progress)
    heldout_features = base_features(base, heldout, progress=show_progress)
    other_features = {name: base_features(base, c, progress=show_progress) for name, c in (other_heldout or {}).items()}
    feature_seconds = time.perf_counter() - started
    draft_vocab = build_draft_vocab(base, features, draft_vocab_size) if draft_vocab_size else []
    torch.manual_seed(seed)
    heads = DraftHeads.fresh(base, num_heads, arch=arch, draft_vocab=draft_vocab)
    started = time.perf_counter()
    history = train_heads(
        heads,
        features,
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        seed=seed,
        max_seconds=max_seconds,
        show_progress=show_progress,
    )
    seconds = time.perf_counter() - started
    trained_tokens = sum(h["tokens"] for h in history)
    report = {
        "base": str(base.path),
        "arch": arch,
        "num_heads": num_heads,
        "draft_vocab": heads.config.draft_size,
        "draft_vocab_coverage_heldout": round(coverage(draft_vocab, heldout_features), 4),
        "train_chunks": len(features),
        "distill_chunks": len(distilled),
        "distill_seconds": round(distill_seconds, 1),
        "chunk_len": int(chunks.shape[1]),
        "feature_dtype": str(fast_feature_dtype(base.device)).removeprefix("torch."),
        "feature_seconds": round(feature_seconds, 1),
        "epochs_run": len(history),
        "train_seconds": round(seconds, 1),
        "train_tokens": trained_tokens,
        "train_tokens_per_s": round(trained_tokens / seconds, 1) if seconds > 0 else 0.0,
        "trainable_parameters": heads.num_trainable(),
        "train": history[-1] if history else {},
        "heldout": evaluate_heads(heads, heldout_features),
        **{f"heldout_{name}": evaluate_heads(heads, f) for name, f in other_features.items()},
    }
    return heads, report
