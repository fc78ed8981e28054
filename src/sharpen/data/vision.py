"""Images in prompts: messages with image parts -> token ids, and a prompt's images -> the model's pixel inputs.

Owns the one place where images become model inputs, for the engine and the trainer alike, so that both compute the
same pixels from the same `ImagePart`s (rollouts carry the images, not pixel tensors: an image file is a fraction of
its float32 patches, and vLLM takes images too). The chat template writes one placeholder per image part, which
`VisionProcessor.render_prompt` expands to the tokens the image takes after the image processor (per model family:
Qwen2-VL repeats its ``<|image_pad|>``, Idefics3 writes a block around its ``<image>`` tokens); `compact` undoes that
for vLLM, which expands placeholders itself.

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


def placeholders_without_images(num_placeholders: int) -> ValueError:
    """The one error for token ids that hold image placeholders given without their images."""
    return ValueError(
        f"the token ids hold {num_placeholders} image placeholders but no images: pass the images each prompt was "
        "rendered with"
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
    """A vision-language model's tokenizer and image processor. The chat template writes one placeholder token per
    image part; each model family says what that placeholder expands to (`image_blocks`) and which pixel inputs its
    forward pass takes (`pixel_inputs`, `model_inputs`). `from_pretrained` picks the family from the folder's
    config: Qwen2-VL (`Qwen2VLVision`) or Idefics3 (`Idefics3Vision`, the architecture vLLM's CPU build runs)."""

    def __init__(self, tokenizer: Any, image_processor: Any, *, image_token_id: int) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = image_token_id

    @classmethod
    def from_pretrained(cls, folder: Path) -> VisionProcessor:
        """The processor of the model folder; a text-only model's folder, or a family sharpen does not render, is an
        `ImageInputError`."""
        config = json.loads((Path(folder) / "config.json").read_text())
        model_type = config.get("model_type", "unknown type")
        if "vision_config" not in config:
            raise text_only_error("VisionProcessor", 1, f"{folder} ({model_type})")
        family = _FAMILIES.get(model_type)
        if family is None:
            raise ImageInputError(
                f"{folder} is a {model_type} vision-language model; sharpen renders image prompts for "
                f"{', '.join(sorted(_FAMILIES))} models"
            )
        return family.load(Path(folder), image_token_id=int(config["image_token_id"]))

    @classmethod
    def load(cls, folder: Path, *, image_token_id: int) -> VisionProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        return cls(
            AutoTokenizer.from_pretrained(folder),
            AutoImageProcessor.from_pretrained(folder),
            image_token_id=image_token_id,
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
        """``ids`` (one placeholder per image part of ``messages``) with each placeholder replaced by its image's
        block (`image_blocks`)."""
        images = [image for message in messages for image in message.images]
        if ids.count(self.image_token_id) != len(images):
            raise ValueError(
                f"render_prompt: the chat template wrote {ids.count(self.image_token_id)} image placeholders for "
                f"{len(images)} image parts (its template must render each image part as one placeholder)"
            )
        blocks = iter(self.image_blocks(images))
        expanded: list[int] = []
        for token in ids:
            expanded.extend(next(blocks) if token == self.image_token_id else [token])
        return expanded

    def compact(self, ids: Sequence[int], images: Sequence[ImagePart]) -> list[int]:
        """The inverse of the expansion: ``ids`` (a rendered prompt, or an episode's tokens so far) with each image's
        block back to the one placeholder the chat template wrote. vLLM takes prompts so and expands the placeholders
        itself; a block that is not where the ids say is a `ValueError`."""
        compacted: list[int] = []
        position = 0
        for index, block in enumerate(self.image_blocks(images)):
            try:
                first = ids.index(self.image_token_id, position)
            except ValueError:
                first = -1
            start = first - block.index(self.image_token_id)
            if first < 0 or start < position or list(ids[start : start + len(block)]) != block:
                raise ValueError(f"image {index}'s placeholder block is not in the token ids where its tokens begin")
            compacted.extend([*ids[position:start], self.image_token_id])
            position = start + len(block)
        if self.image_token_id in ids[position:]:
            raise ValueError(f"the token ids hold image placeholders beyond those of their {len(images)} image(s)")
        return [*compacted, *ids[position:]]

    def num_image_tokens(self, images: Sequence[ImagePart]) -> list[int]:
        """How many placeholder tokens each image takes in the prompt (those its features replace)."""
        return [block.count(self.image_token_id) for block in self.image_blocks(images)] if images else []

    def image_blocks(self, images: Sequence[ImagePart]) -> list[list[int]]:
        """The token ids each image's placeholder expands to."""
        raise NotImplementedError

    def pixel_inputs(self, images: Sequence[ImagePart]) -> dict[str, torch.Tensor]:
        """The pixel inputs of ``images``, in order, as the model's forward pass takes them."""
        raise NotImplementedError

    def model_inputs(self, input_ids: torch.Tensor, images: Sequence[ImagePart]) -> dict[str, torch.Tensor]:
        """The keyword inputs a forward pass (or ``generate``) of the model needs beside ``input_ids`` ([batch, seq],
        the rows' images in row order): `pixel_inputs` plus what the family adds (`_position_inputs`). The
        placeholders must match the images exactly; rows without images get no inputs (and must hold no
        placeholders)."""
        is_image = input_ids == self.image_token_id  # [batch, seq]
        if not images:
            if bool(is_image.any()):
                raise placeholders_without_images(int(is_image.sum()))
            return {}
        expected = sum(self.num_image_tokens(images))
        if int(is_image.sum()) != expected:
            raise ValueError(
                f"the token ids hold {int(is_image.sum())} image placeholders, but their {len(images)} image(s) take "
                f"{expected}: render image prompts with VisionProcessor.render_prompt"
            )
        inputs = {name: value.to(input_ids.device) for name, value in self.pixel_inputs(images).items()}
        return {**inputs, **self._position_inputs(is_image)}

    def _position_inputs(self, is_image: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inputs the model derives its positions from, given where the placeholders are (none by default)."""
        return {}


class Qwen2VLVision(VisionProcessor):
    """Qwen2-VL: the template writes ``<|vision_start|><|image_pad|><|vision_end|>`` per image and the placeholder
    repeats to the image's patches over the merge (what transformers' ``Qwen2VLProcessor`` does; that class is not
    used because it insists on a video processor, which needs torchvision)."""

    def __init__(self, tokenizer: Any, image_processor: Any, *, image_token_id: int) -> None:
        super().__init__(tokenizer, image_processor, image_token_id=image_token_id)
        self.merge_size: int = image_processor.merge_size

    def image_blocks(self, images: Sequence[ImagePart]) -> list[list[int]]:
        if not images:
            return []
        counts = self.num_tokens_of(self.pixel_inputs(images)["image_grid_thw"])
        return [[self.image_token_id] * count for count in counts]

    def pixel_inputs(self, images: Sequence[ImagePart]) -> dict[str, torch.Tensor]:
        """``pixel_values`` ([num_patches, patch_dim], the images' patches one after the other) and ``image_grid_thw``
        ([num_images, 3]) of ``images``, in order."""
        if not images:
            raise ValueError("pixel_inputs: no images")
        loaded = [load_image(image, index) for index, image in enumerate(images)]
        processed = self.image_processor(images=loaded, return_tensors="pt")
        return {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}

    def _position_inputs(self, is_image: torch.Tensor) -> dict[str, torch.Tensor]:
        """``mm_token_type_ids`` (1 at image placeholders), from which the model computes its 3-D (M-RoPE)
        positions."""
        return {"mm_token_type_ids": is_image.int()}

    def num_tokens_of(self, image_grid_thw: torch.Tensor) -> list[int]:
        """Placeholder tokens of each image of ``image_grid_thw`` ([num_images, 3]): its patches over the merge."""
        return [int(n) // self.merge_size**2 for n in image_grid_thw.prod(dim=-1)]


class Idefics3Vision(VisionProcessor):
    """Idefics3 (SmolVLM's architecture): the template writes one ``<image>`` per image, which expands to
    ``<fake_token_around_image><global-img>`` plus ``image_seq_len`` ``<image>`` tokens and a closing
    ``<fake_token_around_image>``, after one such block per tile (with its ``<row_i_col_j>`` tag) when the image
    processor splits large images. The block text is transformers' ``Idefics3Processor`` own; the pixels go in as
    ``pixel_values`` [1, num_tiles, 3, height, width] with their ``pixel_attention_mask``."""

    def __init__(self, tokenizer: Any, image_processor: Any, *, image_token_id: int, processor: Any) -> None:
        super().__init__(tokenizer, image_processor, image_token_id=image_token_id)
        self.processor = processor

    @classmethod
    def load(cls, folder: Path, *, image_token_id: int) -> VisionProcessor:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(folder)
        if processor.image_token_id != image_token_id:
            raise ImageInputError(
                f"{folder}: the processor's <image> token is {processor.image_token_id}, the model's {image_token_id}"
            )
        return cls(processor.tokenizer, processor.image_processor, image_token_id=image_token_id, processor=processor)

    def _processed(self, images: Sequence[ImagePart]) -> Any:
        if not images:
            raise ValueError("pixel_inputs: no images")
        loaded = [load_image(image, index) for index, image in enumerate(images)]
        # one row holding every image: the model drops no tile, and scatters the tiles' features over the
        # placeholders of the whole batch in order
        return self.image_processor(images=[loaded], return_tensors="pt", return_row_col_info=True)

    def image_blocks(self, images: Sequence[ImagePart]) -> list[list[int]]:
        if not images:
            return []
        processed = self._processed(images)
        return [
            self.tokenizer.encode(self.processor.replace_image_token(processed, index), add_special_tokens=False)
            for index in range(len(images))
        ]

    def pixel_inputs(self, images: Sequence[ImagePart]) -> dict[str, torch.Tensor]:
        processed = self._processed(images)
        return {"pixel_values": processed["pixel_values"], "pixel_attention_mask": processed["pixel_attention_mask"]}


_FAMILIES: dict[str, type[VisionProcessor]] = {"qwen2_vl": Qwen2VLVision, "idefics3": Idefics3Vision}


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
