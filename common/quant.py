"""int8 base weights for CPU devices: a cheaper base step whose tree verification stays exact.

Every linear layer of the frozen base (the LM head included) keeps its weights in int8, one scale per
output channel, and quantizes its input on the fly, one scale per token (row). The product runs in
integers (`torch._int_mm`, AMX/VNNI on x86), so it is exact: a token's output row depends on that row
alone, bit for bit, whether the row is one token of plain decoding or one node of a 33-node tree. That is
what keeps AMS-LD lossless against this quantized base. A per-tensor activation scale (what the
deprecated `torch.ao.quantization.quantize_dynamic` uses) would let the tree's nodes change each other's
logits.

Smoothing (SmoothQuant, Xiao et al. 2023): a few input channels carry outlier activations, and one
scale per token spends its 8 bits on them. Each input channel j is divided by s_j = sqrt(max|x_j| /
max|W_:j|) before quantizing and its weight column multiplied by s_j, which leaves the product unchanged
and moves the outliers' range into the weights. max|x_j| comes from 16 public chunks of 128 tokens (the
stdlib training split) run through the float model. On the embedded base this cut the held-out loss
cost from 0.052 to 0.008 nats (greedy choice as fp32's at 92.5% of positions, against 88.1%).

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
from transformers import AttentionInterface, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.pytorch_utils import Conv1D

INT8_MAX = 127
SMOOTH_FLOOR = 1e-5  # keeps smoothing factors finite for channels that are (nearly) zero
CALIBRATION_CHUNKS, CALIBRATION_CHUNK_LEN = 16, 128


class Int8DynamicLinear(nn.Module):
    """y = x W^T + b with W in int8 (per output channel) and x quantized per row at run time, after the
    input channels are divided by `smooth` (and W's columns multiplied by it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, smooth: torch.Tensor | None = None) -> None:
        super().__init__()
        smooth = torch.ones(weight.shape[1]) if smooth is None else smooth.detach().float()
        weight = weight.detach().float() * smooth  # (out, in)
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.register_buffer("inv_smooth", 1 / smooth)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def of(cls, layer: nn.Linear | Conv1D, input_absmax: torch.Tensor | None = None) -> Int8DynamicLinear:
        """The int8 twin of a float layer, smoothed for inputs whose channels reach `input_absmax`."""
        weight = layer.weight.t() if isinstance(layer, Conv1D) else layer.weight  # GPT-2's Conv1D stores (in, out)
        smooth = None
        if input_absmax is not None:
            weight_absmax = weight.detach().float().abs().amax(dim=0).clamp(min=SMOOTH_FLOOR)
            smooth = (input_absmax.clamp(min=SMOOTH_FLOOR) / weight_absmax).sqrt().clamp(min=SMOOTH_FLOOR)
        return cls(weight, layer.bias, smooth)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weights (out, in), for readers of `lm_head.weight` (the heads' draft rows)."""
        return self.qweight.float() * self.scale[:, None] * self.inv_smooth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float() * self.inv_smooth
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


def quantize_int8(model: PreTrainedModel, calibration: torch.Tensor | None = None) -> PreTrainedModel:
    """Replace every linear layer of a causal LM (nn.Linear, GPT-2's Conv1D, the LM head) in place and
    switch its attention to `exact_attention`. With `calibration` token chunks (n, length), each layer
    is smoothed for the inputs the float model gives it there.

    The input embedding stays in floating point; a tied LM head gets its own int8 copy.
    """
    layers = {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))}
    absmax = {} if calibration is None else input_absmax(model, layers, calibration)
    for full, layer in layers.items():
        parent, _, name = full.rpartition(".")
        setattr(model.get_submodule(parent), name, Int8DynamicLinear.of(layer, absmax.get(full)))
    model.config.tie_word_embeddings = False  # saving or resizing must not re-tie to the int8 head
    model.set_attn_implementation(EXACT_ATTENTION)
    return model


@torch.inference_mode()
def input_absmax(model: nn.Module, layers: dict[str, nn.Module], chunks: torch.Tensor) -> dict[str, torch.Tensor]:
    """Largest |input| per channel of each named layer over the chunks (forward pre-hooks)."""
    absmax: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float()
            absmax[name] = torch.maximum(absmax[name], x) if name in absmax else x

        return hook

    hooks = [layer.register_forward_pre_hook(record(name)) for name, layer in layers.items()]
    try:
        for chunk in chunks:
            model(input_ids=chunk.view(1, -1).to(model.device))
    finally:
        for hook in hooks:
            hook.remove()
    return absmax


def public_calibration(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """The smoothing's calibration text: 16 chunks of 128 tokens of public code (stdlib training split)."""
    from common.data import chunk_files, stdlib_files  # here: common.data imports common.base, which imports us

    files = [f for f in stdlib_files("train") if f.stat().st_size > 4096]  # long enough: no skip warnings
    chunks = torch.empty(0, CALIBRATION_CHUNK_LEN, dtype=torch.long)
    for start in range(0, len(files), 16):  # tokenize only as many files as the chunks need
        chunks = torch.cat([chunks, chunk_files(files[start : start + 16], tokenizer, CALIBRATION_CHUNK_LEN)])
        if len(chunks) >= CALIBRATION_CHUNKS:
            break
    return chunks[:CALIBRATION_CHUNKS]
