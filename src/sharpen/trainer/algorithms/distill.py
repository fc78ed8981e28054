# pyright: strict
"""On-policy distillation arithmetic: per-token reverse KL to a teacher, as an advantage or as a loss term.

The student pi_s samples a completion y; a frozen teacher pi_t scores the same tokens. The per-token reverse KL,
KL(pi_s || pi_t) at position t, is estimated on the sampled token (Agarwal et al. 2024, "On-Policy Distillation of
Language Models: Learning from Self-Generated Mistakes" (GKD), with the reverse KL as divergence; Thinking
Machines 2025, "On-Policy Distillation"):

    rkl_t = log pi_s(y_t | y_<t) - log pi_t(y_t | y_<t)

Its expectation over y_t ~ pi_s is the exact per-position reverse KL; a single token's value can be negative.

* As an advantage (`distillation_advantages`): A_t = -sum_{k >= t} gamma^(k - t) rkl_k over the trained tokens,
  with the student's logprobs those of the policy before the step's update (pi_old, computed by the trainer as the
  teacher's are, so that a teacher equal to the student is at exactly 0), held fixed. gamma = 0 (the default, and
  the choice of the Thinking Machines post) is the per-token -rkl_t; gamma = 1 is the return-to-go of the per-token
  rewards -rkl_k, the REINFORCE estimator of grad -KL over the whole sequence.
* As a loss term: a KL estimator of `kl.kl_per_token` on the student's current logprobs (with gradient) against
  the teacher's; k2 = rkl_t^2 / 2 has gradient rkl_t grad log pi_s(y_t), the reverse-KL gradient on on-policy
  samples (the KL module explains why not k1 or k3).
* Top-k (`top_k_reverse_kl`): the full-distribution reverse KL restricted to the student's k most likely tokens at
  each position, both distributions renormalised over that set, computed from both models' logits. Less stable:
  the set moves with the student, the teacher's mass outside it is ignored, and the renormalised KL is blind to
  how much mass either model puts outside the set.

This module owns only the formulas; where the teacher runs and how its prompt is built belongs to
`backends/teacher.py` and `distill_step.py`.
"""

from __future__ import annotations

import torch


def reverse_kl_per_token(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """rkl_t = log pi_s(y_t) - log pi_t(y_t) on the sampled tokens; same shape as the inputs ([batch, seq - 1] or
    any alike). The teacher's side is detached; the student's keeps whatever gradient it has. Masking is the
    caller's."""
    return student_logprobs - teacher_logprobs.detach()


def distillation_advantages(reverse_kl: torch.Tensor, mask: torch.Tensor, *, gamma: float = 0.0) -> torch.Tensor:
    """A_t = -sum_{k >= t, k trained} gamma^(k - t) rkl_k for each trained token (0 elsewhere), [batch, seq - 1].

    ``reverse_kl``: per-token rkl (held fixed: the result carries no gradient); ``mask``: the trained tokens. The
    discount counts trained tokens only, so tokens an environment appended between turns neither add a term nor
    age the discount. ``gamma`` in [0, 1]; 0 gives -rkl_t alone."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    rewards = torch.where(mask, -reverse_kl.detach(), torch.zeros_like(reverse_kl))  # [batch, seq - 1]
    if gamma == 0.0:
        return rewards
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # [batch]
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        advantages[:, t] = torch.where(mask[:, t], running, torch.zeros_like(running))
    return advantages


def top_k_reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Reverse KL over the student's top-k set S at each position, both distributions renormalised over S:
    sum_{v in S} q_s(v) (log q_s(v) - log q_t(v)) with q = p / sum_S p. ``student_logprobs`` and
    ``teacher_logprobs``: [num_positions, k] full-vocabulary logprobs of the same k token ids (the student's with
    gradient, the teacher's detached); returns [num_positions], >= 0. Less stable than the sampled-token estimate
    (module docstring)."""
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"shapes differ: student {tuple(student_logprobs.shape)}, teacher {tuple(teacher_logprobs.shape)}"
        )
    student = torch.log_softmax(student_logprobs, dim=-1)  # log q_s: renormalised over S
    teacher = torch.log_softmax(teacher_logprobs.detach(), dim=-1)  # log q_t
    return (student.exp() * (student - teacher)).sum(dim=-1)


def quantile(values: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of a 1-D tensor (linear interpolation, as numpy's default); nan when empty."""
    if values.numel() == 0:
        return float("nan")
    return float(torch.quantile(values.double(), q))
