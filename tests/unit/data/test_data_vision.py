"""Messages with images: the tiny Qwen2-VL's folder loads with the PIL image processor, an image prompt renders with
one placeholder per image token the model embeds, the images reach the model (another image, other logits), and a
text-only tokenizer or model given an image, or an unreadable image, is one clear error. Text messages render exactly
as before."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch

from sharpen.data import render_prompt
from sharpen.data.chat import ImageInputError
from sharpen.data.vision import Idefics3Vision, VisionProcessor, is_vision_model, model_class
from sharpen.types import Example, ImagePart, Message, TextPart
from support.images import image_prompt, png_image


@pytest.fixture(scope="module")
def vision(tiny_vlm_path: Path) -> VisionProcessor:
    return VisionProcessor.from_pretrained(tiny_vlm_path)


def test_the_tiny_vlm_loads_with_the_pil_image_processor_and_runs_a_fast_forward(tiny_vlm_path, vision):
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    assert isinstance(vision.image_processor, Qwen2VLImageProcessorPil)
    assert is_vision_model(tiny_vlm_path)
    model = model_class(tiny_vlm_path).from_pretrained(tiny_vlm_path).eval()
    assert isinstance(model, Qwen2VLForConditionalGeneration)
    messages = image_prompt(png_image((200, 30, 30)))
    ids = torch.tensor([vision.render_prompt(messages)])
    inputs = vision.model_inputs(ids, messages[0].images)
    with torch.no_grad():
        model(input_ids=ids, **inputs)  # the first pass warms up
        started = time.perf_counter()
        logits = model(input_ids=ids, **inputs).logits
    assert logits.shape == (1, ids.shape[1], len(vision.tokenizer))
    assert time.perf_counter() - started < 1.0


def test_each_image_expands_to_the_tokens_its_patches_merge_into(vision):
    small, wide = png_image((10, 200, 10), size=(28, 28)), png_image((10, 10, 200), size=(112, 56))
    messages = (
        Message(role="system", content="Look closely."),
        Message(role="user", content=(TextPart(text="First "), small, TextPart(text=" then "), wide)),
    )
    ids = vision.render_prompt(messages)
    grid = vision.pixel_inputs([small, wide])["image_grid_thw"]  # [2, 3]: (t, h, w) in patches
    per_image = [int(g.prod()) // vision.merge_size**2 for g in grid]
    assert per_image == [1, 8]  # 28x28: 2x2 patches -> 1 token; 112x56: 4x8 patches -> 8 tokens
    tokenizer = vision.tokenizer
    start, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    runs = []  # the placeholders between each vision start and end
    for index, token in enumerate(ids):
        if token == start:
            runs.append(ids[index + 1 : ids.index(end, index)])
    assert [len(run) for run in runs] == per_image
    assert all(set(run) == {vision.image_token_id} for run in runs)
    text = tokenizer.decode([t for t in ids if t != vision.image_token_id])
    assert "Look closely." in text and "First <|vision_start|><|vision_end|> then <|vision_start|>" in text


def test_the_model_sees_the_images(tiny_vlm_path, vision):
    model = model_class(tiny_vlm_path).from_pretrained(tiny_vlm_path).eval()
    logits = []
    for image in (png_image((200, 30, 30)), png_image((30, 30, 200), stripe=True)):
        messages = image_prompt(image)
        ids = torch.tensor([vision.render_prompt(messages)])
        with torch.no_grad():
            logits.append(model(input_ids=ids, **vision.model_inputs(ids, messages[0].images)).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 1e-4


def test_text_messages_render_as_before(tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    expected = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    plain = [Message(role="system", content="Be brief."), Message(role="user", content="2 + 2?")]
    parts = [plain[0], Message(role="user", content=(TextPart(text="2 + "), TextPart(text="2?")))]
    assert render_prompt(tokenizer, plain) == render_prompt(tokenizer, parts) == list(expected)


def test_a_text_only_tokenizer_or_model_given_an_image_is_one_clear_error(tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    with pytest.raises(ImageInputError, match="1 image\\(s\\), which a text-only tokenizer cannot render"):
        render_prompt(tokenizer, image_prompt(png_image((1, 2, 3))))
    with pytest.raises(ImageInputError, match="is a text-only model"):
        VisionProcessor.from_pretrained(tiny_model_path)


def test_an_unreadable_image_is_a_clear_error(vision, tmp_path):
    with pytest.raises(ImageInputError, match="image 0 of the prompt \\(9 bytes\\) cannot be read"):
        vision.render_prompt(image_prompt(ImagePart(data=b"not a png")))
    with pytest.raises(ImageInputError, match=r"missing\.png"):
        vision.render_prompt(image_prompt(ImagePart(path=str(tmp_path / "missing.png"))))
    with pytest.raises(ValueError, match="exactly one of data"):
        ImagePart()


def test_image_messages_are_hashable_and_serialise_a_digest_not_the_bytes():
    image = png_image((5, 6, 7))
    message = image_prompt(image)[0]
    assert hash(message) == hash(image_prompt(png_image((5, 6, 7)))[0])
    assert message.to_json() == [
        {"type": "image", "sha256": hashlib.sha256(image.data).hexdigest(), "num_bytes": len(image.data)},
        {"type": "text", "text": "What colour is this?"},
    ]
    assert message.text == "What colour is this?" and message.images == (image,)
    other = Example(task_key="t", prompt=image_prompt(png_image((5, 6, 8))))
    assert Example(task_key="t", prompt=(message,)).task_hash != other.task_hash


def test_a_text_prompts_task_hash_is_unchanged():
    example = Example(task_key="t", prompt=(Message(role="user", content="hi"),), answer="a")
    payload = json.dumps({"prompt": [["user", "hi"]], "answer": "a"}, sort_keys=True)
    assert example.task_hash == hashlib.sha256(payload.encode()).hexdigest()[:16]


def test_idefics3_images_expand_to_their_blocks_and_compact_back(tiny_idefics3_path):
    idefics3 = VisionProcessor.from_pretrained(tiny_idefics3_path)
    assert isinstance(idefics3, Idefics3Vision)
    red, blue = png_image((200, 30, 30)), png_image((30, 30, 200), size=(112, 84))
    messages = (Message(role="user", content=(TextPart(text="First "), red, TextPart(text=" then "), blue)),)
    ids = idefics3.render_prompt(messages)
    tokenizer = idefics3.tokenizer
    fake, global_image = tokenizer.convert_tokens_to_ids(["<fake_token_around_image>", "<global-img>"])
    block = [fake, global_image, *[idefics3.image_token_id] * 4, fake]  # 64x64 tile: 4x4 patches, shuffled by 2
    assert idefics3.image_blocks([red, blue]) == [block, block]
    assert idefics3.num_image_tokens([red, blue]) == [4, 4]
    compact = idefics3.compact(ids, [red, blue])
    assert compact.count(idefics3.image_token_id) == 2 and fake not in compact
    assert len(compact) == len(ids) - 2 * (len(block) - 1)
    # the compacted prompt is what the chat template wrote before expansion
    assert tokenizer.decode(compact, skip_special_tokens=False).count("<image>") == 2
    inputs = idefics3.model_inputs(torch.tensor([ids]), [red, blue])
    assert inputs["pixel_values"].shape == (1, 2, 3, 64, 64)
    assert inputs["pixel_attention_mask"].shape == (1, 2, 64, 64)
    with pytest.raises(ValueError, match="image 1's placeholder block is not in the token ids"):
        idefics3.compact(ids[: ids.index(fake, ids.index(idefics3.image_token_id) + 4) + 3], [red, blue])


def test_idefics3_image_splitting_blocks_hold_a_block_per_tile(tiny_idefics3_path):
    """With splitting on, a large image is tiles plus the global view; the block text is transformers' own and
    `compact` still folds it to one placeholder."""
    import copy

    idefics3 = VisionProcessor.from_pretrained(tiny_idefics3_path)
    splitting = copy.copy(idefics3)
    splitting.image_processor = copy.copy(idefics3.image_processor)
    splitting.image_processor.do_image_splitting = True
    splitting.image_processor.size = {"longest_edge": 128}
    wide = png_image((30, 30, 200), size=(128, 64))
    [block] = splitting.image_blocks([wide])
    assert block.count(splitting.image_token_id) == 3 * 4  # two 64x64 tiles and the global view, 4 tokens each
    ids = splitting.render_prompt(image_prompt(wide))
    assert splitting.compact(ids, [wide]) == idefics3.compact(idefics3.render_prompt(image_prompt(wide)), [wide])
    assert splitting.pixel_inputs([wide])["pixel_values"].shape[1] == 3


def test_a_vision_family_sharpen_does_not_render_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}, "image_token_id": 5}))
    with pytest.raises(
        ImageInputError, match=r"is a llava vision-language model; sharpen renders .*idefics3, qwen2_vl"
    ):
        VisionProcessor.from_pretrained(tmp_path)
