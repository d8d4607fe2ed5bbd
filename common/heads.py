"""The two small trainable parts that sit on the frozen base: a fusion head and K lookahead heads.

    h_t      base's last hidden state at position t (it already predicts x_{t+1} via the LM head)
    f_t    = Fusion([E(x_{t+1}); h_t])             EAGLE-style Linear(2d, d): condition on the token just chosen
    head k = LMHead(f_t + SiLU(W_k f_t + b_k))     Medusa-style residual block, k = 1..K, predicts x_{t+k+1}

Only the fusion and the residual blocks are parameters (2d*d + d + K*(d*d + d)); the embedding and
LM head are the base's own frozen modules, referenced but never saved, trained or sent.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from common.base import BaseModel, FedLookaheadError

WEIGHTS_FILE = "heads.safetensors"
CONFIG_FILE = "heads_config.json"


@dataclass
class HeadsConfig:
    num_heads: int
    hidden_size: int
    vocab_size: int
    base_fingerprint: str
    version: int = 0  # bumped by every federated round that produces these heads


class FusionHead(nn.Module):
    """Linear(2d, d) over [embedding of the chosen token; hidden state].

    Initialised to pass h_t through unchanged, so before training every head starts from the base's
    own next-token distribution rather than from noise.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * hidden_size, hidden_size)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.weight[:, hidden_size:].copy_(torch.eye(hidden_size))
            self.proj.bias.zero_()

    def forward(self, token_embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([token_embedding, hidden], dim=-1))


class ResBlock(nn.Module):
    """x + SiLU(W x + b) with W zero-initialised (Medusa): starts as the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class LookaheadHeads(nn.Module):
    """K residual blocks; block k maps the fused feature to a state whose LM-head logits predict x_{t+k+1}."""

    def __init__(self, num_heads: int, hidden_size: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_heads))

    def forward(self, fused: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., K, d)."""
        return torch.stack([block(fused) for block in self.blocks], dim=-2)


class DraftHeads(nn.Module):
    """Fusion + lookahead heads bound to one base model (by reference to its embedding and LM head)."""

    def __init__(self, config: HeadsConfig, base: BaseModel) -> None:
        super().__init__()
        if (config.hidden_size, config.vocab_size) != (base.hidden_size, base.vocab_size):
            raise FedLookaheadError(
                f"heads were built for hidden size {config.hidden_size} / vocab {config.vocab_size}, "
                f"base has {base.hidden_size} / {base.vocab_size}"
            )
        self.config = config
        self.fusion = FusionHead(config.hidden_size)
        self.lookahead = LookaheadHeads(config.num_heads, config.hidden_size)
        # Plain attributes, not submodules: frozen, never in state_dict, invisible to Opacus.
        object.__setattr__(self, "embed", base.model.get_input_embeddings())
        object.__setattr__(self, "lm_head", base.model.get_output_embeddings())
        self.to(device=base.device, dtype=base.dtype)

    @classmethod
    def fresh(cls, base: BaseModel, num_heads: int = 4) -> DraftHeads:
        if num_heads < 1:
            raise FedLookaheadError(f"need at least one lookahead head, got {num_heads}")
        config = HeadsConfig(num_heads, base.hidden_size, base.vocab_size, base.fingerprint)
        return cls(config, base)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def head_states(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """hidden (..., d) at t and the token chosen for t+1 (...) -> per-head states (..., K, d)."""
        dtype = self.fusion.proj.weight.dtype
        fused = self.fusion(self.embed(next_tokens).to(dtype), hidden.to(dtype))
        return self.lookahead(fused)

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Logits (..., K, V): entry k-1 predicts x_{t+k+1}."""
        states = self.head_states(hidden, next_tokens)
        return self.lm_head(states.to(self.lm_head.weight.dtype))

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, directory / WEIGHTS_FILE)
        (directory / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path, base: BaseModel) -> DraftHeads:
        """Load heads saved by `save`; refuses heads trained for another base model."""
        directory = Path(directory).expanduser()
        if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise FedLookaheadError(f"no heads in {directory} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
        config = HeadsConfig(**json.loads((directory / CONFIG_FILE).read_text()))
        if config.base_fingerprint != base.fingerprint:
            raise FedLookaheadError(
                f"heads in {directory} were trained for base {config.base_fingerprint}, "
                f"not for {base.path} ({base.fingerprint})"
            )
        heads = cls(config, base)
        heads.load_state_dict_checked(load_file(directory / WEIGHTS_FILE))
        return heads

    def load_state_dict_checked(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights after checking names and shapes, with a one-line error on any mismatch."""
        expected = self.state_dict()
        if set(state) != set(expected):
            missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            raise FedLookaheadError(f"mismatched heads: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise FedLookaheadError(
                    f"mismatched heads: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
                )
        self.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
