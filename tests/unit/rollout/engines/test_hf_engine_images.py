"""The transformers engine generates from image prompts of the tiny Qwen2-VL and Idefics3, and the trainer
recomputes the same logprobs from the same images (the engine/trainer parity that the text path has, and the parity
probe on image prompts); image placeholders without their images, or images for a text-only model, are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.config.schema import TrainerConfig
from sharpen.data.chat import ImageInputError
from sharpen.data.vision import VisionProcessor
from sharpen.monitoring.parity import build_probe_set
from sharpen.rollout.engines.base import ImageEngine
from sharpen.rollout.engines.hf import HfEngine
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.types import ImagePart, SamplingParams
from support.images import image_prompt, png_image, trainer_logprobs

IMAGES = (png_image((200, 30, 30)), png_image((30, 30, 200), size=(112, 84), stripe=True))


@pytest.fixture(scope="module", params=["tiny_vlm_path", "tiny_idefics3_path"], ids=["qwen2_vl", "idefics3"])
def vlm_path(request: pytest.FixtureRequest) -> Path:
    """Each vision-language family sharpen renders: Qwen2-VL (M-RoPE positions), Idefics3 (image-token blocks)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def engine(vlm_path: Path) -> HfEngine:
    return HfEngine(vlm_path)


@pytest.fixture(scope="module")
def backend(vlm_path: Path) -> SingleDeviceBackend:
    config = TrainerConfig(device="cpu", precision="float32", num_threads=1)
    return SingleDeviceBackend(config, model_path=vlm_path, dtype="float32")


def test_engine_and_trainer_logprobs_of_image_prompts_agree(engine, backend, vlm_path):
    vision = VisionProcessor.from_pretrained(vlm_path)
    questions = ("What colour is this?", "Which colour is shown in this picture?")
    prompts = [vision.render_prompt(image_prompt(image, q)) for image, q in zip(IMAGES, questions, strict=True)]
    assert len(prompts[0]) != len(prompts[1])  # one batch, left-padded: positions (3-D in Qwen2-VL) skip the padding
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed) for seed in (3, 4)]
    assert isinstance(engine, ImageEngine)
    completions = engine.generate_with_images(prompts, [(image,) for image in IMAGES], params)
    differences = []
    for prompt, completion, image, question in zip(prompts, completions, IMAGES, questions, strict=True):
        assert completion.token_ids
        recomputed = trainer_logprobs(backend, prompt, completion.token_ids, (image,))
        differences += [abs(a - b) for a, b in zip(completion.logprobs, recomputed, strict=True)]
        # the images are inputs, not decoration: the other image gives other logprobs for the same tokens
        other = IMAGES[1] if image is IMAGES[0] else IMAGES[0]
        swapped = vision.render_prompt(image_prompt(other, question))
        if len(swapped) == len(prompt):
            assert trainer_logprobs(backend, swapped, completion.token_ids, (other,)) != recomputed
    assert max(differences) < 1e-4, f"engine vs trainer logprobs differ by up to {max(differences):.2e}"


def test_an_image_prompt_samples_the_same_tokens_alone_or_batched(engine, vlm_path):
    vision = VisionProcessor.from_pretrained(vlm_path)
    prompts = [vision.render_prompt(image_prompt(image)) for image in IMAGES]
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed) for seed in (7, 8)]
    together = engine.generate_with_images(prompts, [(image,) for image in IMAGES], params)
    alone = [engine.generate_with_images([p], [(i,)], [s])[0] for p, i, s in zip(prompts, IMAGES, params, strict=True)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


def test_the_parity_probe_runs_on_image_prompts(engine, backend, vlm_path):
    vision = VisionProcessor.from_pretrained(vlm_path)
    prompts = [vision.render_prompt(image_prompt(image)) for image in IMAGES]
    probe = build_probe_set(prompts, engine, max_new_tokens=8, images=[(image,) for image in IMAGES])
    assert probe.images == [(image,) for image in IMAGES]
    trainer = Trainer(backend.config, backend=backend, pad_token_id=vision.tokenizer.pad_token_id)
    metrics = probe.run(trainer, engine)
    assert metrics["parity/num_tokens"] == probe.num_tokens
    assert metrics["parity/max_abs_diff"] < 1e-4


def test_image_placeholders_without_their_images_are_refused(engine, backend, vlm_path):
    prompt = VisionProcessor.from_pretrained(vlm_path).render_prompt(image_prompt(IMAGES[0]))
    ids = torch.tensor([prompt])
    targets = torch.ones((1, len(prompt) - 1), dtype=torch.bool)
    with pytest.raises(ValueError, match="image placeholders but no images"):
        backend.score_tokens(ids, torch.ones_like(ids), targets, temperature=1.0)
    with pytest.raises(ValueError, match="image placeholders but no images"):
        engine.score(prompt)
    with pytest.raises(ValueError, match="image placeholders but no images"):
        engine.generate([prompt], [SamplingParams(max_new_tokens=2)])


def test_a_text_only_engine_given_an_image_is_one_clear_error(tiny_model_path):
    engine = HfEngine(tiny_model_path)
    with pytest.raises(ImageInputError, match=r"1 image\(s\) but .* is a text-only model"):
        engine.generate_with_images([[1, 2, 3]], [(ImagePart(data=b"png"),)], [SamplingParams(max_new_tokens=2)])
