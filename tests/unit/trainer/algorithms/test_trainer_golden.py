"""Golden losses: one `Trainer.step` of the tiny random Llama of conftest.model_dir on a fixed, hand-built batch
gives a recorded loss and gradient norm, for the GRPO defaults and for a second objective that exercises what the
defaults leave idle (GSPO's sequence ratio after an optimizer step, the KL term, the entropy bonus, per-sequence
aggregation).

A change of any formula on the way (advantages, policy loss, off-policy correction, aggregation, KL, entropy,
gradient clipping) moves these numbers far beyond the tolerance; an unchanged formula must reproduce them on any
x86 CPU.

Numerics: the model runs in float64 (the backend takes the dtype as an argument; the config's dtype has no
float64), so its matmuls add ~1e-16 relative error whatever the CPU. What stays float32 by design is what
`score_tokens` does after the LM head (log-softmax over 128 logits, entropy) and the loss arithmetic on those
logprobs (sums over 19 loss tokens). Another CPU's kernels (another SIMD width, another reduction order) round
those float32 sums differently; a float32 sum of n terms is within n * 2^-24 of exact relative to the sum of the
terms' magnitudes, so (128 + 19) * 2^-24 ~ 1e-5 bounds the relative change of a logprob, and the loss (~0.05, from
terms of size ~1) moves by a few 1e-6 at worst. Hence rtol 1e-4 and atol 1e-5, with room above that bound and 10x
below the smallest formula change tried. Measured on this machine between ATEN_CPU_CAPABILITY=default and avx512
(different vectorised kernels): the losses differ by 2.5e-6 relative at most, the gradient norms by 1.3e-7.

How the golden numbers were obtained: ``_step_metrics(model_dir, objective)`` for each objective, with the model of
conftest.model_dir, printed once (torch 2.13.0 CPU, AMD EPYC, AVX512) and pasted below. Checked to fail (relative
change of the loss; the tolerance is ~1e-4): the clipped surrogate scaled by 1.001 (1e-3 in loss and gradient
norm of the GRPO defaults), an off-policy cap of 2.1 instead of 2 (6.6e-2), GRPO without the std division
(0.35), and in the second objective clip_eps_low 0.021 instead of 0.02 (7.8e-3), the k2 estimator instead of k3
(7.9e-3), entropy_coef 0.011 instead of 0.01 (0.14), token_mean instead of seq_mean_token_mean (0.75).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.config.advantages import GRPOAdvantage
from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.schema import TrainerConfig
from sharpen.trainer import ReferencePolicy, SingleDeviceBackend, Trainer
from sharpen.trainer.algorithms.estimators import compute_advantages
from sharpen.types import Example, Message, Rollout, TrainBatch

PAD = 0  # the tiny model of conftest.model_dir (vocabulary 128)
_EXAMPLES = [Example(task_key=f"golden/{i}", prompt=(Message(role="user", content="q"),), answer="a") for i in (0, 1)]

# Two groups of three: (prompt ids, completion ids, engine logprobs, score). The engine logprobs are near the
# random model's ~log(1/128) = -4.85, so the off-policy weights differ from 1 and some are capped.
_GROUPS = [
    [
        ([1, 17, 33], [45, 9, 101, 7], [-4.6, -5.2, -4.9, -3.9], 1.0),
        ([1, 17, 33], [12, 88], [-5.0, -4.4], 0.0),
        ([1, 17, 33], [64, 64, 3, 120, 77], [-4.8, -4.8, -5.6, -4.1, -4.95], 1.0),
    ],
    [
        ([1, 90, 2, 54], [31, 8, 8], [-4.7, -5.1, -5.3], 0.0),
        ([1, 90, 2, 54], [110, 6, 42, 19], [-4.2, -4.9, -5.05, -4.5], 0.5),
        ([1, 90, 2, 54], [5], [-4.85], 1.0),
    ],
]

_OBJECTIVES: dict[str, dict[str, object]] = {
    "grpo_defaults": {},
    "gspo_kl_entropy": {
        "policy_loss": {"type": "gspo", "clip_eps_low": 0.02, "clip_eps_high": 0.03},
        "loss_aggregation": "seq_mean_token_mean",
        "num_mini_batches": 2,  # the second mini-batch runs after an optimizer step: ratios away from 1
        "kl": {"type": "loss", "coef": 0.5, "estimator": "k3"},
        "entropy_coef": 0.01,
    },
}
_LEARNING_RATE = 2e-2  # large enough that the second mini-batch's ratios leave the clip range and the KL counts

# train/loss and train/grad_norm of one step (see the module docstring for how they were obtained)
_GOLDEN = {
    # re-recorded when trainer.algorithm.advantage.std became "unbiased" by default (issue 18): the group std of
    # three scores is sqrt(3/2) larger, so the GRPO advantages and the loss are sqrt(2/3) of the population values
    "grpo_defaults": (-0.05598658323287964, 1.6018886259846326),
    "gspo_kl_entropy": (-0.03698986768722534, 2.511287175601163),
}


def _batch() -> TrainBatch:
    scores = torch.tensor([[score for *_, score in group] for group in _GROUPS], dtype=torch.float64)
    advantages = compute_advantages(GRPOAdvantage(), scores)  # [groups, samples]
    rollouts = [
        Rollout(
            example=_EXAMPLES[row],
            prompt_ids=prompt,
            completion_ids=completion,
            completion_logprobs=engine_logprobs,
            versions=[0] * len(completion),
            sample_index=col,
            advantage=float(advantages[row, col]),
        )
        for row, group in enumerate(_GROUPS)
        for col, (prompt, completion, engine_logprobs, _) in enumerate(group)
    ]
    return TrainBatch(rollouts=rollouts, step=0)


def _step_metrics(model_dir: Path, objective: str) -> dict[str, float]:
    config = TrainerConfig(
        device="cpu",
        precision="float32",  # golden float64 values: no bf16 autocast, whatever the CPU
        learning_rate=_LEARNING_RATE,
        micro_batch_size=4,
        algorithm=AlgorithmConfig.model_validate(_OBJECTIVES[objective]),
    )
    backend = SingleDeviceBackend(config, model_path=model_dir, dtype="float64")
    reference = None
    if config.algorithm.kl.needs_reference:
        reference = ReferencePolicy(model_path=model_dir, dtype="float64", device=backend.device, precision="float32")
    trainer = Trainer(config, backend=backend, pad_token_id=PAD, reference=reference)
    return trainer.step(_batch())


@pytest.mark.parametrize("objective", list(_OBJECTIVES))
def test_one_step_gives_the_recorded_loss_and_gradient_norm(model_dir: Path, objective: str):
    metrics = _step_metrics(model_dir, objective)
    loss, grad_norm = _GOLDEN[objective]
    assert metrics["train/num_optimizer_steps"] == _OBJECTIVES[objective].get("num_mini_batches", 1)
    assert metrics["train/loss"] == pytest.approx(loss, rel=1e-4, abs=1e-5), metrics
    assert metrics["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-4, abs=1e-5), metrics
