"""What counts as a rounding tie when an output differs from greedy, per dtype."""

import pytest
import torch

from common.bench import NEAR_TIE, first_divergence, near_tie_gap


def test_fp32_tie_is_the_fixed_threshold():
    assert near_tie_gap(20.0, torch.float32) == NEAR_TIE


@pytest.mark.parametrize("dtype, bits", [(torch.bfloat16, 7), (torch.float16, 10)])
def test_low_precision_tie_is_two_ulps_of_the_top_logit(dtype, bits):
    ulp_at_16 = 16 * 2.0**-bits
    assert near_tie_gap(16.0, dtype) == pytest.approx(2 * ulp_at_16)
    assert near_tie_gap(-16.0, dtype) == near_tie_gap(16.0, dtype)


def test_first_divergence_reports_position_and_gap(tiny_base):
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = [9, 10, 11]
    divergence = first_divergence(tiny_base, ids, reference, [9, 12, 11])
    assert divergence["position"] == 1
    logits = tiny_base.model(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert divergence["top2_logit_gap"] == pytest.approx(float(top[0] - top[1]))
    assert divergence["near_tie"] == (divergence["top2_logit_gap"] <= NEAR_TIE)
