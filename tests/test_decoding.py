"""AMS-LD decoding: exactness against transformers' greedy generate, tree masks, cache compaction,
lossless sampling (statistically), fallbacks, stopping rules and the CLI."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from common.cli.app import app
from common.data.chunks import stdlib_files
from common.data.features import compute_features
from common.decoding import (
    AmsPolicy,
    DecodingFallbackWarning,
    DegenerationGuard,
    HeadsTreeDrafter,
    NgramIndex,
    generate,
    load_heads,
    sampling_probs,
)
from common.decoding.bench import Setting, decode_benchmark
from common.decoding.calibration import CostCurve
from common.decoding.core import BaseRunner, StaticRunner
from common.decoding.drafting import Candidate, choose_tree
from common.decoding.tree import (
    attention_mask_4d,
    build_tree_spec,
    greedy_accept,
    greedy_verify,
    keep_cache_path,
    position_ids,
    sample_accept,
    tree_paths,
)
from common.errors import FedLookaheadError
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel, load_base
from common.training.loop import feature_loader, train_epoch
from tests.conftest import TINY_VOCAB, save_tiny

ARCHS = ("llama", "qwen2", "gpt2")
# Synthetic verify cost curves: trees almost free (a GPU) and steep (verifying costs more than it yields).
CURVES = {
    "flat": CostCurve((1, 64), (1.0, 1.2), (0.01, 0.02)),
    "steep": CostCurve((1, 2, 64), (1.0, 3.0, 90.0), (0.01, 0.02, 0.5)),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def hf_greedy(base: BaseModel, ids: list[int], max_new_tokens: int) -> list[int]:
    prompt = torch.tensor([ids])
    out = base.model.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def perturb(base: BaseModel, seed: int, std: float = 0.2) -> BaseModel:
    """Re-draw every weight matrix with a larger scale: a freshly initialised tiny model only repeats one token."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in base.model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return base


def quickly_trained_heads(base: BaseModel, num_heads: int = 3, epochs: int = 8, arch: str = "recurrent") -> DraftHeads:
    """Heads distilled for a few seconds on the base's own greedy continuations, so drafts get accepted."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, TINY_VOCAB, (16, 6), generator=generator)
    with torch.no_grad():
        sequences = base.model.generate(
            prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=42, pad_token_id=0
        )
    with torch.random.fork_rng():  # eagle's layer starts from random weights: seeded, no global side effect
        torch.manual_seed(0)
        heads = DraftHeads.fresh(base, num_heads, arch=arch)
    features = compute_features(base, sequences, progress=False)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    for epoch in range(epochs):
        loader = feature_loader(features, batch_size=8, shuffle=True, seed=epoch)
        train_epoch(heads, loader, optimizer, num_heads, show_progress=False)
    return heads


def noisy_heads(base: BaseModel, seed: int, arch: str = "parallel", num_heads: int = 4) -> DraftHeads:
    """Heads (Medusa's parallel by default) over a draft vocabulary of every other token, randomly perturbed."""
    with torch.random.fork_rng():  # eagle's layer starts from random weights: seeded, no global side effect
        torch.manual_seed(seed)
        heads = DraftHeads.fresh(base, num_heads, arch=arch, draft_vocab=list(range(0, base.vocab_size, 2)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in heads.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return heads


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer) -> dict[str, tuple[BaseModel, DraftHeads, DraftHeads]]:
    out = {}
    for index, arch in enumerate(ARCHS):
        base = load_base(save_tiny(tmp_path_factory.mktemp(arch), tiny_tokenizer, arch), device="cpu")
        perturb(base, seed=index + 1)
        out[arch] = (base, quickly_trained_heads(base), noisy_heads(base, index))
    return out


# --------------------------------------------------------------------------------------------- exactness


def test_ams_greedy_equals_hf_greedy_property(models):
    """For random prompts, models (3 architectures) and heads (trained / noisy), with and without the n-gram
    source and for varied tree policies: AMS-LD greedy == transformers greedy, token for token."""
    taus: list[float] = []

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
    @given(
        arch=st.sampled_from(ARCHS),
        prompt=st.lists(st.integers(1, TINY_VOCAB - 1), min_size=1, max_size=32),
        trained=st.booleans(),
        ngram=st.booleans(),
        top_k=st.integers(1, 5),
        beam=st.integers(1, 4),
        nodes=st.integers(0, 40),
        min_path_prob=st.sampled_from([0.0, 0.02, 0.2]),
        curve=st.sampled_from([None, "flat", "steep"]),
        max_new_tokens=st.integers(1, 32),
    )
    def check(arch, prompt, trained, ngram, top_k, beam, nodes, min_path_prob, curve, max_new_tokens):
        base, good, noisy = models[arch]
        policy = AmsPolicy(
            top_k=top_k,
            beam=beam,
            max_nodes=nodes,
            min_path_prob=min_path_prob,
            ngram=ngram,
            cost_aware=curve is not None,
        )
        result = generate(
            base,
            torch.tensor(prompt),
            heads=good if trained else noisy,
            policy=policy,
            max_new_tokens=max_new_tokens,
            degeneration_guard=False,
            curve=CURVES.get(curve),
        )
        assert result.mode == "ams"
        assert result.tokens == hf_greedy(base, prompt, max_new_tokens)
        taus.append(result.tau)

    check()
    # Drafts were really accepted (tau counts the bonus token: without any acceptance it is about 1).
    assert max(taus) > 1.3


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_ams_on_a_static_cache_equals_hf_greedy(models, monkeypatch, arch):
    """AMS-LD's compiled mode (a StaticCache, every tree padded to one width, compacted in place) gives
    transformers' greedy tokens and the eager mode's very trees, also when its runner is reused by the
    next call. torch.compile is the identity here: what is tested is the static-cache logic."""
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: module)
    base, heads, noisy = models[arch]
    accepted = 0
    for seed, (draft, nodes) in enumerate([(heads, 16), (noisy, 8), (heads, 3), (heads, 16)]):
        prompt = torch.randint(1, TINY_VOCAB, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
        prompt += prompt[:5]  # a repeat, which the n-gram source drafts
        runs = [
            generate(
                base,
                torch.tensor(prompt),
                heads=draft,
                policy=AmsPolicy(cost_aware=False, max_nodes=nodes),
                max_new_tokens=32,
                degeneration_guard=False,
                compiled=compiled,
            )
            for compiled in (True, False)
        ]
        assert runs[0].mode == "ams"
        assert runs[0].tokens == hf_greedy(base, prompt, 32)
        assert runs[0].stats == runs[1].stats
        accepted += runs[0].stats["accepted"]
    assert accepted > 0  # drafts were accepted, so paths were compacted


def test_a_compiled_runner_goes_with_its_model(tiny_base, monkeypatch):
    """The runner (static cache and graph) kept per base for the next call does not keep the base alive."""
    import gc
    import weakref

    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: module)
    base = load_base(tiny_base.path, device="cpu")
    generate(base, torch.tensor([5, 6, 7]), heads=noisy_heads(base, 0), max_new_tokens=4, compiled=True)
    model = weakref.ref(base.model)
    assert model() in StaticRunner._shared
    del base
    gc.collect()
    assert model() is None


def test_trained_heads_alone_get_drafts_accepted(models):
    """Without the n-gram source, briefly trained heads still get tokens accepted (and stay exact)."""
    taus = []
    for arch in ARCHS:
        base, heads, _ = models[arch]
        for seed in range(2):
            prompt = torch.randint(1, TINY_VOCAB, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
            policy = AmsPolicy(ngram=False, cost_aware=False, max_nodes=16)
            result = generate(
                base, torch.tensor(prompt), heads=heads, policy=policy, max_new_tokens=32, degeneration_guard=False
            )
            assert result.tokens == hf_greedy(base, prompt, 32)
            # Every forward after the prefill yields its accepted drafts plus one bonus token.
            assert result.stats["accepted"] == len(result.tokens) - 1 - result.base_forwards
            taus.append(result.tau)
    assert max(taus) > 1.3


@pytest.mark.parametrize("arch", ARCHS)
def test_ams_and_our_greedy_equal_hf_greedy_on_longer_outputs(models, arch):
    base, heads, _ = models[arch]
    prompt = list(range(5, 25))
    reference = hf_greedy(base, prompt, 96)
    for mode in ("greedy", "ams"):
        result = generate(
            base, torch.tensor(prompt), mode=mode, heads=heads, max_new_tokens=96, degeneration_guard=False
        )
        assert result.tokens == reference, mode
        assert result.text == base.tokenizer.decode(reference, skip_special_tokens=True)
    assert result.base_forwards < len(reference)  # ams used fewer forwards than tokens


# --------------------------------------------------------------------------------- tree mask and cache


def test_tree_spec_mask_and_paths():
    parents = (-1, 0, 0, 1, 1, 2, 3)
    spec = build_tree_spec(parents, torch.float32, torch.device("cpu"))
    assert spec.paths == ((0,), (0, 1), (0, 2), (0, 1, 3), (0, 1, 4), (0, 2, 5), (0, 1, 3, 6))
    assert spec.depths == (0, 1, 1, 2, 2, 2, 3) and spec.max_depth == 3
    visible = spec.bias == 0
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for i, path in enumerate(spec.paths):
        expected[i, list(path)] = True
    assert torch.equal(visible, expected) and torch.equal(spec.ancestors, expected)
    assert (spec.bias[~expected] == torch.finfo(torch.float32).min).all()
    mask = attention_mask_4d(spec, past=5)
    assert mask.shape == (1, 1, 7, 12) and (mask[..., :5] == 0).all() and torch.equal(mask[0, 0, :, 5:], spec.bias)
    assert position_ids(spec, past=5).tolist() == [[5, 6, 6, 7, 7, 7, 8]]
    # Earlier siblings: node 2 follows node 1 under the root; node 4 follows node 3 under node 1.
    assert spec.earlier_sibling.nonzero().tolist() == [[2, 1], [4, 3]]
    for bad in [(0, 0), (-1, 1), (-1, 0, 3, 1)]:
        with pytest.raises(ValueError):
            tree_paths(bad)


def test_greedy_accept_picks_deepest_agreeing_node():
    spec = build_tree_spec((-1, 0, 0, 1, 2, 4), torch.float32, torch.device("cpu"))
    tokens = torch.tensor([9, 11, 12, 13, 14, 15])
    # The base picks 12 after the root (node 2), then 14 after node 2 (node 4), then 7 after node 4 (not drafted).
    choices = torch.tensor([12, 0, 14, 0, 7, 0])
    assert int(greedy_accept(spec, tokens, choices[spec.parent_t])) == 4
    # Once the base also picks node 5's token after node 4, the path extends to node 5.
    choices[4] = 15
    assert int(greedy_accept(spec, tokens, choices[spec.parent_t])) == 5
    # The base disagrees with every child of the root: only the root is kept.
    choices[0] = 3
    assert int(greedy_accept(spec, tokens, choices[spec.parent_t])) == 0
    assert spec.internal.tolist() == [0, 1, 2, 4]
    assert spec.internal[spec.parent_slot[1:]].tolist() == list(spec.parents[1:])


def test_greedy_verify_uses_the_lm_head_on_internal_nodes_only():
    spec = build_tree_spec((-1, 0, 0, 1, 2, 4), torch.float32, torch.device("cpu"))
    lm_head = torch.nn.Linear(4, 20, bias=False)
    hidden = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    choices = lm_head(hidden).argmax(-1)
    tokens = torch.tensor([9, 1, 2, 3, 4, 5])
    tokens[2] = choices[0]  # node 2 is what the base picks after the root
    tokens[4] = choices[2]  # and node 4 after node 2
    tokens[1] = (choices[0] + 1) % 20
    tokens[5] = (choices[4] + 1) % 20
    best, bonus = greedy_verify(spec, tokens, hidden, lm_head)
    assert int(best) == 4 and int(bonus) == int(choices[4])
    for accepted_leaf in (False, True):  # one LM-head pass over every row finds the same node and bonus
        if accepted_leaf:
            tokens[5] = choices[4]  # node 5, a leaf, is accepted: its row gives the bonus token
        two = greedy_verify(spec, tokens, hidden, lm_head)
        one = greedy_verify(spec, tokens, hidden, lm_head, one_pass=True)
        assert (
            [int(x) for x in one]
            == [int(x) for x in two]
            == [5 if accepted_leaf else 4, int(choices[5 if accepted_leaf else 4])]
        )


def test_the_cost_curve_prices_the_lm_head_passes_greedy_verification_runs():
    cpu = CostCurve((1, 3, 4, 8), (1.0, 1.05, 1.3, 1.5), (0.1, 0.11, 0.16, 0.3))  # few rows cost one row's time
    assert cpu.one_lm_pass(3, 2)  # 0.11 for one pass against 0.1 + 0.1 for two
    assert not cpu.one_lm_pass(8, 1)  # 0.3 against 0.2
    assert cpu.tree_step(3, 2) == pytest.approx(cpu.body(3) + cpu.lm_head(3))
    assert cpu.tree_step(8, 1) == pytest.approx(cpu.body(8) + 2 * cpu.lm_head(1))
    assert cpu.tree_step(1, 0) == pytest.approx(cpu.verify(1, 1))  # plain decoding: one row


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_forward_and_cache_compaction_match_plain_forwards(models, arch):
    base = models[arch][0]
    prefix = [3, 17, 99, 250, 4, 42, 7]
    parents = (-1, 0, 0, 1, 1, 2, 3, 5)
    tokens = [60, 61, 62, 63, 64, 65, 66, 67]
    runner = BaseRunner(base)
    with torch.inference_mode():
        runner.forward(torch.tensor([prefix]))
        spec = build_tree_spec(parents, base.dtype, base.device)
        past = runner.length
        hidden = runner.forward(torch.tensor([tokens]), attention_mask_4d(spec, past), position_ids(spec, past))
        tree_logits = runner.logits(hidden)[0]
        for node, path in enumerate(spec.paths):
            sequence = prefix + [tokens[j] for j in path]
            reference = base.model(torch.tensor([sequence])).logits[0, -1]
            torch.testing.assert_close(tree_logits[node], reference, atol=1e-4, rtol=1e-4)
        # Keep the path to node 7 (0 -> 2 -> 5 -> 7): not contiguous, so rows are gathered.
        path = spec.paths[7]
        keep_cache_path(runner.cache, past, path)
        assert runner.length == len(prefix) + len(path)
        plain = BaseRunner(base)
        plain.forward(torch.tensor([prefix + [tokens[j] for j in path]]))
        for ours, theirs in zip(runner.cache.layers, plain.cache.layers):
            torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-4)
        # And decoding continues identically from the compacted cache.
        nxt = torch.tensor([[123]])
        torch.testing.assert_close(
            runner.logits(runner.forward(nxt)), plain.logits(plain.forward(nxt)), atol=1e-4, rtol=1e-4
        )
        # A contiguous path (0 -> 1 -> 3) is a plain crop.
        runner2 = BaseRunner(base)
        runner2.forward(torch.tensor([prefix]))
        runner2.forward(torch.tensor([tokens]), attention_mask_4d(spec, past), position_ids(spec, past))
        keep_cache_path(runner2.cache, past, (0, 1, 2))
        assert runner2.length == past + 3


# ------------------------------------------------------------------------------------------- sampling


def test_sampling_probs_matches_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)]:
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        torch.testing.assert_close(sampling_probs(logits, temperature, top_p), scores.softmax(-1))


def pooled_chisquare(counts: dict, expected: dict, total: int) -> float:
    """p-value of a chi-square goodness-of-fit test, pooling cells expected to hold fewer than 5 samples."""
    observed, wanted, small_obs, small_exp = [], [], 0, 0.0
    for cell, probability in expected.items():
        if probability * total >= 5:
            observed.append(counts.get(cell, 0))
            wanted.append(probability * total)
        else:
            small_obs += counts.get(cell, 0)
            small_exp += probability * total
    small_obs += sum(c for cell, c in counts.items() if cell not in expected)
    if small_exp > 0:
        observed.append(small_obs)
        wanted.append(small_exp)
    elif small_obs > 0:
        return 0.0  # outcomes the law gives probability zero
    return float(chisquare(observed, [w * sum(observed) / sum(wanted) for w in wanted]).pvalue)


def test_sample_accept_is_lossless_on_a_fixed_tree():
    """Tree rejection sampling alone: the first two emitted tokens follow the target distribution."""
    generator = torch.Generator().manual_seed(0)
    vocab = 5
    spec = build_tree_spec((-1, 0, 0, 1, 1, 2), torch.float32, torch.device("cpu"))
    tokens = torch.tensor([0, 1, 2, 3, 1, 4])
    probs = torch.softmax(torch.randn(6, vocab, generator=generator) * 1.5, dim=-1)
    node_of_child = {1: 1, 2: 2}  # token emitted after the root -> the node that drafted it
    counts: dict[tuple[int, int], int] = {}
    trials = 12000
    for _ in range(trials):
        uniforms = torch.rand(6, generator=generator)
        best, bonus = sample_accept(spec, tokens, probs, uniforms, generator)
        emitted = [int(tokens[j]) for j in spec.paths[int(best)][1:]] + [int(bonus)]
        cell = (emitted[0], emitted[1] if len(emitted) > 1 else -1)
        counts[cell] = counts.get(cell, 0) + 1
    expected = {}
    for x1 in range(vocab):
        if x1 in node_of_child:
            for x2 in range(vocab):
                expected[(x1, x2)] = float(probs[0, x1] * probs[node_of_child[x1], x2])
        else:
            expected[(x1, -1)] = float(probs[0, x1])
    assert pooled_chisquare(counts, expected, trials) > 1e-3


@pytest.fixture(scope="module")
def tiny_vocab_base(tiny_tokenizer) -> BaseModel:
    """An 8-token vocabulary model (no EOS) so that the joint law of three tokens can be enumerated."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    base = BaseModel(model=model, tokenizer=tiny_tokenizer, fingerprint="tiny-vocab", path=Path("tiny-vocab"))
    return perturb(base, seed=3, std=0.5)


def exact_three_token_law(base: BaseModel, prompt: list[int], temperature: float, top_p: float) -> dict:
    vocab = base.vocab_size
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # (V*V, 2): x1, x2
    sequences = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logits = base.model(sequences).logits[:, -3:]  # after the prompt, after x1, after x2
    probs = sampling_probs(logits, temperature, top_p)
    law = {}
    for row, (x1, x2) in enumerate(pairs.tolist()):
        p12 = float(probs[row, 0, x1] * probs[row, 1, x2])
        for x3 in range(vocab):
            law[(x1, x2, x3)] = p12 * float(probs[row, 2, x3])
    return law


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.85)])
def test_ams_sampling_distribution_equals_base(tiny_vocab_base, temperature, top_p):
    """Over many seeds, AMS-LD's first three sampled tokens follow the base's own sampling law (chi-square),
    while the first step verified a whole tree (tokens 2 and 3 come from tree acceptance)."""
    base = tiny_vocab_base
    heads = noisy_heads(base, seed=7)
    policy = AmsPolicy(top_k=3, max_nodes=10, cost_aware=False)
    prompt = [3, 1, 4, 1, 5]
    law = exact_three_token_law(base, prompt, temperature, top_p)
    trials = 1500
    counts: dict[tuple[int, ...], int] = {}
    multi = 0
    for seed in range(trials):
        result = generate(
            base,
            torch.tensor(prompt),
            heads=heads,
            policy=policy,
            max_new_tokens=3,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            degeneration_guard=False,
        )
        key = tuple(result.tokens)
        counts[key] = counts.get(key, 0) + 1
        multi += result.base_forwards == 1
    assert multi > trials // 4  # often two tokens accepted in one tree step
    assert pooled_chisquare(counts, law, trials) > 1e-3
    # The same samples are clearly rejected as draws from a different law (the test has power).
    other = exact_three_token_law(base, prompt, temperature * 1.6, top_p)
    assert pooled_chisquare(counts, other, trials) < 1e-6


def test_sampling_is_reproducible_with_a_seed(models):
    base, heads, _ = models["llama"]
    runs = [
        generate(
            base, torch.tensor([5, 6, 7]), heads=heads, temperature=0.9, top_p=0.95, seed=11, max_new_tokens=24
        ).tokens
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len(runs[0]) > 0


# ----------------------------------------------------------------------------------- fallbacks, errors


def test_fallback_to_greedy_with_a_warning(models, tmp_path):
    base, heads, _ = models["llama"]
    other_base = models["qwen2"][0]
    prompt = torch.tensor([9, 8, 7])
    reference = generate(base, prompt, mode="greedy", max_new_tokens=12)
    with pytest.warns(DecodingFallbackWarning, match="needs lookahead heads"):
        result = generate(base, prompt, mode="ams", heads=None, max_new_tokens=12)
    assert result.mode == "greedy" and result.tokens == reference.tokens
    foreign = DraftHeads.fresh(other_base, 2)
    with pytest.warns(DecodingFallbackWarning, match="trained for base"):
        result = generate(base, prompt, mode="ams", heads=foreign, max_new_tokens=12)
    assert result.mode == "greedy" and result.tokens == reference.tokens
    # Loading heads saved for another base: DraftHeads.load refuses, load_heads warns and gives None.
    foreign.save(tmp_path / "foreign")
    with pytest.warns(DecodingFallbackWarning, match="trained for base"):
        assert load_heads(tmp_path / "foreign", base) is None
    with pytest.warns(DecodingFallbackWarning, match="no heads"):
        assert load_heads(tmp_path / "missing", base) is None
    heads.save(tmp_path / "own")
    assert load_heads(tmp_path / "own", base) is not None


def test_heads_of_another_instance_of_the_same_checkpoint_are_rebound(tiny_base_dir):
    first, second = (load_base(tiny_base_dir, device="cpu") for _ in range(2))
    heads = noisy_heads(first, seed=1)
    prompt = torch.tensor([5, 6, 7, 8])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DecodingFallbackWarning)
        result = generate(second, prompt, heads=heads, max_new_tokens=20, degeneration_guard=False)
    assert result.mode == "ams"
    assert result.tokens == generate(second, prompt, mode="greedy", max_new_tokens=20, degeneration_guard=False).tokens


def test_prompt_and_argument_errors(models):
    base = models["llama"][0]
    with pytest.raises(FedLookaheadError, match="empty prompt"):
        generate(base, torch.tensor([], dtype=torch.long))
    with pytest.raises(FedLookaheadError, match="context is 512"):
        generate(base, torch.ones(600, dtype=torch.long), mode="greedy")
    with pytest.raises(FedLookaheadError, match="batch size 1"):
        generate(base, torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(FedLookaheadError, match="unknown decoding mode"):
        generate(base, torch.tensor([1, 2]), mode="jacobi")
    with pytest.raises(FedLookaheadError, match="temperature"):
        generate(base, torch.tensor([1, 2]), temperature=-1.0)
    for message in ("empty prompt", "context is 512"):
        try:
            generate(base, torch.ones(0 if message.startswith("empty") else 600, dtype=torch.long))
        except FedLookaheadError as exc:
            assert "\n" not in str(exc)


def test_generation_stops_at_the_context_length(models):
    base, heads, _ = models["gpt2"]
    prompt = torch.arange(1, 501) % (TINY_VOCAB - 1) + 1
    for mode in ("greedy", "ams"):
        result = generate(base, prompt, mode=mode, heads=heads, max_new_tokens=50, degeneration_guard=False)
        assert len(result.tokens) <= 512 - 500 and result.stop_reason in ("context", "eos")


# --------------------------------------------------------------------------------------- stopping rules


def test_stop_strings(models):
    base, heads, _ = models["llama"]
    prompt = torch.tensor(list(range(30, 50)))
    full = generate(base, prompt, mode="greedy", max_new_tokens=40, degeneration_guard=False)
    stop = base.tokenizer.decode(full.tokens[12:14], skip_special_tokens=True).strip() or full.text[-3:]
    results = [
        generate(base, prompt, mode=mode, heads=heads, max_new_tokens=40, stop_strings=[stop], degeneration_guard=False)
        for mode in ("greedy", "ams")
    ]
    assert results[0].tokens == results[1].tokens
    for result in results:
        assert result.stop_reason == "stop_string" and stop in result.text
        assert full.tokens[: len(result.tokens)] == result.tokens
        assert stop not in base.tokenizer.decode(result.tokens[:-1], skip_special_tokens=True)


def test_degeneration_guard(tiny_base):
    """A freshly initialised tiny model loops on one token: the guard stops it; switched off, it runs on."""
    heads = DraftHeads.fresh(tiny_base, 2)
    prompt = torch.tensor([11, 12, 13])
    for mode in ("greedy", "ams"):
        guarded = generate(tiny_base, prompt, mode=mode, heads=heads, max_new_tokens=160)
        free = generate(tiny_base, prompt, mode=mode, heads=heads, max_new_tokens=160, degeneration_guard=False)
        assert guarded.stop_reason == "degeneration" and len(guarded.tokens) < 160
        assert len(free.tokens) == 160 and free.tokens[: len(guarded.tokens)] == guarded.tokens
    guard = DegenerationGuard(max_period=4, repeats=3, min_span=8)
    assert guard.looping([1, 2, 3] + [7, 8] * 4)
    assert not guard.looping([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert not guard.looping([7, 8] * 3)  # shorter than the minimum span


def test_eos_stops_generation(models):
    base, heads, _ = models["llama"]
    prompt = [40, 41, 42]
    reference = generate(base, torch.tensor(prompt), mode="greedy", max_new_tokens=10, degeneration_guard=False)
    eos = reference.tokens[4]
    base.model.generation_config.eos_token_id = eos
    try:
        for mode in ("greedy", "ams"):
            result = generate(base, torch.tensor(prompt), mode=mode, heads=heads, max_new_tokens=10)
            assert result.stop_reason == "eos" and result.tokens == reference.tokens[: reference.tokens.index(eos) + 1]
        assert hf_greedy(base, prompt, 10) == result.tokens
    finally:
        base.model.generation_config.eos_token_id = base.tokenizer.eos_token_id


def test_drafter_candidates_are_the_heads_own_top_k_step_by_step(models):
    """Depth 1 holds head 1's top-k after fusing the root; depth 2 the top-k of the best depth-1 node's
    own continuation (the recurrent heads fuse the drafted token), each with its path log-probability."""
    base, heads, _ = models["qwen2"]
    k = 3
    drafter = HeadsTreeDrafter(heads, AmsPolicy(top_k=k, beam=2))
    hidden, token = torch.randn(base.hidden_size), torch.tensor(17)
    values = drafter.draft_inputs(hidden.view(1, -1), token.view(1)).tolist()
    m = len(values) // 3
    tokens, parents, logp = values[:m], values[m : 2 * m], values[2 * m :]
    assert m == k + 2 * k * (heads.num_heads - 1)
    state, head_state = heads.step(token.view(1), hidden.view(1, -1), 1)
    first = torch.log_softmax(heads.draft_logits(head_state)[0], -1).topk(k)
    assert tokens[:k] == heads.draft_ids[first.indices].tolist() and parents[:k] == [-1] * k
    torch.testing.assert_close(torch.tensor(logp[:k], dtype=torch.float64), first.values.double(), atol=1e-5, rtol=0)
    _, head_state = heads.step(torch.tensor([int(tokens[0])]), state, 2)
    second = torch.log_softmax(heads.draft_logits(head_state)[0], -1).topk(k)
    assert tokens[k : 2 * k] == heads.draft_ids[second.indices].tolist() and parents[k : 2 * k] == [0] * k
    torch.testing.assert_close(
        torch.tensor(logp[k : 2 * k], dtype=torch.float64), logp[0] + second.values.double(), atol=1e-5, rtol=0
    )


def test_drafter_drafts_one_depth_beyond_the_deepest_head_node_verified(models):
    """The number of lookahead steps adapts: after a tree whose deepest head node is at depth 1, the
    next step drafts depths 1-2 only; after a full-depth tree, every head again."""
    base, heads, _ = models["qwen2"]
    drafter = HeadsTreeDrafter(heads, AmsPolicy(top_k=1, beam=1, ngram=False, cost_aware=False, min_path_prob=0.0))
    hidden, token = torch.randn(1, base.hidden_size), torch.tensor([17])

    def depths_drafted(max_nodes: int) -> int:
        drafter.policy = AmsPolicy(
            top_k=1, beam=1, ngram=False, cost_aware=False, min_path_prob=0.0, max_nodes=max_nodes
        )
        values = drafter.draft_inputs(hidden, token).tolist()
        drafter.propose(5, values, [1, 2, 5], max_depth=8)
        return len(values) // 3  # one candidate per depth with top_k = beam = 1

    assert depths_drafted(max_nodes=1) == heads.num_heads  # the tree takes the depth-1 node only
    assert depths_drafted(max_nodes=heads.num_heads) == 2  # ... so two depths, of which the tree takes both
    assert depths_drafted(max_nodes=heads.num_heads) == 3
    assert depths_drafted(max_nodes=1) == heads.num_heads


def _lattice(probabilities: list[list[float]]) -> list[Candidate]:
    """A chain-of-siblings candidate list: at depth d, siblings with these path probabilities under node d-1's best."""
    out: list[Candidate] = []
    parent = -1
    for depth, row in enumerate(probabilities, start=1):
        first = len(out)
        out += [Candidate(10 * depth + r, parent, depth, p, head_p=p) for r, p in enumerate(row)]
        parent = first
    return out


def test_choose_tree_maximises_expected_tokens_per_second():
    candidates = _lattice([[0.7, 0.2], [0.5, 0.1], [0.3]])
    fixed = 0.1
    for curve in (
        CURVES["flat"],
        CURVES["steep"],
        CostCurve((1, 2, 4, 8), (1.0, 1.2, 1.6, 1.9), (0.1, 0.1, 0.15, 0.2)),
    ):
        chosen = choose_tree(candidates, curve, max_nodes=32, min_prob=0.0, fixed_seconds=fixed)
        order = sorted(range(len(candidates)), key=lambda i: -candidates[i].estimate)
        assert chosen == order[: len(chosen)]  # a prefix in order of estimate: parents come first

        def value(n: int, order: list[int] = order, curve: CostCurve = curve) -> float:
            nodes = [candidates[i] for i in order[:n]]
            internal = len({c.parent for c in nodes})
            return (1 + sum(c.estimate for c in nodes)) / (curve.tree_step(n + 1, internal) + fixed)

        assert value(len(chosen)) == pytest.approx(max(value(n) for n in range(len(order) + 1)))
    assert choose_tree(candidates, CURVES["steep"], 32, 0.0, fixed) == []  # nothing pays: plain decoding
    assert len(choose_tree(candidates, CURVES["flat"], 32, 0.0, fixed)) == len(candidates)
    # Without a curve: a fixed budget by confidence.
    assert choose_tree(candidates, None, max_nodes=2, min_prob=0.0, fixed_seconds=0.0) == [0, 2]
    assert [candidates[i].estimate for i in choose_tree(candidates, None, 32, 0.25, 0.0)] == [0.7, 0.5, 0.3]


def test_cost_aware_decoding_falls_back_to_plain_steps_when_no_tree_pays(models):
    base, heads, _ = models["llama"]
    prompt = list(range(5, 25))
    steep = generate(
        base,
        torch.tensor(prompt),
        heads=heads,
        max_new_tokens=24,
        degeneration_guard=False,
        policy=AmsPolicy(ngram=False),
        curve=CURVES["steep"],
    )
    assert steep.tokens == hf_greedy(base, prompt, 24)
    assert steep.stats["plain_steps"] == steep.stats["steps"] and steep.stats["nodes"] == 0
    flat = generate(
        base,
        torch.tensor(prompt),
        heads=heads,
        max_new_tokens=24,
        degeneration_guard=False,
        policy=AmsPolicy(ngram=False),
        curve=CURVES["flat"],
    )
    assert flat.tokens == steep.tokens and flat.stats["nodes"] > 0


def test_policy_validation():
    with pytest.raises(ValueError):
        AmsPolicy(beam=0)
    with pytest.raises(ValueError):
        AmsPolicy(min_path_prob=1.5)
    with pytest.raises(ValueError):
        AmsPolicy(ngram_min_len=0)


def test_ngram_index_continues_the_most_recent_match():
    index = NgramIndex((3, 2, 1))
    context = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3]
    assert index.lookup(context, 3) == [4, 6, 7]  # "2 3" last occurred before "4 6 7"
    assert index.lookup(context + [4, 6], 2) == [7, 2]  # grown incrementally: "3 4 6" matched
    assert NgramIndex((3, 2, 1)).lookup([5, 6, 5, 6, 5], 5) == [6, 5, 6, 5, 6]  # a loop continues periodically
    assert NgramIndex((2,)).lookup([1, 2, 3], 4) == []


# ------------------------------------------------------------------------------------- other modes


def test_fused_and_beam_modes(models):
    base, heads, _ = models["llama"]
    prompt = torch.tensor([21, 22, 23, 24])
    greedy = generate(base, prompt, mode="greedy", max_new_tokens=16, degeneration_guard=False)
    neutral = generate(
        base,
        prompt,
        mode="fused",
        heads=heads,
        max_new_tokens=16,
        degeneration_guard=False,
        policy=AmsPolicy(fused_alpha=0.0),
    )
    assert neutral.mode == "fused" and neutral.tokens == greedy.tokens  # alpha 0: P' = P
    policy = AmsPolicy(fused_alpha=3.0, fused_top_m=3)
    fused = generate(
        base, prompt, mode="fused", heads=heads, max_new_tokens=16, degeneration_guard=False, policy=policy
    )
    assert 0 < len(fused.tokens) <= 16
    # The fused rule re-ranks only the base's own top-m candidates: every choice is one of them.
    context = prompt.tolist()
    with torch.no_grad():
        for token in fused.tokens:
            logits = base.model(input_ids=torch.tensor([context])).logits[0, -1]
            assert token in torch.topk(logits, policy.fused_top_m).indices.tolist()
            context.append(token)
    assert fused.tokens != greedy.tokens[: len(fused.tokens)]  # alpha 3 does change some choice here
    one_beam = generate(
        base, prompt, mode="beam", max_new_tokens=16, policy=AmsPolicy(beam_width=1), degeneration_guard=False
    )
    assert one_beam.tokens == greedy.tokens
    beam = generate(
        base, prompt, mode="beam", max_new_tokens=16, policy=AmsPolicy(beam_width=3), degeneration_guard=False
    )
    ids = prompt.view(1, -1)
    reference = base.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=3,
        early_stopping=True,
        do_sample=False,
        max_new_tokens=16,
        pad_token_id=0,
    )
    assert beam.tokens == reference[0, ids.shape[1] :].tolist()[: len(beam.tokens)] and beam.tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_half_precision_runs_and_fp32_is_exact(tiny_base_dir):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        base = load_base(tiny_base_dir, device="cuda", dtype=dtype)
        perturb(base, seed=1)
        base.model.to("cuda", dtype)
        heads = DraftHeads.fresh(base, 3)
        prompt = list(range(3, 20))
        result = generate(base, torch.tensor(prompt), heads=heads, max_new_tokens=32, degeneration_guard=False)
        # the perturbed tiny model may draw its EOS early (it did on an H200); generate stops there too
        assert result.mode == "ams" and result.tokens
        assert len(result.tokens) == 32 or result.stop_reason == "eos"
        if dtype == torch.float32:
            ids = torch.tensor([prompt], device="cuda")
            out = base.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32, pad_token_id=0
            )
            assert result.tokens == out[0, len(prompt) :].tolist()
        sampled = generate(base, torch.tensor(prompt), heads=heads, max_new_tokens=16, temperature=0.8, seed=0)
        assert len(sampled.tokens) == 16 or sampled.stop_reason == "eos"


# ------------------------------------------------------------------------------------------------ CLI


@pytest.fixture(scope="module")
def cli_heads(tmp_path_factory, tiny_base) -> Path:
    return DraftHeads.fresh(tiny_base, 2).save(tmp_path_factory.mktemp("cli-heads"))


def test_cli_generate(tiny_base_dir, cli_heads, tmp_path, monkeypatch):
    runner = CliRunner()
    common = ["generate", "--base", str(tiny_base_dir), "--device", "cpu", "--max-new-tokens", "8"]
    result = runner.invoke(app, common + ["--prompt", "def add(a, b):", "--heads", str(cli_heads)])
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.output and "tau" in result.output and "[ams]" in result.output
    with monkeypatch.context() as patch:  # what is tested is the wiring; compiling is test_compiled_ams_*'s
        patch.setattr(torch, "compile", lambda module, **kwargs: module)
        compiled = runner.invoke(app, common + ["--prompt", "def add(a, b):", "--heads", str(cli_heads), "--compiled"])
    assert compiled.exit_code == 0 and "[ams]" in compiled.output, compiled.output
    assert compiled.output.splitlines()[0] == result.output.splitlines()[0]  # the same text
    own_files = tmp_path / "own"
    own_files.mkdir()
    (own_files / "add.py").write_text("def add(a, b):\n    return a + b\n" * 8)
    monkeypatch.setenv("FEDLA_HOME", str(tmp_path / "home"))
    stored = runner.invoke(
        app, common + ["--prompt", "def add(a, b):", "--heads", str(cli_heads), "--datastore", str(own_files)]
    )
    assert stored.exit_code == 0 and "steps drafted from the datastore" in stored.output, stored.output
    assert stored.output.splitlines()[0] == result.output.splitlines()[0]  # lossless: the same text
    assert list((tmp_path / "home" / "datastores").glob("datastore-*.npz"))  # indexed once, cached
    prompt_file = tmp_path / "prompt.py"
    prompt_file.write_text("import os\n")
    monkeypatch.setenv("FEDLA_HEADS", str(tmp_path / "no-heads-here"))
    result = runner.invoke(app, common + ["--prompt-file", str(prompt_file)])
    assert result.exit_code == 0 and "[greedy]" in result.output and "warning" in result.output
    for args, message in [
        (["--prompt", ""], "empty prompt"),
        (["--prompt", "x " * 2000], "context"),
        (["--prompt", "x", "--mode", "jacobi"], "unknown mode"),
    ]:
        result = runner.invoke(app, common + args)
        assert result.exit_code == 2 and message in result.output, result.output
    result = runner.invoke(app, ["generate", "--base", str(tiny_base_dir), "--device", "tpu", "--prompt", "x"])
    assert result.exit_code == 2 and "unknown device" in result.output


def test_cli_generate_streams_the_text_and_keeps_it_on_ctrl_c(tiny_base_dir, cli_heads, monkeypatch):
    """The text goes to stdout as the decoder accepts it, the stats line to stderr; Ctrl-C keeps what was shown."""
    from common.decoding import streaming

    runner = CliRunner()
    command = ["generate", "--base", str(tiny_base_dir), "--device", "cpu", "--max-new-tokens", "12"]
    command += ["--prompt", "def add(a, b):", "--heads", str(cli_heads), "--no-guard"]
    shown: list[str] = []
    real_update = streaming.TextStream.update

    def spy(self, tokens):
        before = self.sent
        real_update(self, tokens)
        if self.sent != before:
            shown.append(self.sent[len(before) :])

    monkeypatch.setattr(streaming.TextStream, "update", spy)
    result = runner.invoke(app, command)
    assert result.exit_code == 0, result.output
    assert len(shown) > 1  # printed in pieces while decoding, not once at the end
    assert "tokens/s" in result.stderr and "tokens/s" not in result.stdout
    assert result.stdout.startswith("".join(shown)) and result.stdout.strip()

    def interrupted(self, tokens):
        real_update(self, tokens)
        if len(tokens) >= 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(streaming.TextStream, "update", interrupted)
    result = runner.invoke(app, command)
    assert result.exit_code == 130
    assert "interrupted: the " in result.stderr and "characters above are what was generated" in result.stderr
    kept = int(result.stderr.split("interrupted: the ")[1].split()[0])
    assert len(result.stdout) == kept + 1 and result.stdout.endswith("\n")  # the text shown, then a line end


def test_cli_bench_decode(tiny_base_dir, cli_heads, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for path in stdlib_files("heldout")[:3]:
        shutil.copy(path, data / path.name)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        app,
        [
            "bench-decode",
            "--data",
            str(data),
            "--base",
            str(tiny_base_dir),
            "--heads",
            str(cli_heads),
            "--prompts",
            "2",
            "--prompt-tokens",
            "16",
            "--max-new-tokens",
            "8",
            "--device",
            "cpu",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert set(summary) == {
        "modes",
        "reference",
        "temperature",
        "speedup",
        "speedup_without_loops",
        "prompts",
        "prompt_tokens",
        "max_new_tokens",
        "cost_curve",
        "outputs_ending_in_a_loop",
        "loop_share",
        "benchmark_set",
        "hardware",
    }
    assert summary["hardware"]["cpu"]["model"] and summary["hardware"]["precision"] == "float32"
    assert summary["reference"] == "hf_greedy" and summary["temperature"] == 0.0
    assert summary["loop_share"] == summary["outputs_ending_in_a_loop"] / 2
    assert summary["prompt_tokens"] == [16, 16]
    assert len(summary["benchmark_set"]["prompt_files"]) == 2
    assert set(summary["modes"]) == {"hf_greedy", "hf_prompt_lookup", "greedy", "ams", "ams_heads_only"}
    assert summary["cost_curve"]["1"] == 1.0 and all(c > 0 for c in summary["cost_curve"].values())
    assert set(summary["speedup"]) == set(summary["speedup_without_loops"]) == set(summary["modes"])
    for row in summary["modes"].values():
        assert set(row) == {"tokens_per_s", "tau", "identical_to_hf_greedy", "mismatches", "divergences"}
        assert row["identical_to_hf_greedy"] is True and row["mismatches"] == 0 and row["tokens_per_s"] > 0
    assert summary["prompts"] == 2 and summary["max_new_tokens"] == 8


def test_cli_bench_decode_default_set_datastore_and_sampling(tiny_base_dir, cli_heads, tmp_path, monkeypatch):
    """The default prompts are the third-party held-out packages, listed with their rule; --datastore indexes
    a folder without the prompts' own files; --temperature benchmarks against sampling generate."""
    from common.data.packages import packages

    monkeypatch.setenv("FEDLA_HOME", str(tmp_path / "home"))
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    for path in stdlib_files("heldout")[:3]:
        shutil.copy(path, store_dir / path.name)
    common = ["--base", str(tiny_base_dir), "--heads", str(cli_heads), "--prompts", "2", "--prompt-tokens", "16"]
    common += ["--max-new-tokens", "8", "--device", "cpu"]
    out = tmp_path / "third_party.json"
    result = CliRunner().invoke(app, ["bench-decode", *common, "--modes", "hf_greedy,ams", "--json", str(out)])
    assert result.exit_code == 0, result.output
    described = json.loads(out.read_text())["benchmark_set"]
    assert described["name"] == "third-party held-out" and described["packages"] == packages("heldout")
    assert all(any(f"/{name}/" in path for name in described["packages"]) for path in described["prompt_files"])

    out = tmp_path / "store.json"
    result = CliRunner().invoke(
        app, ["bench-decode", *common, "--data", str(store_dir), "--datastore", str(store_dir), "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert {"ams_datastore", "ams_datastore_only"} <= set(summary["modes"])
    assert summary["datastore"]["files"] == 3 - len(summary["benchmark_set"]["prompt_files"])  # prompts left out
    assert all(row["identical_to_hf_greedy"] for row in summary["modes"].values())

    out = tmp_path / "sampled.json"
    result = CliRunner().invoke(app, ["bench-decode", *common, "--temperature", "0.7", "--json", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert summary["reference"] == "hf_sample" and set(summary["modes"]) == {
        "hf_sample",
        "hf_prompt_lookup_sample",
        "ams",
        "ams_heads_only",
    }
    assert all(set(row) == {"tokens_per_s", "tau"} for row in summary["modes"].values())
    result = CliRunner().invoke(app, ["bench-decode", *common, "--temperature", "0.7", "--modes", "hf_sample,greedy"])
    assert result.exit_code != 0 and "greedy-only" in result.output


def test_bench_compiled_modes_match_greedy(tiny_base):
    """transformers' static-cache + torch.compile greedy (hf_compiled) and AMS-LD under the same settings
    (ams_compiled) run on a CPU too and give generate's tokens."""
    base = perturb(load_base(tiny_base.path, device="cpu"), seed=4)
    prompts = [torch.arange(3, 3 + n) for n in (12, 9)]
    modes = ("hf_greedy", "hf_compiled", "ams_compiled")
    summary = decode_benchmark(Setting(base, noisy_heads(base, 0)), prompts, 8, modes=modes, progress=False)
    for mode in modes[1:]:
        row = summary["modes"][mode]
        assert row["identical_to_hf_greedy"] and row["tokens_per_s"] > 0


@pytest.mark.measured_cost_curve
def test_cost_curve_is_measured_once_monotone_and_a_damaged_cache_is_remeasured(tmp_path, models):
    from common.decoding.calibration import calibration_key, cost_curve

    base = models["llama"][0]
    curve = cost_curve(base, directory=tmp_path)
    assert curve.key == calibration_key(base) and curve.sizes[0] == 1
    assert all(a <= b for a, b in zip(curve.body_seconds, curve.body_seconds[1:]))  # more tokens never cost less
    assert all(a <= b for a, b in zip(curve.lm_head_seconds, curve.lm_head_seconds[1:]))
    assert curve.relative()[1] == 1.0 and curve.verify(4, 2) >= curve.verify(1, 1)
    path = tmp_path / f"{curve.key}.json"
    assert cost_curve(base, directory=tmp_path) == curve  # cached: the same curve, not re-timed
    path.write_text("{not json")
    remeasured = cost_curve(base, directory=tmp_path)
    assert remeasured.key == curve.key and CostCurve.from_json(json.loads(path.read_text())) == remeasured


@pytest.mark.measured_cost_curve
def test_an_implausible_cached_cost_curve_is_remeasured(tmp_path, models):
    """A cached curve where more tokens cost less (timed on a busy machine by an older version) would make
    every tree look unaffordable: it is measured again, not trusted."""
    from common.decoding.calibration import cost_curve

    base = models["llama"][0]
    curve = cost_curve(base, directory=tmp_path)
    path = tmp_path / f"{curve.key}.json"
    stale = dict(curve.to_json(), body_seconds=[0.176, 0.388, 0.986, 0.166, 0.71, 0.94, 1.08])
    path.write_text(json.dumps(stale))
    assert not CostCurve.from_json(stale).plausible()
    remeasured = cost_curve(base, directory=tmp_path)
    assert remeasured.plausible() and json.loads(path.read_text())["body_seconds"] == list(remeasured.body_seconds)
