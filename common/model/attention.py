"""Attention for verifying trees on a CPU: SDPA that lets each key/value head serve its query heads.

Under a mask (every tree forward has one), transformers' `sdpa` copies the keys and values once per query
head (`repeat_kv`) unless the device is XPU or MPS, because CUDA's fast kernels refuse grouped heads with
a mask. PyTorch's CPU kernel takes them (`enable_gqa`), so on a CPU the copy is pure cost: on the embedded
base (9 query heads over 3 key/value heads) it was most of what a 4-node tree's attention cost beyond a
single token's.

`exact_attention` is the same in float64, rounded back: the int8 base needs it (see common.model.quant).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask


def cache_kwarg(module: torch.nn.Module) -> str:
    """The keyword that passes a KV cache to `module.forward`: `cache` in newer transformers, which
    deprecates `past_key_values`."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


GQA_ATTENTION = "fedla_sdpa"
EXACT_ATTENTION = "fedla_exact"


def gqa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa` attention with grouped key/value heads passed to the kernel as they are."""
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    q_length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q_length > 1 and attention_mask is None and causal  # transformers' rule: a mask says it all
    if causal and key.shape[2] > q_length:  # prefill into an empty static cache (transformers' sdpa does this too)
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def exact_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`gqa_attention` run in float64, its output rounded back to the input's dtype."""
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.double()
    out, _ = gqa_attention(module, query.double(), key.double(), value.double(), attention_mask, **kwargs)
    return out.to(query.dtype), None


for _name, _function in ((GQA_ATTENTION, gqa_attention), (EXACT_ATTENTION, exact_attention)):
    AttentionInterface.register(_name, _function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_name, sdpa_mask)
