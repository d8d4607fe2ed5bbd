"""int8 base weights for CPU devices: a cheaper base step whose tree verification stays exact.

Every linear layer of the frozen base (the LM head included) keeps its weights in int8, one scale per
output channel, and quantizes its input on the fly, one scale per token (row). The product runs in
integers (`torch._int_mm`, AMX/VNNI on x86), so it is exact: a token's output row depends on that row
alone, bit for bit, whether the row is one token of plain decoding or one node of a 33-node tree. That is
what keeps AMS-LD lossless against this quantized base. A per-tensor activation scale (what the
deprecated `torch.ao.quantization.quantize_dynamic` uses) would let the tree's nodes change each other's
logits.

The integer products alone are not enough: attention still sums in floating point, and a tree node's
keys lie at other places than in plain decoding, so its sums round differently in the last bit. A
last-bit change that crosses a rounding boundary of the next layer's int8 quantization grows to a
logit change of 0.1-1 (transformers' own prompt lookup then disagrees with its greedy `generate` on
this base). So the int8 base attends in float64 and rounds the result back (`exact_attention`): the order of
the sums then changes only bits that rounding to float32 drops (unless a value lies within about 1e-16
of a float32 rounding boundary), and every row comes out as in plain decoding.

Why not torchao's `Int8DynamicActivationInt8WeightConfig`, which computes the same arithmetic: on the
2-core CPU we measured it eager at 113 ms per token (fp32: 49 ms), and under `torch.compile` its tree
forwards cost 3x a one-token forward after 11 minutes of compilation. Passing `_int_mm` the weight as
the transposed view of an (out, in) matrix, as here, halved its time against an (in, out) one.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.pytorch_utils import Conv1D

INT8_MAX = 127


class Int8DynamicLinear(nn.Module):
    """y = x W^T + b with W in int8 (per output channel) and x quantized per row at run time."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()  # (out, in)
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def of(cls, layer: nn.Linear | Conv1D) -> Int8DynamicLinear:
        if isinstance(layer, Conv1D):  # GPT-2's linear layers store (in, out)
            return cls(layer.weight.t(), layer.bias)
        return cls(layer.weight, layer.bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weights (out, in), for readers of `lm_head.weight` (the heads' draft rows)."""
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny) / INT8_MAX
        quantized = torch.round(rows / row_scale).to(torch.int8)  # |rows / row_scale| <= 127 by construction
        out = torch._int_mm(quantized, self.qweight.t()).float().mul_(row_scale).mul_(self.scale)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


EXACT_ATTENTION = "fedla_exact"


def exact_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention run in float64, its output rounded back to the input's dtype."""
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.double()
    out, weights = sdpa_attention_forward(
        module, query.double(), key.double(), value.double(), attention_mask, **kwargs
    )
    return out.to(query.dtype), weights


AttentionInterface.register(EXACT_ATTENTION, exact_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(EXACT_ATTENTION, sdpa_mask)


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Replace every linear layer of a causal LM (nn.Linear, GPT-2's Conv1D, the LM head) in place and
    switch its attention to `exact_attention`.

    The input embedding stays in floating point; a tied LM head gets its own int8 copy.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (nn.Linear, Conv1D)):
                setattr(parent, name, Int8DynamicLinear.of(child))
    model.config.tie_word_embeddings = False  # saving or resizing must not re-tie to the int8 head
    model.set_attn_implementation(EXACT_ATTENTION)
    return model
