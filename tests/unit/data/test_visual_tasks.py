"""The colour task: the same seed makes the same images and answers, each answer is the colour its image shows, and
the run's rubric (exact match on the last line, recipes/vision.toml) scores the right word 1 and any other 0."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from sharpen.config.rewards import RewardConfig
from sharpen.data.visual_tasks import COLOURS, IMAGE_SIZE, QUESTION, make_colour_tasks
from sharpen.rewards.rubric import Rubric
from sharpen.types import Example, RewardStatus, prompt_images


def mean_rgb(example: Example) -> np.ndarray:
    (image,) = prompt_images(example.prompt)
    with Image.open(io.BytesIO(image.data)) as opened:
        assert opened.format == "PNG" and opened.size == (IMAGE_SIZE, IMAGE_SIZE)
        return np.asarray(opened.convert("RGB"), dtype=np.float64).mean(axis=(0, 1))


def test_the_same_seed_makes_the_same_tasks_and_another_seed_others() -> None:
    first, again, other = make_colour_tasks(24, seed=3), make_colour_tasks(24, seed=3), make_colour_tasks(24, seed=4)
    assert [e.task_hash for e in first] == [e.task_hash for e in again]
    assert [e.answer for e in first] == [e.answer for e in again]
    assert not {e.task_hash for e in first} & {e.task_hash for e in other}
    assert len({e.task_hash for e in first}) == 24  # shades and noise differ between images of one colour


def test_each_answer_is_the_colour_the_image_shows() -> None:
    examples = make_colour_tasks(90, seed=0)
    assert {e.answer for e in examples} == set(COLOURS)  # all three colours occur
    centres = {name: np.array(rgb, dtype=np.float64) for name, rgb in COLOURS.items()}
    for example in examples:
        rgb = mean_rgb(example)
        nearest = min(centres, key=lambda name: float(np.linalg.norm(rgb - centres[name])))
        assert nearest == example.answer == example.metadata["colour"]
        assert int(np.argmax(rgb)) == list(COLOURS).index(str(example.answer))  # red, green, blue: the dominant channel


def test_a_task_is_one_user_message_with_the_image_then_the_question() -> None:
    (example,) = make_colour_tasks(1, seed=0)
    (message,) = example.prompt
    assert message.role == "user" and len(message.images) == 1 and message.text == QUESTION
    assert example.task_key == "colours/0" and example.metadata["verifier"] == "exact_match"


def test_the_rubric_scores_the_colour_word_only() -> None:
    example = make_colour_tasks(1, seed=1)[0]
    wrong = next(name for name in COLOURS if name != example.answer)
    rubric = Rubric(RewardConfig(answer_format="last_line"))
    assert rubric(example, f" {str(example.answer).capitalize()}\n").score == 1.0
    result = rubric(example, wrong)
    assert result.score == 0.0 and result.status == RewardStatus.WRONG


def test_no_tasks_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        make_colour_tasks(0, seed=0)
