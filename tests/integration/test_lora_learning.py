"""GRPO with LoRA raises the reward of the tiny task of test_learning.py: only the adapters train, the transformers
engine receives the merged projections each step, and the probe check passes every sync.

The shared tiny model's tied embedding has std 0.02, so its logits lie within ~0.6 nats of each other whatever the
hidden state, and its policy is near-uniform over 49k tokens: full fine-tuning climbs by moving the embedding
itself, which LoRA never touches (measured: 10 steps pushing 4 tokens up moved their summed logprob by 37 nats fully
fine-tuned, by 1.3 with LoRA, at learning rates 5e-2 to 1). Here the embedding is scaled 40x (std 0.8), which gives
the projections room to steer the output. Measured here (one thread, 30 steps, ~30 s): 0.30 over the first five
steps -> 0.45 over the last five; the test asks for +0.1.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import cast

import pytest
import torch

from sharpen.monitoring import read_jsonl
from support.vowel_task import run_vowel_task


@pytest.fixture(scope="module")
def steerable_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its (tied) embedding scaled 10x, and its tokenizer files."""
    import shutil

    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("steerable-tiny")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        cast(torch.nn.Embedding, model.get_input_embeddings()).weight.mul_(40.0)
    model.save_pretrained(folder)
    for path in tiny_model_path.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(path, folder / path.name)
    return folder


def test_grpo_with_lora_raises_the_reward_of_a_tiny_task(steerable_model_path: Path, tmp_path: Path) -> None:
    lora = {"trainer.lora.enabled": "true", "trainer.lora.rank": "16", "trainer.lora.alpha": "32"}
    export = {"run.export_model": "true"}
    run_dir = run_vowel_task(
        name="learn-lora",
        output_dir=tmp_path,
        model_path=steerable_model_path,
        learning_rate="2e-2",
        precision="float32",
        **export,
        **lora,
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    rewards = [row["reward/mean"] for row in rows]
    assert len(rewards) == 30
    assert all(row["sync/probe_mismatch_mean"] < 1e-4 for row in rows)
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    assert last >= first + 0.1, f"reward did not go up: {first:.3f} -> {last:.3f} ({rewards})"
    exported = [p.name for p in run_dir.rglob("adapter_config.json")]
    assert exported, "the export has the adapter beside the merged model"
