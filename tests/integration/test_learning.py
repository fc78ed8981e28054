"""The promise of the whole loop in miniature: under GRPO the reward of a tiny task goes up, fast, on the CPU.

A 2-layer random Llama (SmolLM2's tokenizer), the transformers engine, 4 prompts x 4 samples of 8 tokens per step,
and a reward the random policy can climb: the fraction of vowels in the completion. Measured here (one thread,
0.3 s a step, 30 steps): 0.32 over the first steps -> 0.50 over the last, where the policy settles on tokens that
are half vowels. The test asks for +0.1 between the means of the first and last five steps, leaving room for another
CPU's float rounding to take another path up. It runs in both trainer precisions: float32, and bf16 autocast over
float32 master weights with the engine in bfloat16 (on a CPU without bf16 instructions bf16 is slow, not wrong).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from sharpen.monitoring import read_jsonl
from support.vowel_task import run_vowel_task


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_grpo_raises_the_reward_of_a_tiny_task(tiny_model_path: Path, tmp_path: Path, precision: str) -> None:
    run_dir = run_vowel_task(
        name=f"learn-{precision}",
        output_dir=tmp_path,
        model_path=tiny_model_path,
        learning_rate="5e-2",
        precision=precision,
    )
    rewards = [row["reward/mean"] for row in read_jsonl(run_dir / "metrics.jsonl")]
    assert len(rewards) == 30
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    assert last >= first + 0.1, f"reward did not go up: {first:.3f} -> {last:.3f} ({rewards})"
