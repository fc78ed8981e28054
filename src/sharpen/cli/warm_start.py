"""Small demo models that `sharpen models pull` builds on this machine instead of converting shipped weights.

The colour models: a tiny random vision-language model from `sharpen.testing` after a short supervised warm start on
the colour task of `sharpen.data.visual_tasks`, one per architecture (`TINY_VLMS`):

- ``tiny-qwen2-vl-colours``: the tiny Qwen2-VL of `save_tiny_qwen2_vl` (about 3.3M parameters, most of them the
  49k-token embedding; a 1-block vision tower), for the ``hf`` engine (recipes/vision.toml).
- ``tiny-idefics3-colours``: the tiny Idefics3 (SmolVLM's architecture) of `save_tiny_idefics3` (about 6.6M
  parameters, again mostly the embedding; a 1-block SigLIP-style tower, images resized to one 64-pixel tile), which
  vLLM's CPU build serves (recipes/vision_vllm.toml).

The warm start teaches the answer FORMAT, not the task: each training image is paired with a colour word drawn
independently of it, so the best the model can do is answer one of the colour words (then end its turn) with about
equal probability whatever the image shows. Its reward on the task starts near chance (1/3), and what RL can add is
the image -> word mapping. These are plumbing-scale models, not vision models of any use.

Lives under cli because only the pull reaches it and it composes layers (data, testing) that a library layer would
not; seeded and single-threaded, so the same call gives the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from sharpen.data.visual_tasks import COLOURS, colour_image, colour_prompt
from sharpen.testing import save_tiny_idefics3, save_tiny_qwen2_vl
from sharpen.types import prompt_images

if TYPE_CHECKING:
    import torch

    from sharpen.data.vision import VisionProcessor

Architecture = Literal["qwen2_vl", "idefics3"]

TINY_VLMS: dict[Architecture, Callable[..., Path]] = {"qwen2_vl": save_tiny_qwen2_vl, "idefics3": save_tiny_idefics3}
"""The random tiny model of each architecture (`sharpen.testing`; torch is imported only when one is built)."""

WARM_START_STEPS = 100
WARM_START_BATCH = 16
WARM_START_LEARNING_RATE = 3e-3


def save_qwen2_vl_colours(folder: Path, *, tokenizer_from: Path) -> Path:
    """The builder of ``tiny-qwen2-vl-colours``."""
    return save_colour_warm_start(folder, tokenizer_from=tokenizer_from, architecture="qwen2_vl")


def save_idefics3_colours(folder: Path, *, tokenizer_from: Path) -> Path:
    """The builder of ``tiny-idefics3-colours``."""
    return save_colour_warm_start(folder, tokenizer_from=tokenizer_from, architecture="idefics3")


def save_colour_warm_start(
    folder: Path,
    *,
    tokenizer_from: Path,
    architecture: Architecture,
    num_steps: int = WARM_START_STEPS,
    batch_size: int = WARM_START_BATCH,
    learning_rate: float = WARM_START_LEARNING_RATE,
    seed: int = 0,
) -> Path:
    """Write the tiny random ``architecture`` model (`TINY_VLMS`) into ``folder``, then train it for ``num_steps``
    AdamW steps of next-token loss on the answer tokens of ``batch_size`` fresh colour images each, every answer a
    colour word drawn independently of its image; returns ``folder``."""
    import torch

    from sharpen.data.vision import VisionProcessor, model_class

    TINY_VLMS[architecture](folder, tokenizer_from=tokenizer_from)
    processor = VisionProcessor.from_pretrained(folder)
    model = model_class(folder).from_pretrained(folder, dtype=torch.float32)
    tokenizer = processor.tokenizer
    answers = {word: [*tokenizer.encode(word, add_special_tokens=False), tokenizer.eos_token_id] for word in COLOURS}
    rng = np.random.default_rng([seed, 1919])
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same sums in the same order on every machine: the same weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    model.train()
    try:
        for _ in range(num_steps):
            images = [colour_image(str(rng.choice(list(COLOURS))), rng) for _ in range(batch_size)]
            words = [str(rng.choice(list(COLOURS))) for _ in range(batch_size)]  # independent of the images
            input_ids, labels = _answer_batch(processor, images, [answers[word] for word in words])
            parts = [part for image in images for part in prompt_images(colour_prompt(image))]
            inputs = processor.model_inputs(input_ids, parts)
            loss = model(input_ids=input_ids, labels=labels, **inputs).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(folder)
    return Path(folder)


def _answer_batch(
    processor: VisionProcessor, images: list[bytes], answers: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` ([batch, seq]: each prompt then its answer, right-padded) and ``labels`` (the answer tokens,
    -100 elsewhere). Every prompt renders to the same length (same image size, same question)."""
    import torch

    rows = [processor.render_prompt(colour_prompt(image)) for image in images]
    width = max(len(row) + len(answer) for row, answer in zip(rows, answers, strict=True))
    pad = processor.tokenizer.pad_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [batch, seq]
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [batch, seq]
    for index, (row, answer) in enumerate(zip(rows, answers, strict=True)):
        input_ids[index, : len(row) + len(answer)] = torch.tensor(row + answer)
        labels[index, len(row) : len(row) + len(answer)] = torch.tensor(answer)
    return input_ids, labels
