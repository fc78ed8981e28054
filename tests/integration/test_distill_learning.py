"""On-policy distillation closes a gap the student can close: the per-token reverse KL to the teacher falls.

The tiny random Llama (SmolLM2's tokenizer) is both student and teacher; the teacher is the frozen initial weights
at teacher_temperature = TEACHER_TEMPERATURE, a sharper version of the student (its logits x 1 / T). The task reward
has weight 0 (reward.correct_weight = 0: every score is 0, so the GRPO advantage is 0) and the only learning signal is
the distillation advantage -rkl_t. The student can reach the teacher exactly by scaling its logits up (its final norm
weights), so ``distill/reverse_kl`` (measured on each step's samples, before that step's update) must fall. With the
sign of the advantage flipped the student flattens instead and the KL rises; with the teacher at the student's own
temperature the KL is 0 from the start.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from sharpen.api import load_config, run
from sharpen.monitoring import read_jsonl

TEACHER_TEMPERATURE = 0.1
NUM_STEPS = 20


@pytest.mark.slow
def test_distillation_lowers_the_reverse_kl_to_a_sharper_teacher(tiny_model_path: Path, tmp_path: Path) -> None:
    overrides = {
        "run.name": '"distill-tiny"',
        "run.output_dir": json.dumps(str(tmp_path)),
        "run.num_steps": str(NUM_STEPS),
        "run.export_model": "false",
        "model.path": json.dumps(str(tiny_model_path)),
        "data.size": "64",
        "reward.correct_weight": "0.0",
        "rollout.engine.type": '"hf"',
        "rollout.prompts_per_step": "4",
        "rollout.num_samples_per_prompt": "4",
        "rollout.max_new_tokens": "8",
        "trainer.micro_batch_size": "16",
        "trainer.learning_rate": "5e-2",
        "trainer.num_threads": "1",
        "trainer.precision": '"float32"',
        "trainer.distillation.enabled": "true",
        "trainer.distillation.teacher_temperature": str(TEACHER_TEMPERATURE),
        "monitoring.progress": "false",
        "monitoring.parity_probe_every": "0",
    }
    previous_threads = torch.get_num_threads()
    try:
        run_dir = run(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))
    finally:
        torch.set_num_threads(previous_threads)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == NUM_STEPS
    assert all(row["reward/mean"] == 0.0 for row in rows)  # the KL is the only signal
    kl = [row["distill/reverse_kl"] for row in rows]
    first, last = statistics.fmean(kl[:5]), statistics.fmean(kl[-5:])
    assert last < 0.5 * first, f"the reverse KL to the teacher did not fall: {first:.4f} -> {last:.4f} ({kl})"
