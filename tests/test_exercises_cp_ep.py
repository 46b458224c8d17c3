"""Lessons 11 and 12's exercises: each grader passes the reference answer and catches wrong ones."""
import pytest
import torch

from minipar.lessons import exercises_cp_ep, solutions


def overflows(out1, lse1, out2, lse2):
    """Weighs each block by exp(lse_i) / (exp(lse1) + exp(lse2)): right until exp overflows."""
    w1, w2 = torch.exp(lse1), torch.exp(lse2)
    return (out1 * w1[..., None] + out2 * w2[..., None]) / (w1 + w2)[..., None], \
        torch.log(w1 + w2)


def averages(out1, lse1, out2, lse2):
    """Halves: as if both blocks had the same exp-sum."""
    return (out1 + out2) / 2, torch.logaddexp(lse1, lse2)


def masked_block_is_nan(out1, lse1, out2, lse2):
    """The right weights, but -inf - -inf = nan where a query sees no key of a block."""
    lse = torch.logaddexp(lse1, lse2)
    return out1 * torch.exp(lse1 - lse)[..., None] + out2 * torch.exp(lse2 - lse)[..., None], lse


def keeps_everything(scores, k, capacity):
    experts = torch.topk(scores, k, dim=-1).indices
    return experts, torch.ones_like(experts, dtype=torch.bool)


def keeps_the_last(scores, k, capacity):
    """Counts from the end of the sequence: the last slots of each expert kept."""
    experts, kept = solutions.route_with_capacity(scores.flip(0), k, capacity)
    return experts.flip(0), kept.flip(0)


def unsorted_top_k(scores, k, capacity):
    """The k best in expert order, not best first: the slots' order changes who comes first."""
    experts = torch.topk(scores, k, dim=-1).indices.sort(-1).values
    return experts, solutions.route_with_capacity(scores, k, capacity)[1]


def test_the_merge_grader_passes_the_answer_and_catches_mistakes():
    assert "merge" in exercises_cp_ep.check_merge(solutions.merge_attention)
    for wrong, message in ((overflows, "non-finite"), (averages, "not attention over every key"),
                           (masked_block_is_nan, "non-finite")):
        with pytest.raises(AssertionError, match=message):
            exercises_cp_ep.check_merge(wrong)


def test_the_routing_grader_passes_the_answer_and_catches_mistakes():
    assert "route" in exercises_cp_ep.check_route(solutions.route_with_capacity)
    for wrong, message in ((keeps_everything, "kept slots differ"),
                           (keeps_the_last, "kept slots differ"),
                           (unsorted_top_k, "chosen experts differ")):
        with pytest.raises(AssertionError, match=message):
            exercises_cp_ep.check_route(wrong)
