"""Small test images as `ImagePart`s (PNG bytes made with PIL), image prompts for the tiny vision-language models,
an environment that answers with an image, and the check that the trainer recomputes an engine's logprobs of image
rollouts."""

from __future__ import annotations

import io
from pathlib import Path

from sharpen.environments import EpisodeContext, StepResult
from sharpen.trainer import SingleDeviceBackend
from sharpen.types import Example, ImagePart, Message, Rollout, TextPart


def png_image(color: tuple[int, int, int], *, size: tuple[int, int] = (84, 56), stripe: bool = False) -> ImagePart:
    """A ``size`` (width, height) PNG of one colour, with a white vertical stripe when ``stripe``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, color)
    if stripe:
        ImageDraw.Draw(image).rectangle((size[0] // 3, 0, size[0] // 2, size[1]), fill=(255, 255, 255))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return ImagePart(data=buffer.getvalue())


def image_prompt(image: ImagePart, question: str = "What colour is this?") -> tuple[Message, ...]:
    """One user turn: the image, then the question."""
    return (Message(role="user", content=(image, TextPart(text=question))),)


def assert_trainer_agrees(model: Path | SingleDeviceBackend, rollouts: list[Rollout]) -> None:
    """The trainer's logprobs of each rollout's generated tokens, from its tokens and images, are the engine's.
    ``model``: the engine's weights, as a model folder or a trainer backend that holds them."""
    import pytest
    import torch

    from sharpen.config.schema import TrainerConfig

    if isinstance(model, SingleDeviceBackend):
        backend = model
    else:
        config = TrainerConfig(device="cpu", precision="float32", num_threads=1)
        backend = SingleDeviceBackend(config, model_path=model, dtype="float32")
    for rollout in rollouts:
        ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
        is_generated = torch.tensor(rollout.loss_mask or [True] * len(rollout.completion_ids))
        targets = torch.zeros((1, ids.shape[1] - 1), dtype=torch.bool)
        targets[0, len(rollout.prompt_ids) - 1 :] = is_generated
        with torch.no_grad():
            scores = backend.score_tokens(ids, torch.ones_like(ids), targets, temperature=1.0, images=[rollout.images])
        engine_logprobs = torch.tensor(rollout.completion_logprobs)[is_generated]
        assert scores.logprobs[targets].tolist() == pytest.approx(engine_logprobs.tolist(), abs=1e-4)


def trainer_logprobs(
    backend: SingleDeviceBackend, prompt: list[int], completion: list[int], images: tuple[ImagePart, ...]
) -> list[float]:
    """The backend's logprobs of ``completion`` after ``prompt`` (whose placeholders ``images`` stand for)."""
    import torch

    ids = torch.tensor([prompt + completion])
    targets = torch.zeros((1, ids.shape[1] - 1), dtype=torch.bool)
    targets[0, len(prompt) - 1 :] = True
    with torch.no_grad():
        scores = backend.score_tokens(ids, torch.ones_like(ids), targets, temperature=1.0, images=[images])
    return scores.logprobs[0, len(prompt) - 1 :].tolist()


class ShowsAnImage:
    """Answers the first turn with a picture and a question, then ends the episode."""

    name, version = "shows_an_image", "1"
    picture = png_image((30, 200, 30), size=(56, 56))

    def __init__(self) -> None:
        self.answered = False

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        return list(example.prompt)

    async def step(self, action: str) -> StepResult:
        if self.answered:
            return StepResult(terminated=True)
        self.answered = True
        observation = Message(role="user", content=(TextPart(text="And this one?"), self.picture))
        return StepResult(observation=[observation])
