"""A whole trainer step with shared prompts (``trainer.share_prompt``) equals the step without: the same loss,
metrics and gradients to float tolerance, on a GRPO-shaped batch (several samples per prompt, completion lengths
spread, environment tokens inside one completion), while the shared path really runs and each prompt's samples
land in one micro-batch."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.schema import TrainerConfig
from sharpen.trainer import SingleDeviceBackend, Trainer, prefix
from sharpen.trainer.packing import split_micro_batches
from sharpen.types import Example, Message, Rollout, TrainBatch

VOCAB, HIDDEN, NUM_LAYERS, PAD = 128, 32, 2, 0  # the tiny model of conftest.model_dir
FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def _group_batch(seed: int, *, num_prompts: int = 3, num_samples: int = 4) -> list[Rollout]:
    rng = random.Random(seed)
    rollouts = []
    for p in range(num_prompts):
        example = Example(task_key=f"t/{p}", prompt=(Message(role="user", content=f"q{p}"),), answer="a")
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 9))]
        for s in range(num_samples):
            completion = [rng.randrange(1, VOCAB) for _ in range(rng.choice([1, 2, 5, 9, 14]))]
            logprobs = [math.log(1 / VOCAB) + 0.05 * (i % 5 - 2) for i in range(len(completion))]
            rollout = Rollout(
                example=example,
                prompt_ids=list(prompt),
                completion_ids=completion,
                completion_logprobs=logprobs,
                versions=[0] * len(completion),
                sample_index=s,
                advantage=rng.uniform(-1.5, 1.5),
            )
            rollouts.append(rollout)
    tool = rollouts[1]  # environment tokens (inputs only) inside a completion
    tool.completion_ids = [*tool.completion_ids, 7, 8, 9, 10]
    tool.completion_logprobs = [*tool.completion_logprobs, 0.0, 0.0, 0.0, -4.0]
    tool.versions = [0] * len(tool.completion_ids)
    tool.loss_mask = [True] * (len(tool.completion_ids) - 4) + [False, False, False, True]
    rng.shuffle(rollouts)
    return rollouts


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> SingleDeviceBackend:
    return SingleDeviceBackend(TrainerConfig(device="cpu", precision="float32"), model_path=model_dir, dtype="float32")


def _step(backend: SingleDeviceBackend, monkeypatch, *, share_prompt: bool, algorithm: dict) -> tuple:
    config = TrainerConfig(
        device="cpu",
        precision="float32",
        learning_rate=1e-3,
        micro_batch_size=4,
        share_prompt=share_prompt,
        algorithm=AlgorithmConfig(**algorithm),
    )
    trainer = Trainer(config, backend=backend, pad_token_id=PAD, max_new_tokens=40)
    gradients: dict[str, torch.Tensor] = {}
    calls = []

    def capture(**_: float) -> float:
        for name, param in backend.model.named_parameters():
            assert param.grad is not None, name
            gradients[name] = gradients.get(name, 0) + param.grad.detach().clone()
        backend.optimizer.zero_grad(set_to_none=True)
        return 1.0

    original = prefix.score_shared_prompts

    def counted(*args, **kwargs):
        calls.append(len(kwargs["prompt_lengths"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(backend, "clip_and_step", capture)
    monkeypatch.setattr(prefix, "score_shared_prompts", counted)
    metrics = trainer.step(TrainBatch(rollouts=_group_batch(seed=5), step=0))
    monkeypatch.undo()
    return metrics, gradients, calls


_CASES = {"grpo": {}, "two_epochs_entropy": {"num_epochs": 2, "num_mini_batches": 1, "entropy_coef": 0.01}}


@pytest.mark.parametrize("case", list(_CASES))
def test_the_step_does_not_change_with_shared_prompts(backend, monkeypatch, case):
    plain, plain_gradients, plain_calls = _step(backend, monkeypatch, share_prompt=False, algorithm=_CASES[case])
    shared, shared_gradients, shared_calls = _step(backend, monkeypatch, share_prompt=True, algorithm=_CASES[case])
    assert plain_calls == [] and shared_calls and all(size == 4 for size in shared_calls)
    assert set(plain) == set(shared)
    num_tokens = int(plain["train/num_loss_tokens"])
    seq_len = 32
    for name, value in plain.items():
        if name.startswith(("offpolicy/ess", "offpolicy/ratio_p")):
            continue  # statistics of each micro-batch: the split differs
        tolerance = 4 * (NUM_LAYERS + 1) * (seq_len + VOCAB + HIDDEN + num_tokens) * FLOAT32_UNIT_ROUNDOFF
        assert shared[name] == pytest.approx(value, rel=0, abs=tolerance * max(abs(value), 1.0)), name
    for name, expected in plain_gradients.items():
        assert expected.abs().max() > 0, name
        tolerance = 4 * (NUM_LAYERS + 1) * (seq_len + VOCAB + HIDDEN + num_tokens) * FLOAT32_UNIT_ROUNDOFF
        torch.testing.assert_close(
            shared_gradients[name], expected, rtol=0, atol=tolerance * float(expected.abs().max()), msg=name
        )


def test_a_prompts_samples_land_in_one_micro_batch_when_prompts_are_shared():
    rollouts = _group_batch(seed=1)
    by_prompt = split_micro_batches(rollouts, 4, by_prompt=True)
    assert all(len({tuple(r.prompt_ids) for r in chunk}) == 1 for chunk in by_prompt)
    by_length = split_micro_batches(rollouts, 4)
    assert any(len({tuple(r.prompt_ids) for r in chunk}) > 1 for chunk in by_length)  # what sharing would lose
