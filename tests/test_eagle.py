"""The EAGLE drafter (fusion + one decoder layer): training equals drafting, decoding stays lossless, DP works."""

from __future__ import annotations

import pytest
import torch
from opacus import GradSampleModule

from common.data.features import compute_features
from common.decoding import AmsPolicy, generate
from common.errors import FedLookaheadError
from common.federation.records import heads_from_records, heads_records
from common.heads.lookahead import DraftHeads, HeadsConfig
from common.model.base import load_base
from common.training.loop import heads_loss
from tests.conftest import TINY_VOCAB, save_tiny
from tests.test_decoding import hf_greedy, noisy_heads, perturb, quickly_trained_heads


@pytest.fixture(scope="module")
def bases(tmp_path_factory, tiny_tokenizer):
    out = {}
    for index, arch in enumerate(("llama", "gpt2")):
        out[arch] = perturb(load_base(save_tiny(tmp_path_factory.mktemp(arch), tiny_tokenizer, arch), "cpu"), index + 1)
    return out


def test_layer_geometry_comes_from_the_base(bases):
    llama, gpt2 = bases["llama"], bases["gpt2"]
    assert DraftHeads.fresh(llama, 2, arch="eagle").config.layer == {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "rope_theta": 10000.0,
    }
    assert DraftHeads.fresh(gpt2, 2, arch="eagle").config.layer["intermediate_size"] == 4 * 64


def test_training_pass_equals_drafting_with_the_context_cache(bases):
    """Training-time test: head k at t in the teacher-forced pass is exactly what the drafter computes at
    depth k after committing the real rows <= t and drafting x_{t+2..t+k} speculatively, and step 1 from a
    cache of rows < t (the fused mode's view) equals committing row t."""
    base = bases["llama"]
    heads = noisy_heads(base, 0, arch="eagle", num_heads=3)
    tokens = torch.randint(0, TINY_VOCAB, (2, 12))
    hidden = base.features(tokens)
    with torch.no_grad():
        logits = heads(hidden, tokens)
        for b, t in ((0, 0), (1, 4), (0, 7)):
            cache = heads.new_cache()
            heads.commit(cache, hidden[b, :t], tokens[b, 1 : t + 1])
            spec_state, spec = heads.step(tokens[b, t + 1 : t + 2], hidden[b, t : t + 1], 1, cache)
            committed = heads.commit(cache, hidden[b, t : t + 1], tokens[b, t + 1 : t + 2])
            torch.testing.assert_close(spec, committed)
            torch.testing.assert_close(heads.draft_logits(committed)[0], logits[0][b, t])
            state = (committed, None, None)
            for k in range(2, heads.num_heads + 1):
                state, head_state = heads.step(tokens[b, t + k : t + k + 1], state, k, cache)
                torch.testing.assert_close(heads.draft_logits(head_state)[0], logits[k - 1][b, t])
            assert cache.keys.shape[1] == t + 1  # speculative rows never enter the context


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_ams_with_eagle_heads_is_lossless(bases, arch):
    """Greedy AMS-LD drafting with eagle heads (tree and n-gram chain) equals transformers' greedy."""
    base = bases[arch]
    heads = quickly_trained_heads(base, arch="eagle")
    generator = torch.Generator().manual_seed(3)
    accepted = 0
    for size in (1, 5, 17):
        prompt = torch.randint(1, TINY_VOCAB, (size,), generator=generator).tolist()
        for policy in (AmsPolicy(cost_aware=False, min_path_prob=0.0), AmsPolicy(ngram=False, cost_aware=False)):
            result = generate(base, torch.tensor(prompt), mode="ams", heads=heads, policy=policy, max_new_tokens=30)
            assert result.tokens == hf_greedy(base, prompt, 30)
            accepted += result.stats.get("accepted", 0)
    assert accepted > 0  # the drafts were actually verified and some accepted


def test_fused_mode_runs_on_eagle_heads(bases):
    """alpha = 0 makes the fused rule plain greedy: same tokens as transformers with the eagle cache in use."""
    base = bases["llama"]
    prompt = [5, 9, 14, 3]
    result = generate(
        base,
        torch.tensor(prompt),
        mode="fused",
        heads=noisy_heads(base, 0, arch="eagle", num_heads=3),
        policy=AmsPolicy(fused_alpha=0.0),
        max_new_tokens=12,
    )
    assert result.tokens == hf_greedy(base, prompt, 12)


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_opacus_per_sample_gradients_of_eagle_heads_match_autograd(bases):
    """Every layer of the drafter (Linear, RMSNorm; attention and rotary have no parameters) has an Opacus
    grad sampler: per-chunk gradients from GradSampleModule equal one-chunk-at-a-time autograd."""
    base = bases["llama"]
    heads = noisy_heads(base, 0, arch="eagle", num_heads=2)
    tokens = torch.randint(0, TINY_VOCAB, (3, 10))
    hidden = base.features(tokens)
    greedy = torch.randint(0, TINY_VOCAB, (3, 10))
    module = GradSampleModule(heads)
    heads_loss(module, hidden, tokens, greedy).backward()
    per_sample = {name: p.grad_sample.clone() for name, p in module.named_parameters()}
    module._close()
    for b in range(3):
        heads.zero_grad()
        heads_loss(heads, hidden[b : b + 1], tokens[b : b + 1], greedy[b : b + 1]).backward()
        for name, p in heads.named_parameters():
            # loss_reduction="mean": Opacus rescales to each chunk's own loss
            torch.testing.assert_close(per_sample[f"_module.{name}"][b], p.grad, atol=1e-5, rtol=1e-4)


def test_eagle_heads_train_under_dp_sgd(bases):
    """A DP round through client.training.local_round.train_round: Opacus accounts it and the layer's weights move."""
    from client.training.dp import PrivacyState
    from client.training.local_round import train_round
    from common.federation.config import FedConfig

    base = bases["llama"]
    heads = DraftHeads.fresh(base, 3, arch="eagle")
    sequences = torch.randint(1, TINY_VOCAB, (24, 16), generator=torch.Generator().manual_seed(1))
    features = compute_features(base, sequences, progress=False)
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    config = FedConfig(dp=True, dp_target_epsilon=8.0, batch_size=8, local_epochs=1, lr=1e-2, num_server_rounds=2)
    state = PrivacyState("t")
    first = train_round(heads, features, config, state)
    assert first.steps > 0 and 0 < first.epsilon < 8.0
    assert not torch.equal(before["layer.o_proj.weight"], heads.state_dict()["layer.o_proj.weight"])
    second = train_round(heads, features, config, state)  # the same heads again, as a device's next round
    assert first.epsilon < second.epsilon <= 8.0 + 1e-6


def test_eagle_heads_round_trip_on_disk_and_on_the_wire(bases, tmp_path):
    base = bases["llama"]
    heads = noisy_heads(base, 0, arch="eagle", num_heads=3)
    loaded = DraftHeads.load(heads.save(tmp_path / "h"), base)
    assert loaded.config == heads.config
    arrays, config = heads_records(heads)
    received = heads_from_records(arrays, config, base)
    assert received.config == heads.config
    for name, tensor in heads.state_dict().items():
        torch.testing.assert_close(received.state_dict()[name], tensor)


def test_layer_geometry_is_validated():
    common = dict(num_heads=2, hidden_size=64, vocab_size=100, base_fingerprint="x")
    with pytest.raises(FedLookaheadError, match="eagle heads need layer"):
        HeadsConfig(**common, arch="eagle")
    with pytest.raises(FedLookaheadError, match="recurrent heads have no decoder layer"):
        HeadsConfig(**common, layer={"num_attention_heads": 4})
    geometry = {"num_attention_heads": 5, "num_key_value_heads": 5, "intermediate_size": 8, "rope_theta": 1e4}
    with pytest.raises(FedLookaheadError, match="does not fit hidden size 64"):
        HeadsConfig(**common, arch="eagle", layer=geometry)


def test_a_server_cannot_size_the_eagle_layer_beyond_reason():
    """The heads' config comes from the server: an intermediate_size of 10**12 would be allocated by the
    device before anything else failed."""
    common = dict(num_heads=2, hidden_size=64, vocab_size=100, base_fingerprint="x", arch="eagle")
    geometry = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 10**12, "rope_theta": 1e4}
    with pytest.raises(
        FedLookaheadError, match=r"intermediate_size must be a whole number of at most 16 x .* \(1024\)"
    ):
        HeadsConfig(**common, layer=geometry)
    with pytest.raises(FedLookaheadError, match="intermediate_size must be a whole number"):
        HeadsConfig(**common, layer={**geometry, "intermediate_size": 128.5})
    assert HeadsConfig(**common, layer={**geometry, "intermediate_size": 1024}).layer["intermediate_size"] == 1024
