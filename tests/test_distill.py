"""Self-distilled chunks are the base's own greedy continuations, and training can mix them in."""

import pytest
import torch

import common.data.distill
from common.data.chunks import chunk_files, stdlib_files
from common.data.distill import greedy_continuations
from common.training.loop import fit_heads


@pytest.fixture
def fp32_extractor(monkeypatch):
    """Generate with the base itself, so the reference below runs in the same dtype."""
    monkeypatch.setattr(common.data.distill, "extractor_for", lambda base: base)


@torch.no_grad()
def full_forward_greedy(base, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """Reference: greedy by recomputing the whole sequence every step (no KV cache)."""
    ids = prompt.view(1, -1)
    for _ in range(new_tokens):
        next_id = base.model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0].tolist()


def test_continuations_equal_full_forward_greedy(tiny_base, fp32_extractor):
    prompts = chunk_files(stdlib_files("train")[:3], tiny_base.tokenizer, 12)[:5]
    out = greedy_continuations(tiny_base, prompts, new_tokens=9, batch_size=2, progress=False)
    assert out.shape == (5, 21)
    assert torch.equal(out[:, :12], prompts)
    for prompt, row in zip(prompts, out):
        assert row.tolist() == full_forward_greedy(tiny_base, prompt, 9)


def test_continuations_reject_bad_prompts(tiny_base):
    with pytest.raises(ValueError, match="non-empty"):
        greedy_continuations(tiny_base, torch.empty(0, 4, dtype=torch.long), 3)


def test_fit_heads_mixes_in_distilled_chunks(tiny_base, fp32_extractor, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLA_HOME", str(tmp_path))
    chunks = chunk_files(stdlib_files("train")[:4], tiny_base.tokenizer, 16)[:24]
    heads, report = fit_heads(
        tiny_base, chunks, chunks[:8], num_heads=2, draft_vocab_size=64, distill_chunks=10, show_progress=False
    )
    assert report["train_chunks"] == 34 and report["distill_chunks"] == 10
    assert len(report["heldout"]["head_accuracy"]) == 2
