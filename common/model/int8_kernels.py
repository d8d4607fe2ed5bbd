"""Which integer product runs the int8 base on this CPU: checked exact and timed once per machine.

torch offers two int8 matrix products with int32 sums on x86 CPUs, and which one is fast, or even
exact, depends on the CPU:
- `onednn`: oneDNN's int8 linear on weights prepacked at load. On the 2-core AMX CPU it took 11.2 ms
  against 14.2 over the embedded base's fused layers, and 0.73 against 1.87 ms on its LM head. On an
  AVX-512 VNNI CPU without AMX it was 80x slower than `_int_mm` at one row. On an AVX2 CPU (no VNNI) it
  is not exact: its u8 x s8 pair sums saturate 16 bits, and a layer's sums were off by up to 1.6e5.
- `int_mm`: `torch._int_mm` on the transposed view of the (out, in) int8 matrix.

So at the first int8 load of a base on a machine, every kernel that runs here is checked bit-exact
against int64 sums, on operands of +-127 (which saturate a 16-bit pair sum) at each of the base's
layer shapes, at 1 and 17 rows (one token; a 16-node tree and its root). The exact ones are timed over
all of the base's layers at both row counts (fresh weights per layer, as a decoding step reads them),
and the fastest over both wins. One-token steps of the base in fp32 and in int8 are timed too, so a
command can say when int8 does not pay here. The report is cached under $FEDLA_HOME/calibration,
keyed by CPU model and ISA flags, torch version, threads and the layer shapes; a damaged or foreign
cache file is measured again. $FEDLA_INT8_KERNEL forces a kernel (for tests and benchmarks): one that
is not exact here is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from common.errors import FedLookaheadError
from common.model.attention import cache_kwarg
from common.paths import calibration_dir

INT8_MAX = 127
KERNEL_ENV = "FEDLA_INT8_KERNEL"  # a kernel's name forces it; unset, "" or "auto": the fastest exact one
CHECK_ROWS = (1, 17)
TIMING_REPEATS = 10
ONE_TOKEN_PAST = 256  # cached tokens before the timed step, as the cost curve (float64 attention grows with them)
# The vector-ISA flags that decide which int8 code oneDNN and torch run (from /proc/cpuinfo).
INT8_FLAGS = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


@dataclass(frozen=True)
class Int8Kernel:
    """An integer matrix product. `pack` turns int8 weights (out, in) into what `multiply` reads;
    `multiply(rows, packed, scale)` is float32 (n, out): the int32 sums of int8 `rows` (n, in) with
    the weights, times `scale` per output channel; `unpack` gives the int8 weights back."""

    name: str
    runs: Callable[[], bool]
    pack: Callable[[torch.Tensor], Any]
    multiply: Callable[[torch.Tensor, Any, torch.Tensor], torch.Tensor]
    unpack: Callable[[Any], torch.Tensor]


def _onednn_runs() -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return False
    try:
        weight = torch.ones(8, 16, dtype=torch.int8)
        _onednn_multiply(torch.ones(1, 16, dtype=torch.int8), _onednn_pack(weight), torch.ones(8))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _onednn_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The zero points (all 0: symmetric weights) ride along: oneDNN wants them as a tensor every call.
    return torch.ops.onednn.qlinear_prepack(weight, None), torch.zeros(len(weight), dtype=torch.long)


def _onednn_multiply(
    rows: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], scale: torch.Tensor
) -> torch.Tensor:
    weight, zero_points = packed
    return torch.ops.onednn.qlinear_pointwise(
        rows, 1.0, 0, weight, scale, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )


ONEDNN = Int8Kernel(
    "onednn",
    runs=_onednn_runs,
    pack=_onednn_pack,
    multiply=_onednn_multiply,
    unpack=lambda packed: packed[0].to_dense().t(),
)
# _int_mm reads the transposed view of an (out, in) matrix in half the time of an (in, out) one.
INT_MM = Int8Kernel(
    "int_mm",
    runs=lambda: True,
    pack=lambda weight: weight,
    multiply=lambda rows, weight, scale: torch._int_mm(rows, weight.t()).float().mul_(scale),
    unpack=lambda weight: weight,
)
KERNELS = {kernel.name: kernel for kernel in (ONEDNN, INT_MM)}


def cpu_info() -> dict:
    """This CPU's model name and which of the int8-relevant ISA flags it has."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            elif name.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass  # not Linux: the model from platform, no flags
    return {"model": model, "flags": [flag for flag in INT8_FLAGS if flag in flags]}


def describe_cpu(cpu: dict) -> str:
    """'<model> (<flags>)' for one-line messages."""
    return f"{cpu['model']} ({', '.join(cpu['flags']) or 'no AVX2'})"


def _saturating(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """Random +-127, with the first row all +127: every u8 x s8 pair sum at the largest it can be."""
    values = (torch.randint(0, 2, shape, generator=generator) * (2 * INT8_MAX) - INT8_MAX).to(torch.int8)
    values[0] = INT8_MAX
    return values


def saturating_cases(shapes: Iterable[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(int8 weights, int8 rows, their exact int64 sums) with saturating operands, at each distinct (out, in)
    shape and each of CHECK_ROWS: computed once, and every kernel is checked against them."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for out_features, in_features in sorted(set(shapes)):
        weight = _saturating((out_features, in_features), generator)
        for rows in CHECK_ROWS:
            x = _saturating((rows, in_features), generator)
            cases.append((weight, x, x.long() @ weight.long().t()))
    return cases


def largest_error(kernel: Int8Kernel, cases: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> int:
    """The largest |difference| between the kernel's sums and the exact ones of `saturating_cases` (0: exact)."""
    worst, packed, packed_weight = 0, None, None
    for weight, x, want in cases:
        if weight is not packed_weight:  # the cases of one shape share their weights: packed once
            packed, packed_weight = kernel.pack(weight), weight
        got = kernel.multiply(x, packed, torch.ones(len(weight)))
        if not torch.equal(got, want.float()):
            worst = max(worst, max(1, int((got.double() - want.double()).abs().max())))
    return worst


def product_passes(kernel: Int8Kernel, shapes: list[tuple[int, int]]) -> dict[int, Callable[[], float]]:
    """For each of CHECK_ROWS, a function that runs the kernel once over every layer shape at that many rows,
    each layer with its own weights (read cold, as a decoding step reads them), and returns the seconds."""
    generator = torch.Generator().manual_seed(1)
    layers = []
    for out_features, in_features in shapes:
        weight = torch.randint(-INT8_MAX, INT8_MAX + 1, (out_features, in_features), generator=generator)
        layers.append((kernel.pack(weight.to(torch.int8)), torch.ones(out_features), in_features))

    def timed(rows: int) -> Callable[[], float]:
        inputs = [
            torch.randint(-INT8_MAX, INT8_MAX + 1, (rows, n), generator=generator).to(torch.int8) for *_, n in layers
        ]

        def one_pass() -> float:
            started = time.perf_counter()
            for x, (packed, scale, _) in zip(inputs, layers):
                kernel.multiply(x, packed, scale)
            return time.perf_counter() - started

        return one_pass

    return {rows: timed(rows) for rows in CHECK_ROWS}


@torch.inference_mode()
def one_token_seconds(model: PreTrainedModel, past: int = ONE_TOKEN_PAST) -> float:
    """One decoding step of the whole model (body and LM head, one new token after `past` cached ones):
    the fastest of TIMING_REPEATS after a warm-up."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, past + 1), generator=generator)
    cache = DynamicCache(config=model.config)
    keyword = cache_kwarg(model)
    model(input_ids=ids[:, :past], **{keyword: cache}, use_cache=True)
    positions = torch.tensor([[past]])
    best = math.inf
    for repeat in range(TIMING_REPEATS + 1):
        started = time.perf_counter()
        model(input_ids=ids[:, past:], **{keyword: cache}, position_ids=positions, use_cache=True)
        if repeat:
            best = min(best, time.perf_counter() - started)
        cache.crop(-1)  # every repeat sees the same `past` cached tokens
    return best


@dataclass(frozen=True)
class KernelReport:
    """What was measured of the int8 kernels on this CPU for one base's layer shapes, and which is in use.

    `errors`: every kernel that runs here, with its largest error against int64 sums (0: exact).
    `product_ms`: each exact kernel's pass over the base's layers, by row count.
    `one_token_ms`: one decoding step of the base in "fp32" and with each int8 kernel it was loaded with.
    """

    key: dict
    errors: dict[str, int]
    product_ms: dict[str, dict[str, float]]
    one_token_ms: dict[str, float] = field(default_factory=dict)
    in_use: str = ""

    @property
    def cpu(self) -> dict:
        return self.key["cpu"]

    @property
    def exact(self) -> bool:
        """Whether the kernel in use was checked bit-exact here."""
        return self.errors.get(self.in_use) == 0

    @property
    def fastest(self) -> str | None:
        """The exact kernel with the least time over 1 and 17 rows together (None: none is exact)."""
        exact = [name for name, error in self.errors.items() if error == 0]
        return min(exact, key=lambda name: sum(self.product_ms[name].values()), default=None)

    def slower_than_fp32(self) -> str | None:
        """One line when a one-token step of the int8 base costs more than fp32's here (else None)."""
        int8, fp32 = self.one_token_ms.get(self.in_use), self.one_token_ms.get("fp32")
        if int8 is None or fp32 is None or int8 < fp32:
            return None
        which = "the fastest exact kernel" if self.in_use == self.fastest else f"forced by ${KERNEL_ENV}"
        return (
            f"int8 does not pay on this CPU, {describe_cpu(self.cpu)}: one token takes {int8:.1f} ms in int8 "
            f"({self.in_use}, {which}) against {fp32:.1f} ms in fp32; use --dtype fp32"
        )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> KernelReport:
        """A cached report (its `in_use` is the loader's to set)."""
        return cls(data["key"], data["errors"], data["product_ms"], data["one_token_ms"])


def report_key(shapes: list[tuple[int, int]]) -> dict:
    """What the kernel choice depends on: the CPU, torch, threads and the (out, in) of every product a
    step runs."""
    return {
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shapes": [list(shape) for shape in shapes],
    }


def _report_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return calibration_dir() / f"int8-kernel-{digest}.json"


def measure_kernels(
    key: dict,
    kernels: Iterable[Int8Kernel],
    passes: Callable[[Int8Kernel, list[tuple[int, int]]], dict[int, Callable[[], float]]] = product_passes,
) -> KernelReport:
    """Check every kernel that runs here and time the exact ones on the key's layer shapes: the kernels and
    row counts interleaved within each repeat and the fastest repeat kept, so that other work on the
    machine (it only ever adds time) burdens every kernel alike rather than deciding the choice."""
    shapes = [tuple(shape) for shape in key["shapes"]]
    cases = saturating_cases(shapes)
    errors = {kernel.name: largest_error(kernel, cases) for kernel in kernels if kernel.runs()}
    timed = {kernel.name: passes(kernel, shapes) for kernel in kernels if errors.get(kernel.name) == 0}
    best = {name: dict.fromkeys(by_rows, math.inf) for name, by_rows in timed.items()}
    for repeat in range(TIMING_REPEATS + 1):  # repeat 0 warms up
        for name, by_rows in timed.items():
            for rows, one_pass in by_rows.items():
                seconds = one_pass()
                if repeat:
                    best[name][rows] = min(best[name][rows], seconds)
    product_ms = {
        name: {str(rows): round(s * 1000, 3) for rows, s in by_rows.items()} for name, by_rows in best.items()
    }
    return KernelReport(key, errors, product_ms)


def save_report(report: KernelReport) -> None:
    path = _report_path(report.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report.to_json(), indent=1))
    tmp.replace(path)


def cached_report(key: dict) -> KernelReport | None:
    """The report measured for this key, or None (none yet, damaged, or another key's)."""
    try:
        report = KernelReport.from_json(json.loads(_report_path(key).read_text()))
        if report.key == key and all(name in report.product_ms for name, e in report.errors.items() if e == 0):
            return report
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def kernel_report(
    model: PreTrainedModel, shapes: list[tuple[int, int]], kernels: Iterable[Int8Kernel] | None = None
) -> KernelReport:
    """The cached report for this CPU and these (out, in) product shapes, else one measured now (a second or
    two on the embedded base), with the float model's one-token step timed as the fp32 reference: call it
    before quantizing the model."""
    key = report_key(shapes)
    report = cached_report(key)
    if report is None:
        report = measure_kernels(key, KERNELS.values() if kernels is None else kernels)
        report.one_token_ms["fp32"] = round(one_token_seconds(model) * 1000, 2)
        save_report(report)
    return report


def kernel_in_use(report: KernelReport, forced: str | None = None) -> KernelReport:
    """The report with `in_use` set: the forced kernel (argument, else $FEDLA_INT8_KERNEL), else the fastest
    exact one. A forced kernel that is unknown or does not run here, or is not exact here, is refused."""
    forced = forced if forced is not None else os.environ.get(KERNEL_ENV, "")
    cpu = describe_cpu(report.cpu)
    if forced in ("", "auto"):
        if report.fastest is None:
            errors = ", ".join(f"{name} off by up to {error}" for name, error in report.errors.items())
            raise FedLookaheadError(f"no exact int8 kernel on this CPU, {cpu} ({errors}); use --dtype fp32")
        return replace(report, in_use=report.fastest)
    if forced not in report.errors:
        raise FedLookaheadError(
            f"int8 kernel {forced!r} (${KERNEL_ENV}) is not one that runs on this CPU, {cpu}: "
            f"use auto, {', '.join(report.errors)}"
        )
    if report.errors[forced]:
        raise FedLookaheadError(
            f"int8 kernel {forced!r} (${KERNEL_ENV}) is not exact on this CPU, {cpu}: its sums are off by up to "
            f"{report.errors[forced]}; use {report.fastest or 'fp32'}"
        )
    return replace(report, in_use=forced)


def record_one_token(report: KernelReport, model: PreTrainedModel) -> None:
    """Time the quantized model's one-token step with the kernel in use, once, into the cached report."""
    if report.in_use not in report.one_token_ms:
        report.one_token_ms[report.in_use] = round(one_token_seconds(model) * 1000, 2)
        save_report(report)


def cached_reports() -> list[KernelReport]:
    """Every kernel report measured on this CPU with this torch (for `fedla client status`), newest first."""
    cpu, reports = cpu_info(), []
    paths = sorted(calibration_dir().glob("int8-kernel-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in paths:
        try:
            report = KernelReport.from_json(json.loads(path.read_text()))
            if report.cpu == cpu and report.key["torch"] == torch.__version__:
                reports.append(report)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return reports
