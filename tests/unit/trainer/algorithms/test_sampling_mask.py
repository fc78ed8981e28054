"""`truncate_logits` keeps vLLM's top-k / top-p set (ties included) and lets the gradient through the kept logits
only; `drop_outside` takes tokens sampled outside the set out of the loss. Golden values are computed by hand from
the logits below (softmax, ascending running sums), written as closed forms; ties that straddle the nucleus boundary
fall in torch's sort order (ascending by id at these sizes), which the reference test checks against vLLM's own
function on larger logits full of ties."""

from __future__ import annotations

import math

import pytest
import torch

from sharpen.trainer.algorithms.sampling_mask import SamplingMask, drop_outside, truncate_logits

# ids:       0    1    2    3     4    5
LOGITS = [2.0, 1.0, 1.0, 0.0, -1.0, 3.0]
# probabilities 0.2156 0.0793 0.0793 0.0292 0.0107 0.5859; ascending (ties by id) 4, 3, 1, 2, 0, 5 with running
# sums 0.0107 0.0399 0.1192 0.1985 0.4141 1.0
NEG = -math.inf
CASES = [(0, 0.7), (5, 1.0), (5, 0.7), (12, 0.9), (1, 1.0), (0, 0.95), (3, 0.5), (50, 0.9)]


def _log_softmax_over(kept: list[int]) -> list[float]:
    """log p of each id under the softmax of LOGITS restricted to ``kept`` (-inf elsewhere), by hand."""
    log_total = math.log(sum(math.exp(LOGITS[i]) for i in kept))
    return [LOGITS[i] - log_total if i in kept else NEG for i in range(len(LOGITS))]


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [
        (0, 1.0, [0, 1, 2, 3, 4, 5]),  # off
        (6, 1.0, [0, 1, 2, 3, 4, 5]),  # k = vocab cuts nothing
        (2, 1.0, [0, 5]),  # the 2nd largest logit (2.0) is the threshold
        (3, 1.0, [0, 1, 2, 5]),  # the 3rd largest is 1.0, held by ids 1 and 2: the tie keeps both (4 tokens)
        (0, 0.8, [0, 5]),  # running sums <= 0.2 go: 4, 3, 1, 2; {5, 0} holds 0.8015 >= 0.8
        (0, 0.85, [0, 2, 5]),  # <= 0.15: 4, 3 and the first of the tied pair (id 1, 0.1192); id 2 (0.1985) stays
        (0, 0.5, [5]),  # everything but the top token (0.4141 <= 0.5): the largest is always kept
        (3, 0.8, [0, 5]),  # top-p on top-k's renormalised {5, 0, 1, 2}: sums 0.0826 0.1652 | 0.3897 1.0
        (3, 0.9, [0, 2, 5]),  # <= 0.1: only id 1 (0.0826), the first of the tie
    ],
)
def test_truncated_log_softmax_matches_hand_computed_values(top_k: int, top_p: float, kept: list[int]) -> None:
    logits = torch.tensor([LOGITS])
    truncated = truncate_logits(logits, top_k, top_p)
    got = torch.log_softmax(truncated, dim=-1)[0].tolist()
    assert got == pytest.approx(_log_softmax_over(kept), abs=1e-6)


def test_equal_logits_at_the_nucleus_boundary_keep_the_higher_ids() -> None:
    """Six equal logits, top_p 0.6: running sums 1/6, 2/6 go (<= 0.4), 3/6 stays; the ascending sort puts the lower
    ids first, so ids 2..5 are kept, each at log(1/4). A second row in the batch is cut on its own."""
    logits = torch.tensor([[0.0] * 6, LOGITS])
    got = torch.log_softmax(truncate_logits(logits, 0, 0.6), dim=-1).tolist()
    assert got[0] == pytest.approx([NEG, NEG, *[math.log(1 / 4)] * 4], abs=1e-6)
    # LOGITS at top_p 0.6: <= 0.4 drops 4, 3, 1, 2 (0.1985); 0.4141 > 0.4 keeps id 0
    assert got[1] == pytest.approx(_log_softmax_over([0, 5]), abs=1e-6)


def test_the_gradient_flows_through_the_kept_logits_only() -> None:
    logits = torch.tensor([LOGITS], requires_grad=True)
    log_probs = torch.log_softmax(truncate_logits(logits, 2, 1.0), dim=-1)
    log_probs[0, 5].backward()
    assert logits.grad is not None
    p5 = 1 / (1 + math.exp(-1))  # e^3 / (e^3 + e^2)
    assert logits.grad[0].tolist() == pytest.approx([-(1 - p5), 0.0, 0.0, 0.0, 0.0, 1 - p5], abs=1e-6)


def test_entropy_of_the_truncated_distribution_is_finite() -> None:
    from sharpen.trainer.algorithms.kl import entropy_from_log_probs

    log_probs = torch.log_softmax(truncate_logits(torch.tensor([LOGITS]), 2, 1.0), dim=-1)
    p5 = 1 / (1 + math.exp(-1))
    expected = -(p5 * math.log(p5) + (1 - p5) * math.log(1 - p5))
    assert float(entropy_from_log_probs(log_probs)[0]) == pytest.approx(expected, abs=1e-6)


def test_bad_settings_are_one_error() -> None:
    with pytest.raises(ValueError, match="top_k >= 0 and 0 < top_p <= 1"):
        truncate_logits(torch.zeros(1, 6), 0, 0.0)
    with pytest.raises(ValueError, match="top_k >= 0 and 0 < top_p <= 1"):
        SamplingMask(top_k=-1)
    assert SamplingMask().is_off and not SamplingMask(top_p=0.9).is_off and not SamplingMask(top_k=3).is_off


def test_tokens_outside_the_set_leave_the_loss_without_nan() -> None:
    logprobs = torch.tensor([[-0.5, NEG, -1.0], [-2.0, -0.1, NEG]], requires_grad=True)
    old = torch.tensor([[-0.4, -0.3, -1.1], [NEG, -0.2, -0.3]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    kept_logprobs, kept_old, kept_mask, num_outside = drop_outside(logprobs, old, mask)
    assert num_outside == 2  # (0, 1) current -inf, (1, 0) old -inf; (1, 2) is outside the loss mask already
    assert kept_mask.tolist() == [[True, False, True], [False, True, False]]
    assert torch.isfinite(kept_logprobs).all() and torch.isfinite(kept_old).all()
    (kept_logprobs * kept_mask).sum().backward()
    assert logprobs.grad is not None
    assert logprobs.grad.tolist() == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    finite = torch.tensor([[-0.5, -1.0]])
    same_logprobs, _, same_mask, none = drop_outside(finite, finite, torch.tensor([[True, True]]))
    assert none == 0 and same_logprobs is finite and same_mask.all()


@pytest.mark.slow
def test_the_kept_set_is_vllms_on_logits_full_of_ties() -> None:
    """The reference: vLLM 0.32's own `apply_top_k_top_p` (its CPU path) keeps exactly the same tokens, on logits
    drawn from a handful of values (ties everywhere, also at the top-k threshold and the nucleus boundary) and on
    continuous ones."""
    vllm_ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    generator = torch.Generator().manual_seed(0)
    rows = 8
    for _ in range(20):
        tied = torch.randint(-4, 5, (rows, 50), generator=generator).float() * 0.5
        continuous = torch.randn(rows, 50, generator=generator) * 2
        for logits in (tied, continuous):
            for top_k, top_p in CASES:
                k = torch.full((rows,), top_k) if top_k else None
                p = torch.full((rows,), top_p) if top_p < 1.0 else None
                expected = vllm_ops.apply_top_k_top_p(logits.clone(), k, p).isneginf()
                got = truncate_logits(logits.clone(), top_k, top_p).isneginf()
                assert torch.equal(got, expected), (top_k, top_p)
