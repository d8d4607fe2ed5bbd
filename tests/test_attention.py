"""common.model.attention: grouped key/value heads go to PyTorch's SDPA as they are, with the same results as
transformers' `sdpa` (which copies them per query head under a mask)."""

from __future__ import annotations

import pytest
import torch

from common.decoding.core import BaseRunner
from common.decoding.tree import attention_mask_4d, build_tree_spec, position_ids
from common.model.attention import GQA_ATTENTION
from common.model.base import load_base
from tests.conftest import save_tiny
from tests.test_decoding import perturb

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_cpu_bases_verify_trees_as_transformers_sdpa_does(tmp_path, tiny_tokenizer, arch):
    base = perturb(load_base(save_tiny(tmp_path, tiny_tokenizer, arch), device="cpu"), seed=3)
    assert base.model.config._attn_implementation == GQA_ATTENTION
    spec = build_tree_spec((-1, 0, 0, 1, 2, 2), base.dtype, base.device)
    tokens = torch.tensor([[60, 61, 62, 63, 64, 65]])
    logits = {}
    for attention in (GQA_ATTENTION, "sdpa"):
        base.model.set_attn_implementation(attention)
        with torch.inference_mode():
            runner = BaseRunner(base)
            prefill = runner.logits(runner.forward(torch.arange(3, 40).view(1, -1)))  # causal, no mask
            past = runner.length
            tree = runner.logits(runner.forward(tokens, attention_mask_4d(spec, past), position_ids(spec, past)))
            step = runner.logits(runner.forward(torch.tensor([[7]])))  # one token after the tree's rows
        logits[attention] = (prefill, tree, step)
    for ours, theirs in zip(logits[GQA_ATTENTION], logits["sdpa"]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
