"""analysis/attention_masks.mask_facts evaluates a compile-time mask over the scores' query and key
dims only, not over every batch and head: the check costs the mask's size, whatever the batch."""
import math

import pytest
import torch

from benchmarks.mask_facts_cost import ConstantMasks
from fxopt.analysis.attention_masks import MaskStep, NotAttention, mask_facts, over_scores

# scores [batch, heads, q, k] far too large to materialise: 2**46 booleans per query-key plane set
HUGE = (2**20, 2**20, 64, 64)


def _facts(steps, score_shape):
    return mask_facts(steps, ConstantMasks(), score_shape, requires_grad=lambda t: False)


def test_a_causal_fill_mask_is_recognised_without_expanding_to_every_batch_and_head():
    future = torch.ones(1, 1, 64, 64, dtype=torch.bool).triu(1)
    assert _facts([MaskStep("fill", future, value=-math.inf)], HUGE).causal


def test_an_additive_causal_mask_and_a_keep_mask_are_recognised_too():
    additive = torch.full((64, 64), -math.inf).triu(1)
    assert _facts([MaskStep("add", additive)], HUGE).causal
    keep = torch.ones(64, 64, dtype=torch.bool).tril()
    assert _facts([MaskStep("fill", keep, value=torch.finfo(torch.float32).min, negate=True)], HUGE).causal


def test_a_mask_that_differs_per_batch_is_still_checked_in_every_batch():
    """A [2, 1, q, k] mask keeps its batch dim: causal in batch 0, not in batch 1 -> not fused."""
    future = torch.ones(2, 1, 8, 8, dtype=torch.bool).triu(1)
    future[1, 0, 3, 1] = True  # batch 1 also hides a past key
    with pytest.raises(NotAttention, match="not causal"):
        _facts([MaskStep("fill", future, value=-math.inf)], (2, 4, 8, 8))
    assert _facts([MaskStep("fill", future[:1], value=-math.inf)], (2, 4, 8, 8)).causal


def test_a_mask_that_does_not_broadcast_to_the_scores_is_refused_with_its_shapes():
    with pytest.raises(NotAttention, match=r"does not broadcast to the scores \[2, 4, 8, 8\]"):
        _facts([MaskStep("fill", torch.ones(3, 1, 8, 8, dtype=torch.bool).triu(1), value=-math.inf)], (2, 4, 8, 8))


def test_over_scores_keeps_the_masks_own_leading_dims():
    assert over_scores(torch.zeros(8), (2, 4, 6, 8)).shape == (1, 1, 6, 8)
    assert over_scores(torch.zeros(2, 1, 1, 8), (2, 4, 6, 8)).shape == (2, 1, 6, 8)
    with pytest.raises(RuntimeError):
        over_scores(torch.zeros(1, 2, 4, 6, 8), (2, 4, 6, 8))  # more dims than the scores


def test_the_cost_benchmark_runs(capsys):
    """benchmarks/mask_facts_cost.py: both benchmark shapes recognised as causal (times not asserted)."""
    from benchmarks import mask_facts_cost

    mask_facts_cost.main()
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[1].strip() for r in rows] == ["True", "True"]
