"""Tiny random models for tests and benchmarks: a 2-layer Llama (causal LM, or a one-label reward model) and a
2-layer Mixtral (Mixture-of-Experts) with SmolLM2's tokenizer and chat template, and two tiny vision-language models
(Qwen2-VL; Idefics3, which vLLM's CPU build serves) with the same tokenizer plus their image tokens, each built in a
second from a fixed seed. The 49k
vocabulary dominates its size. torch and transformers are imported only when a model is built. And
`ByteChatTokenizer`, a chat tokenizer without a model, for tests and benchmarks of the episode path."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, ClassVar

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def save_tiny_llama(folder: Path, *, tokenizer_from: Path, reward_model: bool = False, hidden_size: int = 32) -> Path:
    """Write the model and the tokenizer files of ``tokenizer_from`` into ``folder``; returns ``folder``. Seeded
    (``torch.manual_seed(0)``), so the same call gives the same weights. ``reward_model``: a sequence classifier
    with one label instead of a causal LM."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    make_config: Any = LlamaConfig  # its stubs lack PretrainedConfig's generic keywords (num_labels)
    shape = {
        "vocab_size": 49152,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    if reward_model:
        model = LlamaForSequenceClassification(make_config(**shape, num_labels=1, pad_token_id=2))
    else:
        config = make_config(
            **shape,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        )
        model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy2(tokenizer_from / name, Path(folder) / name)
    return Path(folder)


def save_tiny_mixtral(folder: Path, *, tokenizer_from: Path, hidden_size: int = 32, num_experts: int = 4) -> Path:
    """A 2-layer random Mixtral (``num_experts`` experts, 2 per token) with the tokenizer files of
    ``tokenizer_from``, into ``folder``; returns ``folder``. Seeded, and its routers drawn wide (std 1), so that a
    token's two experts are a clear choice rather than a near tie that rounding could flip."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=49152,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=num_experts,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = MixtralForCausalLM(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the routers
                weight.normal_(0, 1.0)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy2(tokenizer_from / name, Path(folder) / name)
    return Path(folder)


def _vision_chat_template(image_text: str) -> str:
    """A ChatML template (SmolLM2's layout) that also renders OpenAI-style content parts: text as is, each image part
    as ``image_text`` holding the family's one placeholder, which `data.vision.VisionProcessor` expands per image."""
    return (
        "{%- for message in messages -%}"
        "{%- if loop.first and message['role'] != 'system' -%}"
        "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- else -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' -%}{{ '" + image_text + "' }}"
        "{%- else -%}{{ part['text'] }}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def save_tiny_qwen2_vl(folder: Path, *, tokenizer_from: Path, hidden_size: int = 64) -> Path:
    """A tiny random Qwen2-VL (2 text layers, a 1-block vision tower) with SmolLM2's tokenizer plus Qwen2-VL's vision
    tokens, a chat template that renders image parts, and a PIL image processor that keeps images small (at most
    112x112 pixels: 16 patches, 4 placeholder tokens); returns ``folder``. Seeded, like `save_tiny_llama`. The real
    architecture, so transformers' ``Qwen2VLForConditionalGeneration`` (and vLLM's) load it."""
    import torch
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    tokenizer.add_special_tokens({"additional_special_tokens": list(_VISION_TOKENS)})
    tokenizer.chat_template = _vision_chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(_VISION_TOKENS))
    head_dim = hidden_size // 4
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        # M-RoPE splits each head's rotary half into temporal, height and width sections
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope_section(head_dim)},
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": hidden_size, "num_heads": 2, "mlp_ratio": 2}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112).save_pretrained(folder)
    return Path(folder)


def _mrope_section(head_dim: int) -> list[int]:
    """Temporal, height and width shares of the ``head_dim // 2`` rotary frequencies (Qwen2-VL's 16/24/24 of 64)."""
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


_IDEFICS3_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")


def save_tiny_idefics3(folder: Path, *, tokenizer_from: Path, hidden_size: int = 128, image_size: int = 64) -> Path:
    """A tiny random Idefics3 (SmolVLM's architecture: a Llama text model, a SigLIP-style vision tower, a pixel-shuffle
    connector) with SmolLM2's tokenizer plus Idefics3's image tokens, a chat template that renders image parts, and a
    PIL image processor that resizes every image to one ``image_size`` square tile (16x16-pixel patches, shuffled by
    2: 4 ``<image>`` tokens at 64 pixels); returns ``folder``. Seeded, like `save_tiny_llama`. Its attention heads
    are 64 wide, the narrowest vLLM's CPU attention takes, so vLLM's CPU build serves it (its Qwen2-VL module needs
    torchvision)."""
    import torch
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    tokenizer.add_special_tokens({"additional_special_tokens": list(_IDEFICS3_TOKENS)})
    tokenizer.chat_template = _vision_chat_template("<image>")
    patch_size, scale_factor = 16, 2
    text = {
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": hidden_size // 64,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": patch_size,
    }
    config = Idefics3Config(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=scale_factor,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(folder)
    square = {"longest_edge": image_size}
    image_processor = Idefics3ImageProcessorPil(do_image_splitting=False, size=square, max_image_size=square)
    image_seq_len = (image_size // patch_size) ** 2 // scale_factor**2
    Idefics3Processor(image_processor, tokenizer, image_seq_len=image_seq_len).save_pretrained(folder)
    return Path(folder)


class ByteChatTokenizer:
    """A ChatML tokenizer over bytes, for tests and benchmarks of everything but the model: each message is
    ``<|im_start|> role content <|im_end|> "\\n"``, each byte of text one token (its value + 16), below those the
    special tokens. It renders a chat in microseconds where a Jinja chat template takes hundreds, so benchmarks of
    millions of episodes measure the episode path, not the template."""

    pad_token_id, im_start_id, eos_token_id = 0, 1, 2
    role_ids: ClassVar[dict[str, int]] = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
    chat_template = None  # it renders no tool calls: the agent endpoint reads Hermes blocks
    # its special ids are not added tokens, and `decode` drops them whatever it is asked
    added_tokens_decoder: ClassVar[dict[int, Any]] = {}
    all_special_ids: ClassVar[list[int]] = []
    all_special_tokens: ClassVar[list[str]] = []
    newline_id = 16 + ord("\n")

    def __len__(self) -> int:  # the vocabulary: 16 special ids, then the 256 bytes
        return 16 + 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [16 + byte for byte in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 16 for i in ids if i >= 16).decode(errors="replace")

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool, tokenize: bool, **_: Any
    ) -> list[int]:
        assert tokenize, "ByteChatTokenizer renders token ids only"
        ids: list[int] = []
        for message in conversation:
            ids += [self.im_start_id, self.role_ids[message["role"]], *self.encode(message["content"] or "")]
            ids += [self.eos_token_id, self.newline_id]
        return [*ids, self.im_start_id, self.role_ids["assistant"]] if add_generation_prompt else ids
