"""int8 base weights for CPU devices: a cheaper base step whose tree verification stays exact.

Every linear layer of the frozen base (the LM head included) keeps its weights in int8, one scale per
output channel, and quantizes its input on the fly, one scale per token (row). The product runs in
integers (the kernel measured fastest among those checked exact on this CPU: common.model.int8_kernels), so it
is exact: a token's output row depends on that row alone, bit for bit,
whether the row is one token of plain decoding or one node of a 33-node tree. That is what keeps AMS-LD
lossless against this quantized base. A per-tensor activation scale (what the deprecated
`torch.ao.quantization.quantize_dynamic` uses) would let the tree's nodes change each other's logits.

Layers that read the same input (q/k/v, gate/up) become slices of one fused int8 layer, found by tracing
which tensor each layer reads: one quantization and one product instead of three or two. With oneDNN
and the fused layers, and with grouped key/value heads left to the attention kernel (common.model.attention),
a one-token step of the embedded base went from 41 to 38 ms and a 4-node tree from 55 to 45 ms (2 threads).

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
forwards cost 3x a one-token forward after 11 minutes of compilation.
"""

from __future__ import annotations

import pickle
import weakref
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.pytorch_utils import Conv1D

from common.model.attention import EXACT_ATTENTION
from common.model.int8_kernels import (
    INT8_MAX,
    INT_MM,
    KERNELS,
    Int8Kernel,
    KernelReport,
    kernel_in_use,
    kernel_report,
    record_one_token,
)
from common.paths import calibration_dir

SMOOTH_FLOOR = 1e-5  # keeps smoothing factors finite for channels that are (nearly) zero
CALIBRATION_CHUNKS, CALIBRATION_CHUNK_LEN = 16, 128


class Int8DynamicLinear(nn.Module):
    """y = x W^T + b with W in int8 (per output channel) and x quantized per row at run time, after the
    input channels are divided by `smooth` (and W's columns multiplied by it)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        smooth: torch.Tensor | None = None,
        kernel: Int8Kernel = INT_MM,
    ) -> None:
        super().__init__()
        smooth = torch.ones(weight.shape[1]) if smooth is None else smooth.detach().float()
        weight = weight.detach().float() * smooth  # (out, in)
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
        qweight = torch.round(weight / scale[:, None]).to(torch.int8)
        self.kernel = kernel
        self.packed = kernel.pack(qweight)  # not a buffer: oneDNN's prepacked tensor is opaque, with no state_dict
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.register_buffer("inv_smooth", 1 / smooth)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.readers = 1  # how many layers read each input: several when Int8Slices share this layer
        self._shared: list | None = None  # [weak reference to the input, its output, reads left]

    @classmethod
    def of(
        cls, layers: list[nn.Linear | Conv1D], input_absmax: torch.Tensor | None = None, kernel: Int8Kernel = INT_MM
    ) -> Int8DynamicLinear:
        """The int8 twin of float layers that read the same input, their outputs side by side, smoothed for
        inputs whose channels reach `input_absmax`, multiplied by `kernel`."""
        weight = torch.cat([_float_weight(layer) for layer in layers])
        bias = None
        if any(layer.bias is not None for layer in layers):
            bias = torch.cat([_float_bias(layer) for layer in layers])
        smooth = None
        if input_absmax is not None:
            weight_absmax = weight.abs().amax(dim=0).clamp(min=SMOOTH_FLOOR)
            smooth = (input_absmax.clamp(min=SMOOTH_FLOOR) / weight_absmax).sqrt().clamp(min=SMOOTH_FLOOR)
        return cls(weight, bias, smooth, kernel)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weights (out, in), for readers of `lm_head.weight` (the heads' draft rows)."""
        return self.kernel.unpack(self.packed).float() * self.scale[:, None] * self.inv_smooth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float() * self.inv_smooth
        row_scale = torch.linalg.vector_norm(rows, ord=float("inf"), dim=1, keepdim=True)  # max |x| per row
        row_scale = row_scale.clamp_(min=torch.finfo(torch.float32).tiny).div_(INT8_MAX)
        quantized = torch.round(rows.div_(row_scale)).to(torch.int8)  # |rows / row_scale| <= 127 by construction
        out = self.kernel.multiply(quantized, self.packed, self.scale).mul_(row_scale)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x), computed once for the layers that read this very tensor (q/k/v, gate/up) in turn."""
        if self._shared is None or self._shared[0]() is not x:
            self._shared = [weakref.ref(x), self(x), self.readers]
        entry = self._shared
        entry[2] -= 1
        if entry[2] == 0:  # the last reader: keep no activations alive (a long prompt's are large)
            self._shared = None
        return entry[1]


class Int8Slice(nn.Module):
    """One of the layers that read the same input (q/k/v, gate/up): its columns of their fused int8 layer,
    which quantizes that input and multiplies it once for all of them (fewer, larger products: on a CPU
    a one-token step is bound by per-op overhead as much as by the weights)."""

    def __init__(self, fused: Int8DynamicLinear, start: int, end: int) -> None:
        super().__init__()
        self.fused, self.start, self.end = fused, start, end
        self.in_features, self.out_features = fused.in_features, end - start

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.weight[self.start : self.end]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.shared(x)[..., self.start : self.end]


def _float_weight(layer: nn.Linear | Conv1D) -> torch.Tensor:
    """A layer's weights as (out, in) float32 (GPT-2's Conv1D stores (in, out))."""
    weight = layer.weight.t() if isinstance(layer, Conv1D) else layer.weight
    return weight.detach().float()


def _out_in(layer: nn.Linear | Conv1D) -> tuple[int, int]:
    """A layer's (output, input) sizes, read from its weight's shape without copying it."""
    out_features, in_features = layer.weight.shape
    return (in_features, out_features) if isinstance(layer, Conv1D) else (out_features, in_features)


def _float_bias(layer: nn.Linear | Conv1D) -> torch.Tensor:
    """A layer's bias as float32, zeros where it has none (for a fused layer whose others have one)."""
    if layer.bias is None:
        return torch.zeros(_out_in(layer)[0])
    return layer.bias.detach().float()


@dataclass(frozen=True)
class Int8Calibration:
    """What quantizing learns from forwards of the float model: its linear layers grouped by the input
    tensor they read, and the largest |input| per channel of each (None: no smoothing)."""

    groups: list[list[str]]
    absmax: dict[str, torch.Tensor] | None = None

    def fits(self, layers: dict[str, nn.Module]) -> bool:
        """Whether it names exactly these layers (a cached one may come from another model or version)."""
        names = [name for group in self.groups for name in group]
        if sorted(names) != sorted(layers):
            return False
        return self.absmax is None or all(
            name in self.absmax and self.absmax[name].shape == (_out_in(layer)[1],) for name, layer in layers.items()
        )


def linear_layers(model: nn.Module) -> dict[str, nn.Linear | Conv1D]:
    """Every linear layer of a causal LM by name (nn.Linear, GPT-2's Conv1D, the LM head)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))}


def calibrate_int8(model: PreTrainedModel, chunks: torch.Tensor | None = None) -> Int8Calibration:
    """The layer groups and, with token `chunks` (n, length), the inputs' channel maxima for smoothing.
    Without chunks one 8-token forward finds the groups."""
    absmax, groups = trace_inputs(model, linear_layers(model), torch.arange(8).view(1, 8) if chunks is None else chunks)
    return Int8Calibration(groups, None if chunks is None else absmax)


def public_int8_calibration(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, fingerprint: str
) -> Int8Calibration:
    """`calibrate_int8` on `public_calibration`'s text, cached under $FEDLA_HOME/calibration by the base's
    fingerprint: its 2,048 tokens of float forwards took most of an int8 load's 6 s on the 2-core CPU."""
    key = f"{fingerprint}-{CALIBRATION_CHUNKS}x{CALIBRATION_CHUNK_LEN}-transformers{transformers.__version__}"
    path = calibration_dir() / f"int8-{key}.pt"
    try:
        data = torch.load(path, weights_only=True)
        cached = Int8Calibration(data["groups"], data["absmax"])
        if cached.fits(linear_layers(model)):
            return cached
    except (OSError, RuntimeError, KeyError, TypeError, ValueError, pickle.UnpicklingError):
        pass  # none yet, or damaged: measured again
    calibration = calibrate_int8(model, public_calibration(tokenizer))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"groups": calibration.groups, "absmax": calibration.absmax}, tmp)
    tmp.replace(path)
    return calibration


def quantize_int8(
    model: PreTrainedModel, calibration: Int8Calibration | None = None, kernel: Int8Kernel = INT_MM
) -> PreTrainedModel:
    """Replace every linear layer of a causal LM (nn.Linear, GPT-2's Conv1D, the LM head) in place and
    switch its attention to `exact_attention`. Layers that read the same input tensor share one fused
    int8 layer; with the calibration's channel maxima each is smoothed (see `calibrate_int8`). `kernel`
    runs the products (`_int_mm` by default; `quantize_base_int8` measures which is fastest here).

    The input embedding stays in floating point; a tied LM head gets its own int8 copy.
    """
    layers = linear_layers(model)
    calibration = calibration or calibrate_int8(model)
    for group in calibration.groups:
        absmax = None if calibration.absmax is None else calibration.absmax[group[0]]
        fused = Int8DynamicLinear.of([layers[name] for name in group], absmax, kernel)
        fused.readers, start = len(group), 0
        for name in group:
            end = start + _out_in(layers[name])[0]
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, fused if len(group) == 1 else Int8Slice(fused, start, end))
            start = end
    model.config.tie_word_embeddings = False  # saving or resizing must not re-tie to the int8 head
    model.set_attn_implementation(EXACT_ATTENTION)
    return model


def product_shapes(model: nn.Module, calibration: Int8Calibration) -> list[tuple[int, int]]:
    """(out, in) of every integer product a step of the quantized model runs: one per fused group."""
    layers = linear_layers(model)
    return [
        (sum(_out_in(layers[name])[0] for name in group), _out_in(layers[group[0]])[1]) for group in calibration.groups
    ]


def quantize_base_int8(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, fingerprint: str) -> KernelReport:
    """What `load_base(int8=True)` does: calibrate on public text (cached), pick the int8 kernel by
    measurement on this CPU (cached; $FEDLA_INT8_KERNEL forces one), quantize in place. Returns the kernel
    report, with the kernel in use."""
    calibration = public_int8_calibration(model, tokenizer, fingerprint)
    report = kernel_in_use(kernel_report(model, product_shapes(model, calibration)))
    quantize_int8(model, calibration, KERNELS[report.in_use])
    record_one_token(report, model)
    return report


@torch.inference_mode()
def trace_inputs(
    model: nn.Module, layers: dict[str, nn.Module], chunks: torch.Tensor
) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """Run the chunks through the float model (forward pre-hooks): the largest |input| per channel of each
    named layer, and the layers grouped by the input tensor they read (q/k/v read one, gate/up another),
    each layer in one group, in the order of first use."""
    absmax: dict[str, torch.Tensor] = {}
    inputs_seen: list[tuple[torch.Tensor, list[str]]] = []  # the first chunk's inputs, and who read each

    def record(name: str):
        def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0]
            channel_max = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            absmax[name] = torch.maximum(absmax[name], channel_max) if name in absmax else channel_max
            if tracing:
                readers = next((names for seen, names in inputs_seen if seen is x), None)
                if readers is None:
                    inputs_seen.append((x, [name]))
                elif name not in readers:
                    readers.append(name)

        return hook

    hooks = [layer.register_forward_pre_hook(record(name)) for name, layer in layers.items()]
    try:
        for index, chunk in enumerate(chunks):
            tracing = index == 0
            model(input_ids=chunk.view(1, -1).to(model.device))
    finally:
        for hook in hooks:
            hook.remove()
    groups: list[list[str]] = []
    grouped: set[str] = set()
    for _, names in inputs_seen:  # a layer read twice (shared weights) stays in its first group
        if names := [name for name in names if name not in grouped]:
            groups.append(names)
            grouped.update(names)
    return absmax, groups + [[name] for name in layers if name not in grouped]  # layers the forward never ran


def public_calibration(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """The smoothing's calibration text: 16 chunks of 128 tokens of public code (stdlib training split)."""
    from common.data.chunks import (  # here: common.data.chunks imports common.model.base, which imports us
        first_chunks,
        stdlib_files,
    )

    files = [f for f in stdlib_files("train") if f.stat().st_size > 4096]  # long enough: no skip warnings
    return first_chunks(files, tokenizer, CALIBRATION_CHUNK_LEN, CALIBRATION_CHUNKS, 16)[:CALIBRATION_CHUNKS]
