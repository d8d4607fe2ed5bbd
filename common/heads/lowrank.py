"""Low-rank updates (LoRA) of the heads' Linear layers, for training under DP noise.

DP-SGD adds the same noise to every trainable coordinate, so the noise's norm grows with the square
root of their number while the clipped signal does not. Training a rank-r update B A of each weight W
(B zero-initialised, so the heads start unchanged) cuts the heads' ~2M coordinates to ~2r(d_in + d_out)
per layer. After the round the update is merged into W: what leaves the device is ordinary heads, and
(being computed from the DP-trained factors only) as private as they are.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


class LowRankLinear(nn.Linear):
    """A frozen Linear plus a trainable rank-r update: y = x W^T + b + (x A^T) B^T.

    A subclass of Linear that shares its weight and bias, so code that reads `.weight` (its dtype,
    its device) sees the layer it replaced; Opacus computes per-sample gradients for `down` and `up`.
    """

    def __init__(self, linear: nn.Linear, rank: int, generator: torch.Generator) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        self.down = nn.Linear(self.in_features, rank, bias=False, **factory)
        self.up = nn.Linear(rank, self.out_features, bias=False, **factory)
        with torch.no_grad():  # LoRA's init: A ~ kaiming-uniform, B = 0
            bound = 1.0 / self.in_features**0.5
            self.down.weight.copy_(
                torch.empty(self.down.weight.shape).uniform_(-bound, bound, generator=generator).to(**factory)
            )
            self.up.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias) + self.up(self.down(x))

    def merged(self) -> nn.Linear:
        """The plain Linear with W + B A (the factors discarded)."""
        linear = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        with torch.no_grad():
            linear.weight.copy_(self.weight + self.up.weight @ self.down.weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear


def _linears(module: nn.Module, kind: type[nn.Linear]) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if type(child) is kind
    ]


@contextmanager
def low_rank_updates(module: nn.Module, rank: int, seed: int = 0) -> Iterator[list[nn.Parameter]]:
    """Within the block every Linear of `module` trains only a rank-`rank` update (the yielded
    parameters); every other parameter is frozen. On exit the updates are merged into the weights and
    the original parameters' requires_grad restored."""
    if rank < 1:
        raise ValueError(f"the rank of a low-rank update must be >= 1, got {rank}")
    trainable = {name: p.requires_grad for name, p in module.named_parameters()}
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for parent, name, child in _linears(module, nn.Linear):
        setattr(parent, name, LowRankLinear(child, rank, generator))
    try:
        yield [p for p in module.parameters() if p.requires_grad]
    finally:
        for parent, name, child in _linears(module, LowRankLinear):
            setattr(parent, name, child.merged())
        for name, parameter in module.named_parameters():
            parameter.requires_grad_(trainable.get(name, True))
