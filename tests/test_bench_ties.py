"""What counts as a rounding tie when an output differs from greedy, per dtype."""

import pytest
import torch

from common.decoding.fidelity import NEAR_TIE, DivergenceJudge, near_tie_gap
from common.model.base import load_base


def test_fp32_tie_is_the_fixed_threshold():
    assert near_tie_gap(20.0, torch.float32) == NEAR_TIE


@pytest.mark.parametrize("dtype, bits", [(torch.bfloat16, 7), (torch.float16, 10)])
def test_low_precision_tie_is_two_ulps_of_the_top_logit(dtype, bits):
    ulp_at_16 = 16 * 2.0**-bits
    assert near_tie_gap(16.0, dtype) == pytest.approx(2 * ulp_at_16)
    assert near_tie_gap(-16.0, dtype) == near_tie_gap(16.0, dtype)


def test_divergence_reports_position_and_gap(tiny_base):
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = [9, 10, 11]
    divergence = DivergenceJudge(tiny_base)(ids, reference, [9, 12, 11])
    assert divergence["position"] == 1
    logits = tiny_base.model(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert divergence["top2_logit_gap"] == pytest.approx(float(top[0] - top[1]))
    assert divergence["near_tie"] == (divergence["top2_logit_gap"] <= NEAR_TIE)
    assert "exact_gap" not in divergence  # fp32 is already exact arithmetic


@torch.no_grad()
def test_low_precision_divergence_is_judged_by_exact_arithmetic(tiny_base_dir):
    """Beyond two ulps, a bf16 divergence is a tie only if fp32 arithmetic on the same weights puts the
    two tokens within twice the rounding error; choosing the worst token is a bug, and judging it leaves
    the bf16 model untouched."""
    base = load_base(tiny_base_dir, device="cpu", dtype=torch.bfloat16)
    weights = {k: v.clone() for k, v in base.model.state_dict().items()}
    judge = DivergenceJudge(base)
    verdicts = []
    for start in range(5, 60, 3):  # prompts whose top-2 gap is beyond the ulp rule take the exact path
        ids = torch.tensor([[start, start + 1, start + 2]])
        logits = base.model(input_ids=ids).logits[0, -1].float()
        greedy, worst = int(logits.argmax()), int(logits.argmin())
        verdict = judge(ids, [greedy, 3], [worst, 3])
        if "exact_gap" in verdict:
            exact = judge._exact_model()(input_ids=ids).logits[0, -1]
            assert verdict["exact_gap"] == pytest.approx(float(exact[greedy] - exact[worst]))
            assert verdict["rounding_error"] < verdict["exact_gap"] / 2
            verdicts.append(verdict)
    assert verdicts, "no prompt reached the exact-arithmetic check"
    assert not any(v["near_tie"] for v in verdicts)
    assert all(v.dtype == torch.bfloat16 for v in base.model.state_dict().values() if v.is_floating_point())
    assert all(torch.equal(v, weights[k]) for k, v in base.model.state_dict().items())
