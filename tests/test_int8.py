"""int8 base weights (common.model.quant): exact integer products, shape-independent logits, AMS-LD lossless on
the int8 base, the quality report and the option's errors."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from typer.testing import CliRunner

from common.cli.app import app
from common.data.chunks import stdlib_files
from common.decoding import generate
from common.decoding.bench import Setting, decode_benchmark
from common.decoding.calibration import calibration_key
from common.decoding.core import BaseRunner
from common.decoding.fidelity import int8_quality
from common.decoding.tree import attention_mask_4d, build_tree_spec, position_ids
from common.errors import FedLookaheadError
from common.heads.lookahead import DraftHeads
from common.model import int8_kernels, quant
from common.model.attention import EXACT_ATTENTION
from common.model.base import BaseModel, load_base
from common.model.int8_kernels import (
    INT_MM,
    KERNEL_ENV,
    KERNELS,
    KernelReport,
    cpu_info,
    describe_cpu,
    kernel_in_use,
    kernel_report,
    largest_error,
    measure_kernels,
    saturating_cases,
)
from common.model.quant import Int8DynamicLinear, Int8Slice, public_calibration, quantize_int8
from common.paths import cache_root, calibration_dir
from tests.conftest import save_tiny
from tests.test_decoding import ARCHS, hf_greedy, perturb, quickly_trained_heads

pytestmark = pytest.mark.usefixtures("one_thread")


def exact_kernels_here() -> list:
    """Every int8 kernel, each skipped with the reason where it does not run or is not exact on this CPU."""
    params = []
    for kernel in KERNELS.values():
        reason = None
        if not kernel.runs():
            reason = f"{kernel.name} does not run on this CPU, {describe_cpu(cpu_info())}"
        elif error := largest_error(kernel, saturating_cases([(48, 2048), (40, 96)])):
            reason = f"{kernel.name} is not exact on this CPU, {describe_cpu(cpu_info())}: sums off by up to {error}"
        params.append(pytest.param(kernel, id=kernel.name, marks=[pytest.mark.skip(reason=reason)] if reason else []))
    return params


EXACT_KERNELS = exact_kernels_here()


def int8_base(directory, seed: int) -> BaseModel:
    """A tiny base with perturbed (non-degenerate) weights, then quantized, as load_base(int8=True) does."""
    base = perturb(load_base(directory, device="cpu"), seed=seed)
    quantize_int8(base.model)
    report = KernelReport({"cpu": cpu_info()}, {INT_MM.name: 0}, {INT_MM.name: {}}, in_use=INT_MM.name)
    return dataclasses.replace(base, int8_kernel=report)


@pytest.fixture(scope="module")
def int8_models(tmp_path_factory, tiny_tokenizer) -> dict[str, tuple[BaseModel, DraftHeads]]:
    out = {}
    for index, arch in enumerate(ARCHS):
        base = int8_base(save_tiny(tmp_path_factory.mktemp(f"int8-{arch}"), tiny_tokenizer, arch), seed=index + 1)
        out[arch] = (base, quickly_trained_heads(base))
    return out


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
@pytest.mark.parametrize("smoothed", [False, True])
def test_int8_linear_rows_are_independent_and_close_to_float(smoothed, kernel):
    torch.manual_seed(0)
    layer = nn.Linear(96, 40).requires_grad_(False)
    x = torch.randn(2, 7, 96) * torch.logspace(-2, 1, 7).view(1, 7, 1)  # rows of very different scales
    x[..., 5] *= 30  # an outlier channel, which smoothing moves into the weights
    quantized = Int8DynamicLinear.of([layer], x.reshape(-1, 96).abs().amax(0) if smoothed else None, kernel)
    out = quantized(x)
    assert out.shape == (2, 7, 40) and out.dtype == torch.float32
    for b in range(2):
        for t in range(7):  # a row's output is bit-identical whatever else is in the batch
            assert torch.equal(quantized(x[b, t : t + 1]), out[b, t : t + 1])
    reference = layer(x)
    error = (out - reference).norm(dim=-1) / reference.norm(dim=-1)
    assert float(error.max()) < (0.03 if smoothed else 0.2)  # the outlier costs the plain rows precision
    # every weight within half an int8 step of its (smoothed) row, divided back by its column's factor
    bound = quantized.scale[:, None] / 2 * quantized.inv_smooth
    assert bool(((quantized.weight - layer.weight).abs() <= bound * 1.0001).all())
    assert quantized(torch.zeros(3, 96)).allclose(layer.bias.expand(3, 40))  # an all-zero row: no 0/0


def test_layers_reading_one_input_share_one_fused_int8_layer(int8_models):
    model = int8_models["llama"][0].model
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v, gate, up = attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj
    assert all(isinstance(layer, Int8Slice) for layer in (q, k, v, gate, up))
    assert q.fused is k.fused is v.fused and q.fused.readers == 3
    assert gate.fused is up.fused and gate.fused.readers == 2 and gate.fused is not q.fused
    assert type(attention.o_proj) is Int8DynamicLinear and type(mlp.down_proj) is Int8DynamicLinear
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    x = torch.randn(1, 3, q.in_features)
    outputs = [q(x), k(x), v(x)]
    assert [out.shape[-1] for out in outputs] == [config.hidden_size] + [config.num_key_value_heads * head_dim] * 2
    assert torch.equal(torch.cat(outputs, dim=-1), q.fused(x))  # one quantized product, sliced
    assert q.fused._shared is None  # the last reader let the activations go
    assert torch.equal(k(x.clone()), outputs[1])  # another tensor with the same values: computed again, the same


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
def test_an_int8_layer_gives_its_int64_reference_bit_for_bit(kernel):
    """Each kernel exact here, through the layer: its outputs are the int64 sums of the quantized rows and
    weights, scaled in the layer's order, including sums above 2**24 (where float32 sums would round)."""
    torch.manual_seed(0)
    layer = nn.Linear(2048, 48).requires_grad_(False)
    layer.weight[0] = 0.5  # a row and an input that saturate int8: an int32 sum of 127 * 127 * 2048 > 2**24
    x = torch.randn(4, 2048)
    x[1] = 3.0
    quantized = Int8DynamicLinear.of([layer], kernel=kernel)
    qweight = kernel.unpack(quantized.packed)
    row_scale = x.abs().amax(dim=1, keepdim=True) / 127
    rows = torch.round(x / row_scale).to(torch.int8)
    sums = rows.long() @ qweight.long().t()
    assert int(sums.abs().max()) > 2**24
    reference = (sums.float() * quantized.scale) * row_scale + quantized.bias
    assert torch.equal(quantized(x), reference)


def test_gpt2_conv1d_layers_and_the_tied_head_are_quantized():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)).eval()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        reference = model(ids).logits
        quantize_int8(model)
        logits = model(ids).logits
    assert isinstance(model.transformer.h[0].attn.c_attn, Int8DynamicLinear)
    assert isinstance(model.lm_head, Int8DynamicLinear)
    assert isinstance(model.transformer.wte, nn.Embedding)  # the input embedding stays in float
    assert model.config._attn_implementation == EXACT_ATTENTION
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_tree_logits_equal_plain_decoding_bit_for_bit(int8_models, arch):
    """The property that makes AMS-LD lossless on the int8 base: a tree node's logits are exactly those of
    a one-token forward after its path, although the int8 rounding would amplify any last-bit difference."""
    base = int8_models[arch][0]
    prefix = [3, 17, 99, 250, 4, 42, 7]
    parents = (-1, 0, 0, 1, 1, 2, 3, 5)
    tokens = [60, 61, 62, 63, 64, 65, 66, 67]
    spec = build_tree_spec(parents, base.dtype, base.device)
    with torch.inference_mode():
        runner = BaseRunner(base)
        runner.forward(torch.tensor([prefix]))
        past = runner.length
        tree = runner.logits(
            runner.forward(torch.tensor([tokens]), attention_mask_4d(spec, past), position_ids(spec, past))
        )
        for node, path in enumerate(spec.paths):
            plain = BaseRunner(base)
            plain.forward(torch.tensor([prefix]))
            for j in path:  # one token at a time, as plain greedy decoding runs
                logits = plain.logits(plain.forward(torch.tensor([[tokens[j]]])))
            assert torch.equal(tree[0, node], logits[0, 0]), node


@pytest.mark.parametrize("arch", ARCHS)
def test_ams_on_the_int8_base_equals_its_greedy_generate(int8_models, arch):
    base, heads = int8_models[arch]
    prompt = list(range(5, 25))
    reference = hf_greedy(base, prompt, 64)
    result = generate(base, torch.tensor(prompt), mode="ams", heads=heads, max_new_tokens=64, degeneration_guard=False)
    assert result.tokens == reference
    assert result.base_forwards < len(reference)  # trees were verified and accepted on the int8 base


def test_int8_bench_finds_every_mode_identical(int8_models):
    base, heads = int8_models["llama"]
    prompts = [torch.arange(5, 17), torch.arange(40, 50)]
    summary = decode_benchmark(
        Setting(base, heads), prompts, 24, modes=("hf_greedy", "hf_prompt_lookup", "ams"), progress=False
    )
    # transformers' own prompt lookup verifies several tokens per forward too: with float32 attention
    # on the int8 base it disagreed with greedy generate; with exact attention it agrees
    assert all(row["identical_to_hf_greedy"] for row in summary["modes"].values()), summary["modes"]
    assert summary["modes"]["ams"]["tau"] > 1.05  # drafts were accepted (plain decoding: 1.0)


def test_smoothing_is_calibrated_on_public_text_and_changes_the_product_little(tiny_base_dir):
    plain = load_base(tiny_base_dir, device="cpu")
    calibration = public_calibration(plain.tokenizer)
    assert calibration.shape == (16, 128)
    smoothed = load_base(tiny_base_dir, device="cpu", int8=True)  # load_base smooths with public_calibration
    unsmoothed = quantize_int8(load_base(tiny_base_dir, device="cpu").model)
    layer = smoothed.model.model.layers[0].mlp.down_proj
    assert not torch.equal(layer.inv_smooth, torch.ones_like(layer.inv_smooth))
    assert torch.equal(unsmoothed.model.layers[0].mlp.down_proj.inv_smooth, torch.ones_like(layer.inv_smooth))
    reference = plain.model.model.layers[0].mlp.down_proj.weight
    assert torch.allclose(layer.weight, reference, atol=float(reference.abs().max()) / 50)


def test_int8_calibration_is_cached_by_fingerprint_and_measured_again_when_damaged(tiny_base_dir, monkeypatch):
    first = load_base(tiny_base_dir, device="cpu", int8=True)
    [cached] = (cache_root() / "calibration").glob(f"int8-{first.fingerprint}-*.pt")
    ids = torch.arange(3, 40).view(1, -1)
    with torch.inference_mode():
        reference = first.model(ids).logits

    def measured(*args, **kwargs):
        raise AssertionError("the cached calibration was not used")

    with monkeypatch.context() as patched:
        patched.setattr(quant, "trace_inputs", measured)
        second = load_base(tiny_base_dir, device="cpu", int8=True)
    cached.write_bytes(b"not a torch file")
    third = load_base(tiny_base_dir, device="cpu", int8=True)  # measured again, and cached anew
    with torch.inference_mode():
        assert torch.equal(second.model(ids).logits, reference) and torch.equal(third.model(ids).logits, reference)
    assert torch.load(cached, weights_only=True)["groups"]
    plain = load_base(tiny_base_dir, device="cpu").model
    assert not quant.Int8Calibration([["lm_head"]]).fits(quant.linear_layers(plain))  # another model's


def test_int8_quality_of_an_unperturbed_base_is_close_to_fp32(tiny_base_dir):
    base = load_base(tiny_base_dir, device="cpu", int8=True)
    quality = int8_quality(base, stdlib_files("heldout")[:12])
    assert abs(quality["heldout_loss_int8"] - quality["heldout_loss_fp32"]) < 0.05, quality
    assert quality["greedy_agreement_with_fp32"] > 0.8 and quality["heldout_tokens"] == 32 * 128
    assert quality["perplexity_ratio"] == pytest.approx(
        2.718281828 ** (quality["heldout_loss_int8"] - quality["heldout_loss_fp32"]), rel=1e-3
    )


def test_int8_option_loads_binds_heads_and_keys_its_own_cost_curve(tiny_base_dir, tiny_base):
    base = load_base(tiny_base_dir, device="cpu", int8=True)
    assert base.int8 and base.precision == "int8" and base.dtype == torch.float32
    assert base.vocab_size == tiny_base.vocab_size and base.fingerprint == tiny_base.fingerprint
    assert calibration_key(base) != calibration_key(tiny_base) and "-int8-" in calibration_key(base)
    heads = DraftHeads.fresh(base, 2, draft_vocab=list(range(0, base.vocab_size, 3)))
    assert heads.draft_weight.shape == (len(range(0, base.vocab_size, 3)), base.hidden_size)
    with pytest.raises(FedLookaheadError, match="CPU option"):
        load_base(tiny_base_dir, device="cpu", dtype=torch.bfloat16, int8=True)


def test_cli_int8(tiny_base_dir, tmp_path):
    runner = CliRunner()
    common = ["generate", "--base", str(tiny_base_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "6"]
    result = runner.invoke(app, common + ["--dtype", "int8"])
    assert result.exit_code == 0 and "tokens/s" in result.output, result.output
    result = runner.invoke(app, common + ["--dtype", "int4"])
    assert result.exit_code == 2 and "unknown --dtype 'int4'" in result.output
    if not torch.cuda.is_available():
        result = runner.invoke(app, common + ["--dtype", "int8", "--device", "cuda"])
        assert result.exit_code == 2 and "CUDA is not available" in result.output
    data = tmp_path / "data"
    data.mkdir()
    for path in stdlib_files("heldout")[:6]:
        shutil.copy(path, data / path.name)
    out = tmp_path / "bench.json"
    result = runner.invoke(
        app,
        ["bench-decode", "--data", str(data), "--base", str(tiny_base_dir), "--dtype", "int8", "--prompts", "1"]
        + ["--prompt-tokens", "16", "--max-new-tokens", "6", "--modes", "hf_greedy,ams", "--json", str(out)],
    )
    assert result.exit_code == 0 and "int8 quality: held-out loss" in result.output, result.output
    result_json_output = result.output
    short = tmp_path / "short"
    short.mkdir()
    (short / "a.py").write_text("def f(x):\n    return x + 1\n" * 6)  # a 16-token prompt, no 128-token chunk
    result = runner.invoke(
        app,
        ["bench-decode", "--data", str(short), "--base", str(tiny_base_dir), "--dtype", "int8", "--prompts", "1"]
        + ["--prompt-tokens", "16", "--max-new-tokens", "6", "--modes", "hf_greedy,ams"],
    )
    assert result.exit_code == 2 and "128 tokens long: quality not measured" in result.output, result.output
    summary = json.loads(out.read_text())
    hardware = summary["hardware"]
    assert hardware["cpu"] == cpu_info() and hardware["precision"] == "int8" and hardware["int8_kernel"]["exact"]
    assert f"(kernel {hardware['int8_kernel']['name']}, checked exact here)" in result_json_output
    quality = summary["int8_quality"]
    assert set(quality) == {
        "heldout_loss_int8",
        "heldout_loss_fp32",
        "perplexity_ratio",
        "greedy_agreement_with_fp32",
        "heldout_tokens",
    }


def saturating_multiply(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an int8 product without VNNI computes (x86 `vpmaddubsw`): the s8 rows shifted to u8 (+128),
    adjacent u8 x s8 products summed in pairs that saturate at 16 bits, the shift taken back out."""
    unsigned, signed = rows.long() + 128, weight.long()
    pairs = (unsigned[:, None, :] * signed[None]).view(len(rows), len(weight), -1, 2).sum(-1)
    sums = pairs.clamp(-(2**15), 2**15 - 1).sum(-1) - 128 * signed.sum(1)
    return sums.float() * scale


def fake_kernel(name: str, multiply=INT_MM.multiply) -> int8_kernels.Int8Kernel:
    return int8_kernels.Int8Kernel(name, lambda: True, INT_MM.pack, multiply, INT_MM.unpack)


FAKE_KERNELS = [fake_kernel("slow"), fake_kernel("fast"), fake_kernel("saturating", saturating_multiply)]
FAKE_SECONDS = {"slow": 0.005, "fast": 0.001, "saturating": 0.0001}  # the inexact one would be fastest


def fake_report(forced: str | None = None, one_token_ms: dict | None = None) -> KernelReport:
    key = {"cpu": {"model": "Test CPU", "flags": ["avx2"]}, "shapes": [[40, 96], [8, 64]]}
    timed = []

    def passes(kernel, shapes):
        timed.append(kernel.name)
        return {rows: lambda rows=rows: FAKE_SECONDS[kernel.name] * rows for rows in (1, 17)}

    report = measure_kernels(key, FAKE_KERNELS, passes)
    assert "saturating" not in timed  # an inexact kernel is dropped before it is timed
    report.one_token_ms.update(one_token_ms or {})
    return kernel_in_use(report, forced)


def test_the_chooser_keeps_the_fastest_exact_kernel_and_drops_an_inexact_one():
    report = fake_report()
    assert report.errors["slow"] == report.errors["fast"] == 0 and report.errors["saturating"] > 1000
    assert report.fastest == report.in_use == "fast" and report.exact
    assert report.product_ms == {"slow": {"1": 5.0, "17": 85.0}, "fast": {"1": 1.0, "17": 17.0}}
    assert fake_report(forced="slow").in_use == "slow"  # a setting may force any exact kernel


def test_forcing_an_inexact_or_unknown_kernel_is_refused_in_one_line(monkeypatch):
    with pytest.raises(FedLookaheadError, match="'saturating' .* is not exact on this CPU, Test CPU .avx2.") as error:
        fake_report(forced="saturating")
    assert "\n" not in str(error.value) and "use fast" in str(error.value)
    monkeypatch.setenv(KERNEL_ENV, "int4_mm")
    with pytest.raises(FedLookaheadError, match="'int4_mm' .* not one that runs on this CPU.*use auto, slow, fast"):
        fake_report()


def test_no_exact_kernel_refuses_int8():
    key = {"cpu": {"model": "Test CPU", "flags": ["avx2"]}, "shapes": [[40, 96]]}
    report = measure_kernels(key, FAKE_KERNELS[2:], lambda kernel, shapes: pytest.fail("an inexact kernel was timed"))
    with pytest.raises(
        FedLookaheadError, match="no exact int8 kernel on this CPU.*saturating off by up to.*--dtype fp32"
    ):
        kernel_in_use(report)


def test_int8_slower_than_fp32_says_so_with_both_timings():
    slow = fake_report(one_token_ms={"fp32": 111.9, "fast": 154.7})
    assert slow.slower_than_fp32() == (
        "int8 does not pay on this CPU, Test CPU (avx2): one token takes 154.7 ms in int8 (fast, the fastest exact "
        "kernel) against 111.9 ms in fp32; use --dtype fp32"
    )
    assert fake_report(one_token_ms={"fp32": 47.2, "fast": 23.1}).slower_than_fp32() is None


def test_the_kernel_report_is_cached_per_cpu_and_threads_and_measured_again_when_damaged(tiny_base, monkeypatch):
    model, shapes = tiny_base.model, [(40, 64), (64, 64)]
    first = kernel_report(model, shapes)
    assert set(first.one_token_ms) == {"fp32"} and first.key["threads"] == torch.get_num_threads()
    with monkeypatch.context() as patched:
        patched.setattr(int8_kernels, "measure_kernels", lambda *args: pytest.fail("the cached report was not used"))
        assert kernel_report(model, shapes) == first
    [path] = [p for p in calibration_dir().glob("int8-kernel-*.json") if json.loads(p.read_text())["key"] == first.key]
    path.write_text('{"key": ')
    assert kernel_report(model, shapes).key == first.key  # measured again, and cached anew
    assert json.loads(path.read_text())["errors"] == first.errors
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert kernel_report(model, shapes).key["threads"] == threads + 1  # another key: its own measurement
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
def test_load_base_uses_a_forced_exact_kernel_and_every_exact_kernel_gives_the_same_logits(
    tiny_base_dir, monkeypatch, kernel
):
    reference = load_base(tiny_base_dir, device="cpu", int8=True)  # the kernel measured fastest here
    monkeypatch.setenv(KERNEL_ENV, kernel.name)
    forced = load_base(tiny_base_dir, device="cpu", int8=True)
    layer = forced.model.model.layers[0].mlp.down_proj
    assert forced.int8_kernel.in_use == kernel.name and layer.kernel is kernel and forced.int8_kernel.exact
    assert calibration_key(forced).count(f"-int8-{kernel.name}-") == 1  # each kernel its own cost curve
    ids = torch.arange(3, 40).view(1, -1)
    with torch.inference_mode():
        assert torch.equal(forced.model(ids).logits, reference.model(ids).logits)
    assert set(forced.int8_kernel.one_token_ms) >= {"fp32", kernel.name}


def cached_report_saying(tiny_base_dir, errors: dict, one_token_ms: dict) -> None:
    """Overwrite this machine's cached kernel report for the tiny base with made-up measurements."""
    base = load_base(tiny_base_dir, device="cpu", int8=True)
    report = dataclasses.replace(base.int8_kernel, errors=errors, one_token_ms=one_token_ms)
    report = dataclasses.replace(report, product_ms={name: {"1": 1.0, "17": 2.0} for name in errors})
    int8_kernels.save_report(report)


def test_cli_says_when_int8_does_not_pay_and_refuses_an_inexact_forced_kernel(tiny_base_dir, monkeypatch):
    runner = CliRunner()
    command = ["generate", "--base", str(tiny_base_dir), "--prompt", "def f(x):", "--max-new-tokens", "4"]
    command += ["--dtype", "int8", "--mode", "greedy"]
    cached_report_saying(tiny_base_dir, {"int_mm": 0}, {"fp32": 1.5, "int_mm": 2.5})
    result = runner.invoke(app, command)
    assert result.exit_code == 0, result.output
    [line] = [line for line in result.output.splitlines() if "does not pay" in line]
    assert "2.5 ms in int8 (int_mm" in line and "1.5 ms in fp32; use --dtype fp32" in line
    cached_report_saying(tiny_base_dir, {"int_mm": 0}, {"fp32": 2.5, "int_mm": 1.5})
    assert "does not pay" not in runner.invoke(app, command).output
    cached_report_saying(tiny_base_dir, {"onednn": 163840, "int_mm": 0}, {"fp32": 2.5, "int_mm": 1.5})
    monkeypatch.setenv(KERNEL_ENV, "onednn")
    result = runner.invoke(app, command)
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].startswith("error: int8 kernel 'onednn'")
    assert "is not exact on this CPU" in result.output and "off by up to 163840" in result.output
