"""Builders of the trainer unit tests on the tiny random Llama of tests/unit/trainer/conftest.py: a single-device
trainer, a value model, random and fixed-logprob rollouts, and a step whose accumulated gradient is captured."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sharpen.config.schema import TrainerConfig
from sharpen.trainer import SingleDeviceBackend, Trainer, ValueModel
from sharpen.types import Example, Message, RewardResult, RewardStatus, Rollout, TrainBatch

VOCAB, PAD = 128, 0  # the tiny model of conftest.model_dir
EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")


def single_device_trainer(config: TrainerConfig, model_dir: Path) -> Trainer:
    """A trainer on a float32 single-device backend of the model at ``model_dir``."""
    return Trainer(config, backend=SingleDeviceBackend(config, model_path=model_dir, dtype="float32"), pad_token_id=PAD)


def tiny_critic(model_dir: Path, config: TrainerConfig, **kwargs) -> ValueModel:
    """A float32 CPU value model of the model at ``model_dir`` under ``config.critic``, no gradient checkpointing."""
    return ValueModel(
        config.critic,
        model_path=model_dir,
        dtype="float32",
        device=torch.device("cpu"),
        precision="float32",
        gradient_checkpointing=False,
        **kwargs,
    )


def random_rollouts(
    seed: int,
    num: int = 6,
    *,
    prompt_lengths: tuple[int, int] = (2, 7),
    completion_lengths: tuple[int, int] = (1, 6),
    spread: float = 0.4,
    completion_first: bool = False,
    example: Callable[[int], Example] = lambda index: EXAMPLE,
) -> list[Rollout]:
    """Rollouts of random lengths (both bounds included), random tokens, engine logprobs within ``spread`` of the
    tiny model's ~log(1/128) (so some ratios clip and some do not) and random advantages; ``completion_first`` draws
    each completion before its prompt."""
    rng = random.Random(seed)

    def tokens(lengths: tuple[int, int]) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(rng.randint(*lengths))]

    out = []
    for index in range(num):
        if completion_first:
            completion = tokens(completion_lengths)
            prompt = tokens(prompt_lengths)
        else:
            prompt = tokens(prompt_lengths)
            completion = tokens(completion_lengths)
        out.append(
            Rollout(
                example=example(index),
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[math.log(1 / VOCAB) + rng.uniform(-spread, spread) for _ in completion],
                versions=[0] * len(completion),
                sample_index=index,
                advantage=rng.uniform(-1.5, 1.5),
            )
        )
    return out


def uniform_rollout(prompt: list[int], completion: list[int], score: float = 1.0, **fields) -> Rollout:
    """A scored rollout whose engine logprobs are all log(1/128), with advantage 0 unless ``fields`` set it."""
    return Rollout(
        example=EXAMPLE,
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=[math.log(1 / VOCAB)] * len(completion),
        versions=[0] * len(completion),
        reward=RewardResult(score=score, status=RewardStatus.OK),
        **{"advantage": 0.0, **fields},
    )


def captured_step(
    trainer: Trainer, batch: TrainBatch, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The step's metrics and the gradient accumulated when the optimizer would step (the step itself is skipped);
    the frozen parameters must have no gradient at all."""
    captured: dict[str, torch.Tensor] = {}
    backend = trainer.backend
    assert isinstance(backend, SingleDeviceBackend)

    def capture(**_: float) -> float:
        for name, param in backend.model.named_parameters():
            if param.requires_grad:
                assert param.grad is not None, name
                captured[name] = param.grad.detach().clone()
            else:
                assert param.grad is None, name
        backend.optimizer.zero_grad(set_to_none=True)
        return 0.0

    with monkeypatch.context() as patch:
        patch.setattr(backend, "clip_and_step", capture)
        metrics = trainer.step(batch)
    return metrics, captured


def uneven_rollouts() -> list[Rollout]:
    """One long rollout and six short ones (ids below VOCAB): a token-balanced split over 2 ranks gives one rank 1
    micro-batch of 2 and the other 3, so the short rank runs filler passes (the multi-rank backends' tests)."""
    rng = random.Random(0)
    lengths = [(20, 12), *[(rng.randint(2, 5), rng.randint(1, 4)) for _ in range(6)]]
    return [
        Rollout(
            example=EXAMPLE,
            prompt_ids=[rng.randrange(1, VOCAB) for _ in range(num_prompt)],
            completion_ids=[rng.randrange(1, VOCAB) for _ in range(num_completion)],
            completion_logprobs=[-4.0] * num_completion,
            versions=[0] * num_completion,
            advantage=rng.uniform(-1.5, 1.5),
        )
        for num_prompt, num_completion in lengths
    ]
