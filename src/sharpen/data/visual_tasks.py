"""A synthetic visual task whose answer is in the image only: "What colour is the image?" over PNGs drawn with PIL
from a seed (a solid colour in a random shade, speckled with pixel noise), answered with one colour word.

It owns the images, the prompts and the reference answers, and makes them for a run as environment tasks
(``environment.tasks = "sharpen.data.visual_tasks:make_colour_tasks"``, scored by the run's exact-match rubric on the
last line). It does not train or score anything; the warm-started model that answers in this format is
`sharpen.cli.warm_start`'s.
"""

from __future__ import annotations

import io

import numpy as np

from sharpen.types import Example, ImagePart, Message, TextPart

COLOURS: dict[str, tuple[int, int, int]] = {"red": (200, 40, 40), "green": (40, 170, 60), "blue": (40, 60, 200)}
"""The answer words and the centre of each colour's shades (RGB)."""

QUESTION = "What colour is the image? Answer with one word."
IMAGE_SIZE = 112
"""Side of the square images in pixels: 8x8 patches of 14, so 16 placeholder tokens in the tiny Qwen2-VL's prompt."""
SHADE_JITTER = 30
"""How far each channel of an image's base shade may be from its colour's centre."""
NOISE = 12
"""Spread of the per-pixel noise on each channel."""


def colour_image(colour: str, rng: np.random.Generator) -> bytes:
    """A PNG (``IMAGE_SIZE`` square) of ``colour`` in a shade drawn from ``rng``, with per-pixel noise."""
    from PIL import Image

    centre = np.array(COLOURS[colour], dtype=np.int64)
    shade = centre + rng.integers(-SHADE_JITTER, SHADE_JITTER + 1, size=3)
    noise = rng.integers(-NOISE, NOISE + 1, size=(IMAGE_SIZE, IMAGE_SIZE, 3))
    pixels = np.clip(shade + noise, 0, 255).astype(np.uint8)  # [height, width, rgb]
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def colour_prompt(image: bytes) -> tuple[Message, ...]:
    """The question about ``image``: one user message, the image before the text (Qwen2-VL's usual order)."""
    return (Message(role="user", content=(ImagePart(data=image), TextPart(text=QUESTION))),)


def make_colour_tasks(num_tasks: int, *, seed: int) -> list[Example]:
    """``num_tasks`` colour questions from ``seed`` (the same seed gives the same images and answers), the colours
    drawn uniformly; each answer is its image's colour word, checked by exact match."""
    if num_tasks < 1:
        raise ValueError(f"make_colour_tasks: num_tasks must be at least 1, got {num_tasks}")
    rng = np.random.default_rng([seed, 19])
    names = list(COLOURS)
    examples = []
    for index in range(num_tasks):
        colour = names[int(rng.integers(len(names)))]
        examples.append(
            Example(
                task_key=f"colours/{index}",
                prompt=colour_prompt(colour_image(colour, rng)),
                answer=colour,
                metadata={"verifier": "exact_match", "colour": colour},
            )
        )
    return examples
