"""Episodes with images, end to end on the tiny Qwen2-VL and the transformers engine: the episode runner renders the
prompt with the vision processor, the engine gets the images with it (batched or lockstep), and each rollout carries
its images, whose pixels the trainer turns back into the engine's logprobs. A multi-turn environment may answer with
an image: its tokens are appended as rendered (exact continuity), never trained on, and its image joins the
rollout's. An engine that takes no images, or a runner without a vision processor, refuses them with one clear
error."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharpen.data.chat import ImageInputError
from sharpen.data.vision import VisionProcessor
from sharpen.environments import EpisodeLimits
from sharpen.rollout.engines.base import EngineError
from sharpen.rollout.engines.hf import HfEngine
from sharpen.rollout.engines.scripted import ScriptedEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Example, Message, SamplingParams
from support.images import ShowsAnImage, assert_trainer_agrees, image_prompt, png_image

EXAMPLES = [
    Example(task_key="colour/0", prompt=image_prompt(png_image((200, 30, 30)))),
    Example(task_key="colour/1", prompt=image_prompt(png_image((30, 30, 200), size=(112, 84), stripe=True))),
    Example(task_key="text/0", prompt=(Message(role="user", content="No image here."),)),
]
SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0)


@pytest.fixture(scope="module")
def vision(tiny_vlm_path: Path) -> VisionProcessor:
    return VisionProcessor.from_pretrained(tiny_vlm_path)


@pytest.fixture(scope="module")
def engine(tiny_vlm_path: Path) -> HfEngine:
    return HfEngine(tiny_vlm_path)


@pytest.mark.parametrize("scheduling", ["async", "lockstep"])
def test_image_episodes_carry_their_images_and_the_trainer_recomputes_their_logprobs(
    tiny_vlm_path, vision, engine, scheduling
):
    runner = EpisodeRunner(tokenizer=vision.tokenizer, vision=vision, scheduling=scheduling)
    groups = runner.generate_groups(engine, EXAMPLES, sampling=SAMPLING, num_samples=2, seed=3)
    rollouts = [r for g in groups for r in g.rollouts]
    for rollout in rollouts:
        assert rollout.images == tuple(image for m in rollout.example.prompt for image in m.images)
        assert rollout.prompt_ids == vision.render_prompt(rollout.example.prompt)
        assert rollout.completion_ids
    assert_trainer_agrees(tiny_vlm_path, rollouts)


def test_an_image_in_an_observation_joins_the_episode_with_exact_token_continuity(tiny_vlm_path, vision, engine):
    runner = EpisodeRunner(
        tokenizer=vision.tokenizer, vision=vision, make_environment=ShowsAnImage, limits=EpisodeLimits(max_turns=2)
    )
    # a random model would not end its turn: every token stops it (the runner then closes the turn itself)
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=tuple(range(len(vision.tokenizer))))
    [group] = runner.generate_groups(engine, EXAMPLES[:1], sampling=sampling, num_samples=2, seed=5)
    for rollout in group.rollouts:
        assert rollout.episode is not None and len(rollout.episode.turns) == 2
        observation_ids = rollout.episode.turns[0].observation_ids
        first = rollout.episode.turns[0].num_action_tokens
        assert rollout.completion_ids[first : first + len(observation_ids)] == observation_ids  # as rendered
        assert rollout.loss_mask == [True] * first + [False] * len(observation_ids) + [True] * (
            len(rollout.completion_ids) - first - len(observation_ids)
        )
        assert observation_ids.count(vision.image_token_id) == 4  # 56x56: 4x4 patches, merged 2x2
        assert rollout.images == (*EXAMPLES[0].prompt[0].images, ShowsAnImage.picture)
    assert_trainer_agrees(tiny_vlm_path, group.rollouts)


def test_an_engine_without_images_refuses_image_prompts(vision):
    engine = ScriptedEngine(["red"], encode=lambda text: vision.tokenizer.encode(text, add_special_tokens=False))
    runner = EpisodeRunner(tokenizer=vision.tokenizer, vision=vision)
    with pytest.raises(EngineError, match=r"ScriptedEngine takes no image prompts yet"):
        runner.generate_groups(engine, EXAMPLES[:1], sampling=SAMPLING, num_samples=1, seed=0)


def test_a_runner_without_a_vision_processor_refuses_image_prompts(vision, engine):
    runner = EpisodeRunner(tokenizer=vision.tokenizer)
    with pytest.raises(ImageInputError, match=r"1 image\(s\), which a text-only tokenizer cannot render"):
        runner.generate_groups(engine, EXAMPLES[:1], sampling=SAMPLING, num_samples=1, seed=0)
