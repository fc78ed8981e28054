"""A whole run on image prompts: JSONL rows with image files, the tiny Qwen2-VL and the hf engine, a few steps of the
embedded runtime; and the build-time errors of a vision-language model with an engine that takes no images and of
image prompts for a text-only model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sharpen.cli.errors import user_error_message
from sharpen.config import ConfigError, load_config
from sharpen.data.chat import ImageInputError
from sharpen.data.vision import VisionProcessor
from sharpen.monitoring import read_jsonl
from sharpen.orchestration.build import load_run_examples
from sharpen.orchestration.embedded import run_embedded
from sharpen.types import ImagePart
from support.vision_runs import COLOURS, image_run_config, vowel_reward, write_image_tasks


def test_a_run_on_jsonl_image_prompts_trains_and_probes_with_images(tiny_vlm_path: Path, tmp_path: Path) -> None:
    data = write_image_tasks(tmp_path)
    config = image_run_config(tiny_vlm_path, data, tmp_path / "runs")
    run_dir = run_embedded(config, reward_fn=vowel_reward)

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert row["train/num_loss_tokens"] > 0
        assert row["sync/probe_mismatch_mean"] < 1e-4
        # the probe prompts hold images: engine and trainer see the same pixels, so they agree to float32 rounding
        assert row["parity/num_tokens"] > 0 and row["parity/max_abs_diff"] < 1e-4
    assert rows[-1]["sync/probe_trainer_delta"] > 1e-4  # the weights moved

    # rows 0-1 show red.png, rows 2-3 blue.png; the recording holds each image's digest, never its bytes
    png = {colour: (tmp_path / "images" / f"{colour}.png").read_bytes() for colour in COLOURS}
    vision = VisionProcessor.from_pretrained(tiny_vlm_path)
    recorded = read_jsonl(run_dir / "rollouts.jsonl")
    assert {r["step"] for r in recorded} == {0, 1}
    for record in recorded:
        colour = "red" if int(record["task_key"].split("/")[1]) < 2 else "blue"
        [user] = record["prompt"]
        image, text = user["content"]
        assert image == {
            "type": "image",
            "sha256": hashlib.sha256(png[colour]).hexdigest(),
            "num_bytes": len(png[colour]),
        }
        assert text["type"] == "text"
        # one placeholder per image, expanded to the tokens the image takes after resize and patch merging
        [num_image_tokens] = vision.num_image_tokens([ImagePart(data=png[colour])])
        assert record["prompt_ids"].count(vision.image_token_id) == num_image_tokens > 0
    # the exported model is a vision-language model folder again: weights, tokenizer and image processor
    exported = VisionProcessor.from_pretrained(run_dir / "model")
    examples = {example.task_key: example for example in load_run_examples(config)}
    first = recorded[0]
    assert exported.render_prompt(examples[first["task_key"]].prompt) == first["prompt_ids"]


@pytest.mark.parametrize("engine", ["vllm_server", "sglang"])
def test_a_vision_model_with_an_engine_without_images_is_a_config_error_before_the_run(
    tiny_vlm_path: Path, tmp_path: Path, engine: str
) -> None:
    config = image_run_config(tiny_vlm_path, write_image_tasks(tmp_path), tmp_path / "runs", engine=engine)
    with pytest.raises(
        ConfigError,
        match=f'^rollout.engine.type = "{engine}" cannot run the vision-language model .*'
        'set rollout.engine.type = "hf" or "vllm"',
    ):
        run_embedded(config, reward_fn=vowel_reward)
    assert not (tmp_path / "runs").exists()  # refused before the run directory or any engine exists


def test_image_prompts_for_a_text_only_model_are_one_user_error(tiny_model_path: Path, tmp_path: Path) -> None:
    config = image_run_config(tiny_model_path, write_image_tasks(tmp_path), tmp_path / "runs")
    with pytest.raises(ImageInputError) as caught:
        load_run_examples(config)
    message = str(caught.value)
    assert message.startswith("task colours/0: the prompt holds 1 image(s) but model.path ")
    assert "is a text-only model; use a vision-language model" in message
    assert user_error_message(caught.value) == message  # `sharpen train` prints it as one line and exits with 2


def test_browser_screenshots_for_a_text_only_model_are_refused_before_the_run(tiny_model_path: Path) -> None:
    overrides = [
        'environment.type = "browser"',
        'environment.observation = "screenshot"',
        'data.type = "environment"',
        "data.size = 2",
        f"model.path = {json.dumps(str(tiny_model_path))}",
    ]
    with pytest.raises(ImageInputError, match=r'^environment.observation = "screenshot" \(browser screenshots\)'):
        load_run_examples(load_config(None, overrides))
