"""On-policy distillation formulas (`algorithms/distill.py`): hand-computed reverse KL and advantages in float64,
the top-k KL against a direct computation, and the loss term's gradient against the analytic reverse-KL one."""

from __future__ import annotations

import math

import pytest
import torch

from sharpen.trainer.algorithms.distill import (
    distillation_advantages,
    quantile,
    reverse_kl_per_token,
    top_k_reverse_kl,
)
from sharpen.trainer.algorithms.kl import kl_per_token


def test_reverse_kl_is_student_minus_teacher_logprob_and_detaches_the_teacher():
    student = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[-1.5, -0.25, -2.0]], dtype=torch.float64, requires_grad=True)
    rkl = reverse_kl_per_token(student, teacher)
    assert rkl.tolist() == [[0.5, -0.25, 0.0]]
    rkl.sum().backward()
    assert student.grad is not None and student.grad.tolist() == [[1.0, 1.0, 1.0]]
    assert teacher.grad is None


def test_advantages_are_minus_the_token_reverse_kl_with_gamma_zero():
    rkl = torch.tensor([[0.5, -0.25, 1.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    assert distillation_advantages(rkl, mask).tolist() == [[-0.5, 0.25, -1.0, 0.0]]


def test_discounted_advantages_count_only_trained_tokens():
    # tokens 0, 1, 3 trained; token 2 appended by an environment (ignored, and it does not age the discount)
    rkl = torch.tensor([[0.5, -0.25, 9.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True, False]])
    advantages = distillation_advantages(rkl, mask, gamma=0.5)
    a3 = -1.0
    a1 = 0.25 + 0.5 * a3  # -0.25
    a0 = -0.5 + 0.5 * a1  # -0.625
    assert advantages[0].tolist() == pytest.approx([a0, a1, 0.0, a3, 0.0], abs=1e-15)
    assert distillation_advantages(rkl, mask, gamma=1.0)[0, 0].item() == pytest.approx(-0.5 + 0.25 - 1.0)


def test_advantages_carry_no_gradient_and_refuse_a_bad_gamma():
    rkl = torch.tensor([[0.5, 1.0]], requires_grad=True)
    assert not distillation_advantages(rkl, torch.ones(1, 2, dtype=torch.bool), gamma=0.9).requires_grad
    with pytest.raises(ValueError, match="gamma"):
        distillation_advantages(rkl, torch.ones(1, 2, dtype=torch.bool), gamma=1.5)


def test_top_k_kl_matches_a_direct_renormalised_computation():
    torch.manual_seed(0)
    vocab, k = 11, 4
    student_logits = torch.randn(5, vocab, dtype=torch.float64) * 2
    teacher_logits = torch.randn(5, vocab, dtype=torch.float64) * 2
    student_lp, teacher_lp = student_logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    ids = student_lp.topk(k, dim=-1).indices
    got = top_k_reverse_kl(student_lp.gather(1, ids), teacher_lp.gather(1, ids))
    for row in range(5):
        chosen = ids[row].tolist()
        s = [math.exp(student_lp[row, v].item()) for v in chosen]
        t = [math.exp(teacher_lp[row, v].item()) for v in chosen]
        qs = [p / sum(s) for p in s]
        qt = [p / sum(t) for p in t]
        expected = sum(a * math.log(a / b) for a, b in zip(qs, qt, strict=True))
        assert got[row].item() == pytest.approx(expected, abs=1e-12)
    assert (got >= 0).all()
    # with k = vocab the restricted KL is the exact full-distribution reverse KL
    exact = (student_lp.exp() * (student_lp - teacher_lp)).sum(-1)
    all_ids = torch.arange(vocab).expand(5, vocab)
    full = top_k_reverse_kl(student_lp.gather(1, all_ids), teacher_lp.gather(1, all_ids))
    assert torch.allclose(full, exact, atol=1e-12)


def test_k2_loss_gradient_is_the_analytic_one_and_its_expectation_the_exact_reverse_kl_gradient():
    torch.manual_seed(1)
    vocab = 7
    logits = torch.randn(vocab, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(vocab, dtype=torch.float64).log_softmax(-1)
    student = logits.log_softmax(-1)
    probs = student.exp().detach()
    # per sampled token y: d/dlogits of rkl_y^2 / 2 is rkl_y * (onehot(y) - softmax(logits))
    expected_gradient = torch.zeros(vocab, dtype=torch.float64)
    for y in range(vocab):
        loss = kl_per_token(student[y : y + 1], teacher[y : y + 1], "k2", clamp=None).sum()
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
        rkl = (student[y] - teacher[y]).item()
        analytic = rkl * (torch.nn.functional.one_hot(torch.tensor(y), vocab).double() - probs)
        assert torch.allclose(grad, analytic, atol=1e-12), y
        expected_gradient += probs[y] * grad
    # E_{y ~ pi_s}[grad k2] = grad KL(pi_s || pi_t), computed exactly over the vocabulary
    exact_kl = (student.exp() * (student - teacher)).sum()
    (exact_gradient,) = torch.autograd.grad(exact_kl, logits)
    assert torch.allclose(expected_gradient, exact_gradient, atol=1e-12)


def test_quantile_interpolates_linearly():
    values = torch.tensor([4.0, 1.0, 3.0, 2.0])
    assert quantile(values, 0.5) == pytest.approx(2.5)
    assert quantile(values, 0.9) == pytest.approx(3.7)
    assert math.isnan(quantile(torch.tensor([]), 0.5))
