"""vLLM on the CPU serves a vision-language model (a tiny random Idefics3, SmolVLM's architecture): image prompts go in
as vLLM's multimodal requests, and its logprobs match the trainer's from the same images; a weight sync reaches the
vision tower; the parity probe runs on image prompts; a multi-turn episode that shows an image in an observation
keeps exact token continuity; a short run trains on image prompts through vLLM. One engine for the module."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sharpen.config import ConfigError
from sharpen.config.engines import VllmEngineConfig
from sharpen.config.schema import TrainerConfig
from sharpen.data.vision import VisionProcessor
from sharpen.environments import EpisodeLimits
from sharpen.monitoring import read_jsonl
from sharpen.monitoring.parity import build_probe_set
from sharpen.orchestration.build import load_run_examples
from sharpen.orchestration.embedded import run_embedded
from sharpen.rollout.engines.base import ImageEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.types import Example, Message, SamplingParams
from support.images import ShowsAnImage, assert_trainer_agrees, image_prompt, png_image, trainer_logprobs
from support.vision_runs import image_run_config, vowel_reward, write_image_tasks

pytestmark = pytest.mark.slow

IMAGES = (png_image((200, 30, 30)), png_image((30, 30, 200), size=(112, 84), stripe=True))
QUESTIONS = ("What colour is this?", "Which colour is shown in this picture?")
TOLERANCE = 1e-4  # float32 on both sides: measured ~1e-6


@pytest.fixture(scope="module")
def engine(tiny_idefics3_path: Path) -> Iterator:
    from sharpen.rollout.engines.vllm import VllmEngine

    engine = VllmEngine(VllmEngineConfig(max_model_len=512), model_path=tiny_idefics3_path, dtype="float32", seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def backend(tiny_idefics3_path: Path) -> SingleDeviceBackend:
    config = TrainerConfig(device="cpu", precision="float32", num_threads=1)
    return SingleDeviceBackend(config, model_path=tiny_idefics3_path, dtype="float32")


@pytest.fixture(scope="module")
def vision(tiny_idefics3_path: Path) -> VisionProcessor:
    return VisionProcessor.from_pretrained(tiny_idefics3_path)


def _max_difference(engine, backend, vision) -> float:
    prompts = [vision.render_prompt(image_prompt(i, q)) for i, q in zip(IMAGES, QUESTIONS, strict=True)]
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed) for seed in (3, 4)]
    completions = engine.generate_with_images(prompts, [(image,) for image in IMAGES], params)
    differences = []
    for prompt, completion, image in zip(prompts, completions, IMAGES, strict=True):
        recomputed = trainer_logprobs(backend, prompt, completion.token_ids, (image,))
        differences += [abs(a - b) for a, b in zip(completion.logprobs, recomputed, strict=True)]
    return max(differences)


def test_vllm_generates_from_image_prompts_with_the_trainers_logprobs(engine, backend, vision) -> None:
    prompts = [vision.render_prompt(image_prompt(i, q)) for i, q in zip(IMAGES, QUESTIONS, strict=True)]
    text = vision.render_prompt((Message(role="user", content="No picture here."),))
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed) for seed in (3, 4, 5)]
    # image prompts and a text prompt in one batch
    completions = engine.generate_with_images([*prompts, text], [(IMAGES[0],), (IMAGES[1],), ()], params)
    assert all(c.token_ids for c in completions)
    for prompt, completion, image, question in zip(prompts, completions[:2], IMAGES, QUESTIONS, strict=True):
        recomputed = trainer_logprobs(backend, prompt, completion.token_ids, (image,))
        difference = max(abs(a - b) for a, b in zip(completion.logprobs, recomputed, strict=True))
        assert difference < TOLERANCE, f"vLLM vs trainer logprobs differ by {difference:.2e}"
        # the image is an input: vLLM scores the same tokens differently under the other image
        other = IMAGES[1] if image is IMAGES[0] else IMAGES[0]
        swapped = vision.render_prompt(image_prompt(other, question))
        engine_swapped = engine.score(swapped + completion.token_ids, (other,))[len(swapped) - 1 :]
        assert max(abs(a - b) for a, b in zip(engine_swapped, completion.logprobs, strict=True)) > 1e-3
    assert isinstance(engine, ImageEngine)  # what the episode runner checks before it sends images
    # the text prompt's logprobs are the trainer's without images
    recomputed = trainer_logprobs(backend, text, completions[2].token_ids, ())
    assert max(abs(a - b) for a, b in zip(completions[2].logprobs, recomputed, strict=True)) < TOLERANCE


def test_placeholders_without_images_or_a_wrong_block_are_refused(engine, vision) -> None:
    prompt = vision.render_prompt(image_prompt(IMAGES[0]))
    with pytest.raises(ValueError, match="image placeholders but no images"):
        engine.generate([prompt], [SamplingParams(max_new_tokens=2)])
    broken = [token for index, token in enumerate(prompt) if index != prompt.index(vision.image_token_id)]
    with pytest.raises(ValueError, match="placeholder block is not in the token ids"):
        engine.generate_with_images([broken], [(IMAGES[0],)], [SamplingParams(max_new_tokens=2)])


def test_the_parity_probe_runs_on_image_prompts(engine, backend, vision) -> None:
    prompts = [vision.render_prompt(image_prompt(i, q)) for i, q in zip(IMAGES, QUESTIONS, strict=True)]
    probe = build_probe_set(prompts, engine, max_new_tokens=8, images=[(image,) for image in IMAGES])
    trainer = Trainer(backend.config, backend=backend, pad_token_id=vision.tokenizer.pad_token_id)
    metrics = probe.run(trainer, engine)
    assert metrics["parity/num_tokens"] == probe.num_tokens > 0
    assert metrics["parity/max_abs_diff"] < TOLERANCE


def test_a_weight_sync_reaches_the_vision_tower_and_the_connector(engine, backend, vision) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in backend.model.named_parameters():
            if "vision_model" in name or "connector" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    prompt = vision.render_prompt(image_prompt(IMAGES[0]))
    before = engine.score(prompt, (IMAGES[0],))
    engine.load_weights(backend.named_weights(), version=1)
    after = engine.score(prompt, (IMAGES[0],))
    # only the vision side changed: the image's features move the prompt's later logprobs
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3
    assert _max_difference(engine, backend, vision) < TOLERANCE


def test_an_episode_with_an_image_observation_keeps_exact_token_continuity(engine, backend, vision):
    runner = EpisodeRunner(
        tokenizer=vision.tokenizer, vision=vision, make_environment=ShowsAnImage, limits=EpisodeLimits(max_turns=2)
    )
    # a random model would not end its turn: every token stops it (the runner then closes the turn itself)
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=tuple(range(len(vision.tokenizer))))
    example = Example(task_key="colour/0", prompt=image_prompt(IMAGES[0]))
    [group] = runner.generate_groups(engine, [example], sampling=sampling, num_samples=2, seed=5)
    for rollout in group.rollouts:
        assert rollout.episode is not None and len(rollout.episode.turns) == 2
        observation_ids = rollout.episode.turns[0].observation_ids
        first = rollout.episode.turns[0].num_action_tokens
        assert rollout.completion_ids[first : first + len(observation_ids)] == observation_ids  # as rendered
        assert observation_ids.count(vision.image_token_id) == vision.num_image_tokens([ShowsAnImage.picture])[0]
        assert rollout.images == (IMAGES[0], ShowsAnImage.picture)
    # the second turn's request held both images: vLLM expanded them exactly as rendered, and its logprobs are
    # the trainer's over the whole episode
    assert_trainer_agrees(backend, group.rollouts)


def test_a_run_trains_on_image_prompts_through_vllm(engine, tiny_idefics3_path: Path, tmp_path: Path) -> None:
    """On the module's engine (the run's first weight sync gives it the run's weights, whatever earlier tests
    loaded)."""
    config = image_run_config(tiny_idefics3_path, write_image_tasks(tmp_path), tmp_path / "runs", engine="vllm")
    run_dir = run_embedded(config, reward_fn=vowel_reward, engine=engine)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert row["train/num_loss_tokens"] > 0
        # the weights synced into vLLM: its probe of the image prompts agrees with the trainer's
        assert row["sync/probe_mismatch_mean"] < TOLERANCE
        assert row["parity/num_tokens"] > 0 and row["parity/max_abs_diff"] < TOLERANCE
    assert rows[-1]["sync/probe_trainer_delta"] > 1e-4
    assert (
        VisionProcessor.from_pretrained(run_dir / "model").image_token_id
        == VisionProcessor.from_pretrained(tiny_idefics3_path).image_token_id
    )


def test_a_vision_model_vllm_cannot_load_is_a_config_error(tiny_vlm_path: Path, tmp_path: Path) -> None:
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: vLLM's Qwen2-VL module may load")
    config = image_run_config(tiny_vlm_path, write_image_tasks(tmp_path), tmp_path / "runs", engine="vllm")
    with pytest.raises(ConfigError, match=r'^rollout.engine.type = "vllm" cannot run Qwen2VLForConditionalGeneration'):
        load_run_examples(config)


def test_vllms_async_engine_takes_image_requests_and_image_episodes(tiny_idefics3_path: Path, vision) -> None:
    """``async_engine = true``: image prompts one by one (the episodes' direct requests) and in a batch, with the
    trainer's logprobs before and after a weight update that reaches the vision tower."""
    from sharpen.rollout.engines import build_engine
    from sharpen.rollout.engines.base import AsyncImageEngine, request_level

    config = VllmEngineConfig(max_model_len=512, async_engine=True)
    engine = build_engine(config, model_path=tiny_idefics3_path, dtype="float32", seed=0)
    try:
        assert isinstance(engine, AsyncImageEngine) and request_level(engine) is engine
        trainer_config = TrainerConfig(device="cpu", precision="float32", num_threads=1)
        backend = SingleDeviceBackend(trainer_config, model_path=tiny_idefics3_path, dtype="float32")
        runner = EpisodeRunner(tokenizer=vision.tokenizer, vision=vision)  # async scheduling: direct requests
        examples = [Example(task_key=f"colour/{i}", prompt=image_prompt(image)) for i, image in enumerate(IMAGES)]
        sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
        for version in (0, 1):
            groups = runner.generate_groups(engine, examples, sampling=sampling, num_samples=2, seed=version)
            rollouts = [r for g in groups for r in g.rollouts]
            assert all(r.images and r.completion_ids for r in rollouts)
            assert_trainer_agrees(backend, rollouts)
            assert _max_difference(engine, backend, vision) < TOLERANCE  # the batch path
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for name, param in backend.model.named_parameters():
                    if "vision_model" in name:
                        param.add_(torch.randn(param.shape, generator=generator) * 0.05)
            engine.load_weights(backend.named_weights(), version=version + 1)
    finally:
        engine.close()
