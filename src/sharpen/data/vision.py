"""Images in prompts: messages with image parts -> token ids, and a prompt's images -> the model's pixel inputs.

Owns the one place where images become model inputs, for the engine and the trainer alike, so that both compute the
same pixels from the same `ImagePart`s (rollouts carry the images, not pixel tensors: an image file is a fraction of
its float32 patches, and vLLM takes images too). The placeholder convention is Qwen2-VL's: the chat template writes
one ``<|image_pad|>`` per image part, which `VisionProcessor.render_prompt` expands to the number of tokens the
image takes after the image processor's resize and patch merging (what transformers' ``Qwen2VLProcessor`` does; that
class is not used because it insists on a video processor, which needs torchvision).

Does not load model weights or run a model; `is_vision_model` and `model_class` only read a folder's config so the
engine and the trainer pick the right transformers class. Text-only prompts keep going through `chat.render_prompt`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sharpen.data.chat import ImageInputError, continuation_ids, template_ids
from sharpen.types import ImagePart, Message, TextPart

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image


def text_only_error(where: str, num_images: int, model: str) -> ImageInputError:
    """The one error for images given to a text-only model (the same words wherever it is caught)."""
    return ImageInputError(
        f"{where}: the prompt holds {num_images} image(s) but {model} is a text-only model; "
        "use a vision-language model (e.g. a Qwen2-VL folder) or drop the image parts"
    )


def is_vision_model(folder: Path) -> bool:
    """Whether the HF model folder holds a vision-language model (its config has a ``vision_config``)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return "vision_config" in config


def model_class(folder: Path) -> Any:
    """The transformers auto class that loads the folder's model with its language-model head:
    ``AutoModelForImageTextToText`` for a vision-language model, else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(folder) else AutoModelForCausalLM


def load_image(image: ImagePart, index: int) -> Image:
    """``image`` as an RGB PIL image; an unreadable one is an `ImageInputError` naming it."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    source = image.path or f"{len(image.data)} bytes"
    try:  # a user's file: anything PIL cannot decode is a clear error, not a traceback from deep inside PIL
        with PILImage.open(image.path or io.BytesIO(image.data)) as opened:
            return opened.convert("RGB")
    except (OSError, UnidentifiedImageError) as error:
        raise ImageInputError(f"image {index} of the prompt ({source}) cannot be read: {error}") from error


class VisionProcessor:
    """A vision-language model's tokenizer and image processor (Qwen2-VL's placeholder convention)."""

    def __init__(self, tokenizer: Any, image_processor: Any, *, image_token_id: int) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge_size: int = image_processor.merge_size

    @classmethod
    def from_pretrained(cls, folder: Path) -> VisionProcessor:
        """The processor of the model folder; a text-only model's folder is an `ImageInputError`."""
        config = json.loads((Path(folder) / "config.json").read_text())
        if "vision_config" not in config:
            raise text_only_error("VisionProcessor", 1, f"{folder} ({config.get('model_type', 'unknown type')})")
        from transformers import AutoImageProcessor, AutoTokenizer

        return cls(
            AutoTokenizer.from_pretrained(folder),
            AutoImageProcessor.from_pretrained(folder),
            image_token_id=int(config["image_token_id"]),
        )

    def render_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of ``messages`` under the chat template, ending with the assistant generation prompt, each image
        part's placeholder expanded to the tokens its image takes (`chat.render_prompt` for images)."""
        if not messages:
            raise ValueError("render_prompt: no messages to render")
        ids = template_ids(self.tokenizer, [_template_message(m) for m in messages], add_generation_prompt=True)
        return self._expand(ids, messages)

    def render_continuation(self, messages: Sequence[Message], *, end_of_turn_id: int) -> list[int]:
        """`chat.render_continuation` for observations that hold images (a multi-turn episode's): the tokens after an
        assistant turn, each image part's placeholder expanded. They are appended to the episode's tokens as they
        are, and the observation's images follow the earlier ones in the rollout's `images`."""
        if not messages:
            raise ValueError("render_continuation: no messages to render")
        parts = [_template_message(m) for m in messages]
        return self._expand(continuation_ids(self.tokenizer, parts, end_of_turn_id=end_of_turn_id), messages)

    def _expand(self, ids: list[int], messages: Sequence[Message]) -> list[int]:
        """``ids`` (one placeholder per image part of ``messages``) with each placeholder repeated to its image's
        number of tokens."""
        images = [image for message in messages for image in message.images]
        if ids.count(self.image_token_id) != len(images):
            raise ValueError(
                f"render_prompt: the chat template wrote {ids.count(self.image_token_id)} image placeholders for "
                f"{len(images)} image parts (its template must render each image part as one placeholder)"
            )
        sizes = iter(self.num_image_tokens(images))
        expanded: list[int] = []
        for token in ids:
            expanded.extend([token] * next(sizes) if token == self.image_token_id else [token])
        return expanded

    def num_image_tokens(self, images: Sequence[ImagePart]) -> list[int]:
        """How many placeholder tokens each image takes in the prompt."""
        return self.num_tokens_of(self.pixel_inputs(images)["image_grid_thw"]) if images else []

    def pixel_inputs(self, images: Sequence[ImagePart]) -> dict[str, torch.Tensor]:
        """``pixel_values`` ([num_patches, patch_dim], the images' patches one after the other) and ``image_grid_thw``
        ([num_images, 3]) of ``images``, in order."""
        if not images:
            raise ValueError("pixel_inputs: no images")
        loaded = [load_image(image, index) for index, image in enumerate(images)]
        processed = self.image_processor(images=loaded, return_tensors="pt")
        return {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}

    def model_inputs(self, input_ids: torch.Tensor, images: Sequence[ImagePart]) -> dict[str, torch.Tensor]:
        """The keyword inputs a forward pass (or ``generate``) of the model needs beside ``input_ids`` ([batch, seq],
        the rows' images in row order): `pixel_inputs` plus ``mm_token_type_ids`` (1 at image placeholders), from
        which the model computes its 3-D (M-RoPE) positions. The placeholders must match the images exactly; rows
        without images get no inputs (and must hold no placeholders)."""
        is_image = input_ids == self.image_token_id  # [batch, seq]
        if not images:
            if bool(is_image.any()):
                raise ValueError(
                    f"the token ids hold {int(is_image.sum())} image placeholders but no images: pass the images "
                    "each prompt was rendered with"
                )
            return {}
        inputs = self.pixel_inputs(images)
        expected = sum(self.num_tokens_of(inputs["image_grid_thw"]))
        if int(is_image.sum()) != expected:
            raise ValueError(
                f"the token ids hold {int(is_image.sum())} image placeholders, but their {len(images)} image(s) take "
                f"{expected}: render image prompts with VisionProcessor.render_prompt"
            )
        pixel_values = inputs["pixel_values"].to(input_ids.device)
        image_grid_thw = inputs["image_grid_thw"].to(input_ids.device)
        return {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw, "mm_token_type_ids": is_image.int()}

    def num_tokens_of(self, image_grid_thw: torch.Tensor) -> list[int]:
        """Placeholder tokens of each image of ``image_grid_thw`` ([num_images, 3]): its patches over the merge."""
        return [int(n) // self.merge_size**2 for n in image_grid_thw.prod(dim=-1)]


def _template_message(message: Message) -> dict[str, Any]:
    """A message as the chat template reads it: a string, or OpenAI-style parts without the image bytes (the
    template only writes a placeholder per image)."""
    if isinstance(message.content, str):
        return {"role": message.role, "content": message.content}
    parts = [
        {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
        for part in message.content
    ]
    return {"role": message.role, "content": parts}
