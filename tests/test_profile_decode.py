"""The decode profiler splits a run's wall time into parts that add up, and undoes its patches."""

import sys
from pathlib import Path

from common.data.chunks import prompts_from_files, stdlib_files
from common.decoding import AmsPolicy
from common.decoding.core import BaseRunner
from common.heads.lookahead import DraftHeads

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # simulations/ is a folder of scripts, not installed
from simulations.profile_decode import phase_timers, profile  # noqa: E402


def test_profile_parts_add_up_and_patches_are_undone(tiny_base):
    forward = BaseRunner.forward
    heads = DraftHeads.fresh(tiny_base, num_heads=2)
    prompts = prompts_from_files(stdlib_files("heldout"), tiny_base.tokenizer, 2, 16)
    report = profile(tiny_base, heads, prompts, max_new_tokens=12, policy=AmsPolicy(ngram=False))
    assert abs(sum(report["share"].values()) - 1) < 1e-3
    assert report["share"]["base body"] > 0 and report["share"]["lm head"] > 0 and report["share"]["drafting"] > 0
    assert report["greedy_ms_per_token"] > 0
    assert BaseRunner.forward is forward
    with phase_timers(tiny_base) as seconds:
        pass
    assert dict(seconds) == {} and BaseRunner.forward is forward
