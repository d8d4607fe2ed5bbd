"""The EAGLE drafter's one causal decoder layer, and the context cache it attends over while decoding.

EAGLE drafts with the fusion head followed by one decoder layer shaped like the base's own (hidden
size, attention and key/value heads, MLP width, rotary base), run autoregressively on its own
predicted features. Row t of the layer reads f_t = Fusion([E(x_{t+1}); h_t]) and its output s_t
approximates h_{t+1}, from which the draft LM head predicts x_{t+2}.

Two kinds of rows, one attention rule:

* **real** rows have the base's true h_t and a chosen x_{t+1}. While decoding they are committed to a
  key/value cache once and reused by every later draft; in training, step 1 over a whole chunk is real
  rows under a causal mask.
* **speculative** rows (lookahead step k >= 2) read a predicted feature instead of h_t. Each attends
  every visible real row plus its own path of speculative ancestors, and itself. In training, that is
  EAGLE-3's "training-time test": at step k, row t sees real rows <= t and its own steps 2..k, which
  is exactly what the tree drafter sees when it drafts depth k, so the heads train on what they will
  meet while decoding.

The layer is built from nn.Linear and nn.RMSNorm only (rotary embedding and attention have no
parameters), the modules Opacus computes per-sample gradients for, so it trains under DP-SGD.
Its output projections start at zero: untrained, the layer is the identity and the drafter
reproduces the base's next-token distribution, as the other head architectures do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

GEOMETRY_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "rope_theta")


def layer_geometry(config: PretrainedConfig) -> dict[str, float]:
    """The base's layer shape, read from its HF config (GPT-2, Llama and Qwen2 names all work)."""
    heads = int(config.num_attention_heads)
    rope = getattr(config, "rope_parameters", None) or {}
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "intermediate_size": int(
            getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size
        ),
        "rope_theta": float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0),
    }


def layer_shapes(hidden_size: int, geometry: dict[str, float]) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of DecoderLayer (relative to the layer), without building it."""
    d, heads, kv_heads = hidden_size, int(geometry["num_attention_heads"]), int(geometry["num_key_value_heads"])
    kv, ffn = d // heads * kv_heads, int(geometry["intermediate_size"])
    return {
        "attn_norm.weight": (d,),
        "q_proj.weight": (d, d),
        "k_proj.weight": (kv, d),
        "v_proj.weight": (kv, d),
        "o_proj.weight": (d, d),
        "mlp_norm.weight": (d,),
        "gate_proj.weight": (ffn, d),
        "up_proj.weight": (ffn, d),
        "down_proj.weight": (d, ffn),
    }


@dataclass
class ContextCache:
    """Keys and values (1, C, kv_heads, head_dim) of the committed real rows of one generation."""

    keys: torch.Tensor
    values: torch.Tensor


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP (the Llama layer), with the two row kinds of the module docstring.

    `geometry` is checked where the heads' config is (common.heads.lookahead.HeadsConfig.validate)."""

    def __init__(self, hidden_size: int, geometry: dict[str, float]) -> None:
        super().__init__()
        heads, kv_heads = int(geometry["num_attention_heads"]), int(geometry["num_key_value_heads"])
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden_size // heads
        ffn = int(geometry["intermediate_size"])
        self.attn_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.gate_proj = nn.Linear(hidden_size, ffn, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden_size, bias=False)
        nn.init.zeros_(self.o_proj.weight)  # the identity until trained
        nn.init.zeros_(self.down_proj.weight)
        self.rope_theta = float(geometry["rope_theta"])  # not a buffer: module.to(bf16) would round it

    def empty_cache(self) -> ContextCache:
        weight = self.k_proj.weight
        empty = weight.new_zeros(1, 0, self.kv_heads, self.head_dim)
        return ContextCache(empty, empty)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x (..., T, heads, head_dim) at integer positions (..., T)."""
        exponents = torch.arange(0, self.head_dim, 2, device=x.device).float() / self.head_dim
        angles = positions.unsqueeze(-1).float() / self.rope_theta**exponents  # (..., T, head_dim / 2)
        cos = torch.cat([angles.cos(), angles.cos()], -1).unsqueeze(-2).to(x.dtype)
        sin = torch.cat([angles.sin(), angles.sin()], -1).unsqueeze(-2).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _norm(self, norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm in its weight's dtype (under bf16 autocast x arrives in bf16, and the mix is a slow path)."""
        return norm(x.to(norm.weight.dtype))

    def _project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        normed = self._norm(self.attn_norm, x)
        shape = x.shape[:-1]
        q = self.q_proj(normed).view(*shape, self.heads, self.head_dim)
        k = self.k_proj(normed).view(*shape, self.kv_heads, self.head_dim)
        v = self.v_proj(normed).view(*shape, self.kv_heads, self.head_dim)
        return self._rotate(q, positions), self._rotate(k, positions), v

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.o_proj(attended.flatten(-2))
        normed = self._norm(self.mlp_norm, x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(normed)) * self.up_proj(normed))

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        visible: torch.Tensor | None,
        path_keys: torch.Tensor | None = None,
        path_values: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (B, T, H, hd) over shared keys (B, S, kvH, hd) where `visible` (T, S) allows (None: all), plus
        each row's own path keys (B, T, P, kvH, hd). One softmax over both."""
        group = self.heads // self.kv_heads
        scale = 1.0 / math.sqrt(self.head_dim)
        keys, values = keys.repeat_interleave(group, 2), values.repeat_interleave(group, 2)
        scores = torch.einsum("bthd,bshd->bhts", q, keys) * scale
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        if path_keys is not None:
            path_keys, path_values = path_keys.repeat_interleave(group, 3), path_values.repeat_interleave(group, 3)
            scores = torch.cat([scores, torch.einsum("bthd,btphd->bhtp", q, path_keys) * scale], dim=-1)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        shared = keys.shape[1]
        out = torch.einsum("bhts,bshd->bthd", probs[..., :shared], values)
        if path_keys is not None:
            out = out + torch.einsum("bhtp,btphd->bthd", probs[..., shared:], path_values)
        return out

    def real(
        self, x: torch.Tensor, past_keys: torch.Tensor | None = None, past_values: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Real rows x (B, T, d) after `past` rows: causal attention. Returns (output, keys, values) of all
        rows, past included (the cache after committing these)."""
        past = 0 if past_keys is None else past_keys.shape[1]
        length = x.shape[1]
        positions = torch.arange(past, past + length, device=x.device)
        q, k, v = self._project(x, positions)
        if past_keys is not None:
            k, v = torch.cat([past_keys, k], dim=1), torch.cat([past_values, v], dim=1)
        rows = torch.arange(length, device=x.device).view(-1, 1) + past
        visible = torch.arange(past + length, device=x.device).view(1, -1) <= rows
        return self._finish(x, self._attend(q, k, v, visible)), k, v

    def speculative(
        self,
        x: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        visible: torch.Tensor | None,
        path_keys: torch.Tensor | None,
        path_values: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Speculative rows x (B, T, d): each sees the real `keys` it may (`visible` (T, S), None: all) and its
        own path (B, T, P, kvH, hd), itself appended. Returns (output, path keys, path values) with this
        step added. A row's position is one past its last visible real row plus its path."""
        depth = 0 if path_keys is None else path_keys.shape[2]
        if visible is None:
            positions = torch.full(x.shape[:-1], keys.shape[1] + depth, device=x.device)
        else:
            positions = (visible.sum(-1) + depth).expand(x.shape[:-1])
        q, k, v = self._project(x, positions)
        if path_keys is None:
            path_keys, path_values = k.unsqueeze(2), v.unsqueeze(2)
        else:
            path_keys, path_values = (
                torch.cat([path_keys, k.unsqueeze(2)], 2),
                torch.cat([path_values, v.unsqueeze(2)], 2),
            )
        return self._finish(x, self._attend(q, keys, values, visible, path_keys, path_values)), path_keys, path_values
