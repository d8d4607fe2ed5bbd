"""The device's verify cost curve c(n): what one base forward over n new tokens costs here.

Speculative decoding pays only when the tokens a tree is expected to yield beat what verifying it
costs, and that cost depends on the machine: on a GPU a 64-node tree costs about one token's step,
on a 2-core CPU it costs several. So AMS-LD does not guess: at first use per (base, device, dtype,
threads) it times the base's body over n = 1, 2, ..., 8, 12, 16, ... 64 new tokens after a KV cache
of `past` tokens, and the LM head over n rows, and caches the curve as JSON under
$FEDLA_HOME/calibration. Costs between measured sizes are interpolated linearly. Every small size is
measured because BLAS switches kernels there: in fp32 on the 2-core CPU, 3 tokens cost about what 2
do, and 4 cost 1.5x as much (a curve through 2 and 4 alone priced 3-node trees 15% too high).
"""

from __future__ import annotations

import bisect
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from common.model.attention import cache_kwarg
from common.model.base import BaseModel
from common.paths import calibration_dir

CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
CALIBRATION_PAST = 256  # cached tokens before the timed forward (a typical prompt plus some output)


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one base-body forward over n new tokens, and of the LM head over n rows."""

    sizes: tuple[int, ...]
    body_seconds: tuple[float, ...]
    lm_head_seconds: tuple[float, ...]
    key: str = ""

    def _interp(self, values: tuple[float, ...], n: float) -> float:
        sizes = self.sizes
        if n <= sizes[0]:
            return values[0] * n / sizes[0] if n < sizes[0] else values[0]
        i = bisect.bisect_left(sizes, n)
        if i == len(sizes):  # beyond the largest size: extend the last segment's slope
            i = len(sizes) - 1
        x0, x1, y0, y1 = sizes[i - 1], sizes[i], values[i - 1], values[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def body(self, n: float) -> float:
        return self._interp(self.body_seconds, n)

    def lm_head(self, rows: float) -> float:
        return self._interp(self.lm_head_seconds, rows) if rows > 0 else 0.0

    def verify(self, nodes: int, lm_rows: int) -> float:
        """One tree step: the body over `nodes` tokens and the LM head over `lm_rows` rows."""
        return self.body(nodes) + self.lm_head(lm_rows)

    def one_lm_pass(self, nodes: int, internal: int) -> bool:
        """Whether greedy verification should run the LM head once over all `nodes` rows rather than over
        the `internal` ones (those with children) and again over the accepted node's row for the bonus
        token: in fp32 on the 2-core CPU three rows cost about what one does, so two passes cost double."""
        return internal == 0 or self.lm_head(nodes) <= self.lm_head(internal) + self.lm_head(1)

    def tree_step(self, nodes: int, internal: int) -> float:
        """One greedy tree step: the body over `nodes` tokens and the LM-head passes verification runs."""
        if self.one_lm_pass(nodes, internal):
            return self.verify(nodes, nodes)
        return self.verify(nodes, internal) + self.lm_head(1)

    def relative(self) -> dict[int, float]:
        """c(n) / c(1) for a full step (body + LM head over one row), as docs/benchmarks.md shows it."""
        one = self.verify(1, 1)
        return {n: round(self.verify(n, 1) / one, 3) for n in self.sizes}

    def plausible(self) -> bool:
        """More tokens never cost less. A cached curve that says otherwise was measured on a disturbed
        machine by a version without the monotone repair, and would make every tree look unaffordable."""
        return all(
            len(values) == len(self.sizes) and all(0 < a <= b for a, b in zip(values, values[1:]))
            for values in (self.body_seconds, self.lm_head_seconds)
        )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CostCurve:
        return cls(tuple(data["sizes"]), tuple(data["body_seconds"]), tuple(data["lm_head_seconds"]), data["key"])


def calibration_key(base: BaseModel) -> str:
    """What the curve depends on: base, device, number format (and int8 kernel), attention kernel, threads and the
    torch build."""
    attention = getattr(base.model.config, "_attn_implementation", "eager")
    precision = f"int8-{base.int8_kernel.in_use}" if base.int8 else base.precision
    return (
        f"{base.fingerprint}-{base.device.type}-{precision}-{attention}-t{torch.get_num_threads()}-{torch.__version__}"
    )


def _seconds(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


@torch.inference_mode()
def measure_cost_curve(
    base: BaseModel, sizes: tuple[int, ...] = CALIBRATION_SIZES, past: int = CALIBRATION_PAST, repeats: int = 5
) -> CostCurve:
    """Time the body over n new tokens after `past` cached ones, and the LM head over n rows.

    The sizes are interleaved within each repeat and the fastest repeat is kept: other work on the
    machine only ever adds time, and interleaving spreads a burst of it over every size alike rather
    than bending the curve.
    """
    past = max(1, min(past, base.max_positions - max(sizes) - 1))
    body, lm_head = base.model.base_model, base.model.get_output_embeddings()
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, base.vocab_size, (1, past), generator=generator).to(base.device)
    cache = DynamicCache(config=base.model.config)
    cache_kw = cache_kwarg(body)
    body(input_ids=prefix, **{cache_kw: cache}, use_cache=True)
    steps, heads = [], []
    for n in sizes:
        new = torch.randint(0, base.vocab_size, (1, n), generator=generator).to(base.device)
        positions = torch.arange(past, past + n, device=base.device).view(1, -1)
        rows = torch.randn(n, base.hidden_size, generator=generator).to(base.device, base.dtype)

        def step(new: torch.Tensor = new, positions: torch.Tensor = positions, n: int = n) -> None:
            body(input_ids=new, **{cache_kw: cache}, position_ids=positions, use_cache=True)
            cache.crop(-n)  # every repeat sees the same `past` cached tokens

        steps.append(step)
        heads.append(lambda rows=rows: lm_head(rows))
    body_seconds = [math.inf] * len(sizes)
    head_seconds = [math.inf] * len(sizes)
    for repeat in range(repeats + 1):  # repeat 0 warms up allocator and kernels, and is not kept
        for i in range(len(sizes)):
            body_time, head_time = _seconds(steps[i], base.device), _seconds(heads[i], base.device)
            if repeat:
                body_seconds[i] = min(body_seconds[i], body_time)
                head_seconds[i] = min(head_seconds[i], head_time)
    # More tokens never cost less: a size that measured slower than a larger one was disturbed.
    for i in range(len(sizes) - 2, -1, -1):
        body_seconds[i] = min(body_seconds[i], body_seconds[i + 1])
        head_seconds[i] = min(head_seconds[i], head_seconds[i + 1])
    return CostCurve(tuple(sizes), tuple(body_seconds), tuple(head_seconds), calibration_key(base))


def cost_curve(base: BaseModel, directory: Path | None = None, remeasure: bool = False) -> CostCurve:
    """The cached curve for this (base, device, dtype, threads), measured on first use (a few seconds)."""
    key = calibration_key(base)
    path = (directory or calibration_dir()) / f"{key}.json"
    if path.is_file() and not remeasure:
        try:
            curve = CostCurve.from_json(json.loads(path.read_text()))
            if curve.key == key and curve.plausible():
                return curve
        except (ValueError, KeyError, TypeError):
            pass  # a damaged or implausible cache file is re-measured, not trusted
    curve = measure_cost_curve(base)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(curve.to_json(), indent=1))
    tmp.replace(path)
    return curve
