"""int8 base weights (common.quant): exact integer products, shape-independent logits, AMS-LD lossless on
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

from common import quant
from common.attention import EXACT_ATTENTION
from common.base import BaseModel, FedLookaheadError, load_base
from common.bench import decode_benchmark, int8_quality
from common.cli import app
from common.data import stdlib_files
from common.decoding import generate
from common.decoding.calibration import calibration_key
from common.decoding.core import BaseRunner
from common.decoding.tree import attention_mask_4d, build_tree_spec, position_ids
from common.default_model import cache_root
from common.heads import DraftHeads
from common.quant import Int8DynamicLinear, Int8Slice, onednn_int8, public_calibration, quantize_int8
from tests.conftest import save_tiny
from tests.test_decoding import ARCHS, hf_greedy, perturb, quickly_trained_heads

pytestmark = pytest.mark.usefixtures("one_thread")


def int8_base(directory, seed: int) -> BaseModel:
    """A tiny base with perturbed (non-degenerate) weights, then quantized, as load_base(int8=True) does."""
    base = perturb(load_base(directory, device="cpu"), seed=seed)
    quantize_int8(base.model)
    return dataclasses.replace(base, int8=True)


@pytest.fixture(scope="module")
def int8_models(tmp_path_factory, tiny_tokenizer) -> dict[str, tuple[BaseModel, DraftHeads]]:
    out = {}
    for index, arch in enumerate(ARCHS):
        base = int8_base(save_tiny(tmp_path_factory.mktemp(f"int8-{arch}"), tiny_tokenizer, arch), seed=index + 1)
        out[arch] = (base, quickly_trained_heads(base))
    return out


@pytest.mark.parametrize("smoothed", [False, True])
def test_int8_linear_rows_are_independent_and_close_to_float(smoothed):
    torch.manual_seed(0)
    layer = nn.Linear(96, 40).requires_grad_(False)
    x = torch.randn(2, 7, 96) * torch.logspace(-2, 1, 7).view(1, 7, 1)  # rows of very different scales
    x[..., 5] *= 30  # an outlier channel, which smoothing moves into the weights
    quantized = Int8DynamicLinear.of([layer], x.reshape(-1, 96).abs().amax(0) if smoothed else None)
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


@pytest.mark.skipif(not onednn_int8(), reason="oneDNN's int8 linear does not run here")
def test_onednn_and_int_mm_give_the_same_int8_layer_bit_for_bit(monkeypatch):
    torch.manual_seed(0)
    layer = nn.Linear(2048, 48).requires_grad_(False)
    layer.weight[0] = 0.5  # a row and an input that saturate int8: an int32 sum of 127 * 127 * 2048 > 2**24
    x = torch.randn(4, 2048)
    x[1] = 3.0
    packed = Int8DynamicLinear.of([layer])
    monkeypatch.setattr(quant, "onednn_int8", lambda: False)
    plain = Int8DynamicLinear.of([layer])
    assert packed.packed is not None and packed.qweight is None and plain.packed is None
    assert torch.equal(packed(x), plain(x)) and torch.equal(packed.weight, plain.weight)


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
    summary = decode_benchmark(base, heads, prompts, 24, modes=("hf_greedy", "hf_prompt_lookup", "ams"), progress=False)
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
    short = tmp_path / "short"
    short.mkdir()
    (short / "a.py").write_text("def f(x):\n    return x + 1\n" * 6)  # a 16-token prompt, no 128-token chunk
    result = runner.invoke(
        app,
        ["bench-decode", "--data", str(short), "--base", str(tiny_base_dir), "--dtype", "int8", "--prompts", "1"]
        + ["--prompt-tokens", "16", "--max-new-tokens", "6", "--modes", "hf_greedy,ams"],
    )
    assert result.exit_code == 2 and "128 tokens long: quality not measured" in result.output, result.output
    quality = json.loads(out.read_text())["int8_quality"]
    assert set(quality) == {
        "heldout_loss_int8",
        "heldout_loss_fp32",
        "perplexity_ratio",
        "greedy_agreement_with_fp32",
        "heldout_tokens",
    }
