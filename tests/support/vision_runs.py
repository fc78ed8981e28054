"""A run on image prompts, for the tests that train a vision-language model end to end: a JSONL file of four rows
showing two PNGs, a reward that varies on random text, and the run's config."""

from __future__ import annotations

import json
from pathlib import Path

from sharpen.config import SharpenConfig, load_config
from sharpen.types import Example, RewardResult, RewardStatus

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}


def write_image_tasks(folder: Path) -> Path:
    """Two PNGs in ``folder/images`` and a JSONL file of four rows that show them (paths relative to the file)."""
    from PIL import Image

    (folder / "images").mkdir()
    rows = []
    for name, rgb in COLOURS.items():
        Image.new("RGB", (84, 56), rgb).save(folder / "images" / f"{name}.png")
        for question in ("What colour is this?", "Name the colour."):
            rows.append({"prompt": question, "images": [f"images/{name}.png"], "answer": name})
    path = folder / "colours.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def vowel_reward(example: Example, completion: str) -> RewardResult:
    """Random tokens give varied scores, so advantages are non-zero and the weights move."""
    score = sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)
    return RewardResult(score=score, status=RewardStatus.OK, components={"vowels": score}, verifier="vowels")


def image_run_config(model: Path, data: Path, out: Path, *, engine: str = "hf") -> SharpenConfig:
    overrides = {
        "run.name": json.dumps("vision"),
        "run.output_dir": json.dumps(str(out)),
        "run.num_steps": "2",
        "model.path": json.dumps(str(model)),
        "data.type": '"jsonl"',
        "data.path": json.dumps(str(data)),
        "data.system_prompt": '""',
        "rollout.engine.type": json.dumps(engine),
        "rollout.prompts_per_step": "2",
        "rollout.num_samples_per_prompt": "2",
        "rollout.max_new_tokens": "6",
        "trainer.micro_batch_size": "4",
        "trainer.learning_rate": "1e-3",
        "trainer.precision": '"float32"',
        "monitoring.parity_probe_every": "1",
        "monitoring.parity_probe_size": "2",
        "monitoring.parity_probe_max_new_tokens": "4",
        "monitoring.progress": "false",
    }
    return load_config(None, [f"{key}={value}" for key, value in overrides.items()])
