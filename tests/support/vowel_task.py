"""The tiny task of the learning tests: a reward the random tiny policy can climb (the fraction of vowels in the
completion) and one GRPO run of it on the transformers engine, 30 steps of 4 prompts x 4 samples of 8 tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sharpen.api import load_config, run
from sharpen.types import Example, RewardResult, RewardStatus


def vowel_fraction(example: Example, completion: str) -> RewardResult:
    score = sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)
    return RewardResult(score=score, status=RewardStatus.OK, components={"vowels": score}, verifier="vowels")


def run_vowel_task(
    *, name: str, output_dir: Path, model_path: Path, learning_rate: str, precision: str, **overrides: str
) -> Path:
    """The run folder of 30 GRPO steps on the vowel task, with further ``overrides`` (dotted key -> JSON value); the
    torch thread count is restored afterwards."""
    values = {
        "run.name": json.dumps(name),
        "run.output_dir": json.dumps(str(output_dir)),
        "run.num_steps": "30",
        "run.export_model": "false",
        "model.path": json.dumps(str(model_path)),
        "data.size": "64",
        "rollout.engine.type": '"hf"',
        "rollout.prompts_per_step": "4",
        "rollout.num_samples_per_prompt": "4",
        "rollout.max_new_tokens": "8",
        "trainer.micro_batch_size": "16",
        "trainer.learning_rate": learning_rate,
        "trainer.num_threads": "1",
        "trainer.precision": json.dumps(precision),
        "monitoring.progress": "false",
        "monitoring.parity_probe_every": "0",
        **overrides,
    }
    previous_threads = torch.get_num_threads()
    try:
        return run(load_config(None, [f"{k}={v}" for k, v in values.items()]), reward_fn=vowel_fraction)
    finally:
        torch.set_num_threads(previous_threads)
