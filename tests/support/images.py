"""Small test images as `ImagePart`s (PNG bytes made with PIL), and image prompts for the tiny Qwen2-VL."""

from __future__ import annotations

import io

from sharpen.types import ImagePart, Message, TextPart


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
