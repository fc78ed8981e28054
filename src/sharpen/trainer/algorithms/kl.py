# pyright: strict
"""KL regularisation toward a reference policy: per-token estimators, coefficient controllers, and entropy.

Estimators of KL(pi || pi_ref) = E_{y ~ pi}[log pi(y) - log pi_ref(y)] from a sampled token y ~ pi, with
x = log pi(y) - log pi_ref(y) and r = pi_ref(y) / pi(y) = exp(-x) (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html):

* k1 = x: unbiased value, high variance, can be negative.
* k2 = x^2 / 2: biased value (exact only to second order), low variance, >= 0.
* k3 = (r - 1) - log r: unbiased value, low variance, >= 0.

Used as a *loss* (differentiated through log pi(y) with y held fixed, the way a per-token loss term is), their
expected gradients differ from what their values suggest (Tang & Munos 2025, "On a few pitfalls in KL divergence
gradient estimation for RL"):

* k1: grad k1 = grad log pi(y), and E_pi[grad log pi] = 0. Zero expected gradient: as a loss it only adds noise
  (k1 is right as a reward penalty, where the policy gradient multiplies it by the score function).
* k2: grad k2 = x grad log pi(y), and E_pi[x grad log pi] = grad KL(pi || pi_ref). The correct gradient of the
  reverse KL.
* k3: grad k3 = (1 - r) grad log pi(y), whose expectation is -E_{pi_ref}[grad log pi] = grad KL(pi_ref || pi):
  the gradient of the *forward* KL, biased for the reverse KL it estimates (GRPO's k3 KL loss, DeepSeekMath).

All three statements need y ~ pi with pi the policy being differentiated; with samples from an older behaviour
policy the caller weighs each token by its importance ratio. So: k1 or k3 to *report* a KL, k2 as the KL loss.

This module does not decide where the KL enters (reward penalty or loss term); the trainer and config do.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol, assert_never

import torch

from sharpen.config.kl import KLConfig, KLLoss, KLReward, NoKL

KLEstimator = Literal["k1", "k2", "k3"]

_EXP_LIMIT = 80.0
"""Largest log r whose exp k3 takes as is: exp(80) ~ 5.5e34 is finite in float32 and bfloat16 (max ~3.4e38), with
room for the k3 value times a coefficient. Beyond it k3 continues along its tangent line at 80 (value and gradient
finite, gradient still of the right sign and growing), so the guard only acts where exp() would overflow."""


def kl_per_token(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: KLEstimator,
    *,
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi; same shape as ``logprobs``.

    ``logprobs`` (with gradient) and ``ref_logprobs`` (never differentiated) are [batch, seq], or any shape
    alike. See the module docstring for which estimator to use for what. No estimator is clamped by default, so
    each keeps its value and gradient however far the policy has moved (k2's gradient is the log-ratio x itself,
    strongest exactly where the policy is farthest from the reference). The only guard is k3's exponential: where
    log r = -x exceeds 80 (exp would overflow float32 soon after), k3 follows its tangent line at 80, finite and
    with a gradient. ``clamp``: an explicit opt-in limit of the estimate to [-clamp, clamp] (k2 and k3 are
    non-negative, so only the top bound acts); a token whose estimate is clamped has *no gradient*, so this trades
    the penalty's pull on far-off tokens for robustness to outliers. ``None`` (the default) means no clamp.
    Masking is the caller's job (aggregation selects out masked tokens).
    """
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be positive or None, got {clamp}")
    log_ratio = logprobs - ref_logprobs.detach()  # x
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    elif estimator == "k3":
        neg = -log_ratio  # log r
        safe = neg.clamp(max=_EXP_LIMIT)  # identical to log r wherever exp(log r) is finite
        kl = torch.expm1(safe) - safe  # (r - 1) - log r, accurate near r = 1
        # Past the limit: the tangent line k3(L) + k3'(L) (log r - L), with k3'(L) = exp(L) - 1. ``over`` is 0 (and
        # so adds nothing, nor any gradient) wherever log r <= L.
        over = (neg - _EXP_LIMIT).clamp(min=0.0)
        kl = kl + math.expm1(_EXP_LIMIT) * over
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    return kl


class KLController(Protocol):
    """The KL coefficient beta of a step, and how it reacts to the measured KL."""

    @property
    def coef(self) -> float: ...

    def update(self, current_kl: float, num_steps: int) -> None: ...


class FixedKLController:
    """A constant coefficient."""

    def __init__(self, coef: float) -> None:
        if not coef >= 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}")
        self._coef = float(coef)

    @property
    def coef(self) -> float:
        return self._coef

    def update(self, current_kl: float, num_steps: int) -> None:
        """Does nothing: the coefficient is fixed."""


def build_kl_controller(kl: KLConfig, *, coef: float | None = None) -> KLController:
    """The controller of ``trainer.algorithm.kl``: adaptive with a target, else fixed (0 with no KL term).
    ``coef``: the coefficient to start from instead of the section's (a resumed adaptive controller's)."""
    match kl:
        case NoKL():
            return FixedKLController(0.0)
        case KLLoss() | KLReward():
            start = kl.coef if coef is None else coef
            if kl.target is None:
                return FixedKLController(kl.coef)
            return AdaptiveKLController(start, kl.target, kl.horizon)
        case _:
            assert_never(kl)


class AdaptiveKLController:
    """Proportional control of the coefficient toward a target KL (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences", section 2.2; the update as in their lm-human-preferences code).

    e = clip(KL / target - 1, -0.2, 0.2); beta <- beta * (1 + e * num_steps / horizon). Above target beta grows,
    below it shrinks, by at most 20% per ``horizon`` steps. The coefficient is the only state: save ``coef`` and
    pass it back as ``init_coef`` to resume.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if not init_coef > 0 or not target > 0 or not horizon > 0:
            raise ValueError(f"need init_coef, target, horizon > 0, got {init_coef}, {target}, {horizon}")
        self._coef = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    @property
    def coef(self) -> float:
        return self._coef

    def update(self, current_kl: float, num_steps: int) -> None:
        """``current_kl``: the KL measured over the last ``num_steps`` samples / steps (Ziegler counts samples;
        the horizon must be in the same unit)."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self._coef *= 1.0 + error * num_steps / self.horizon


def entropy_from_logits(logits: torch.Tensor, *, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension: [..., vocab] -> [...].

    H = -sum_v p_v log p_v with log p = log_softmax(z) = z - logsumexp(z), never the log of a rounded probability:
    stable for any finite logits, and unlike logsumexp(z) - sum_v p_v z_v free of cancellation when the logits are
    large (|z| ~ 1e4 in float32). A -inf logit (a token masked out of the vocabulary) has p = 0 and adds exactly 0.
    Computed in at least float32 (a bfloat16 entropy is off in the second digit); the result is in that dtype.

    ``chunk_size``: rows (positions) per chunk, so the float32 temporaries are [chunk, vocab] rather than
    [positions, vocab] (at a 150k vocabulary a 1k-token chunk is ~0.6 GB, a 32k-token batch ~20 GB). This
    bounds memory when no gradient is kept (metrics under ``torch.no_grad()``); under autograd each chunk's
    temporaries are saved for backward anyway.
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])  # [positions, vocab]
    chunks = [flat] if chunk_size is None else torch.split(flat, chunk_size)  # never empty, even for 0 rows
    return torch.cat([_entropy_rows(chunk) for chunk in chunks]).reshape(logits.shape[:-1])


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    dtype = torch.promote_types(logits.dtype, torch.float32)
    # [rows, vocab]: z - logsumexp(z), shifted by the max inside, computed in `dtype` (the input cast inside)
    return entropy_from_log_probs(torch.log_softmax(logits, dim=-1, dtype=dtype))


def entropy_from_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy -sum_v p_v log p_v over the last dimension from normalised log-probabilities (a log-softmax):
    [..., vocab] -> [...], in their dtype. `entropy_from_logits` without its log-softmax, for a caller that already
    has one (the trainer's scoring pass computes it once for the target logprobs and the entropy)."""
    # p = 0 exactly where log p = -inf: clamping it to the dtype's lowest finite value gives 0 * finite = 0 in the
    # value and a zero gradient there (clamp passes none below its bound), where 0 * -inf would be NaN; log p <= 0
    # everywhere else, so nothing else changes. One elementwise pass, no mask tensor.
    finite_log_probs = log_probs.clamp(min=torch.finfo(log_probs.dtype).min)
    return -(log_probs.exp() * finite_log_probs).sum(dim=-1)
