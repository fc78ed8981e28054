"""Image-prompt generation against text-prompt generation, side by side in one run, on the hf engine (the tiny random
Qwen2-VL of `sharpen.testing.save_tiny_qwen2_vl`, and the tiny random Idefics3 of `save_tiny_idefics3`) and on the
vllm engine (the same Idefics3: SmolVLM's architecture, the vision-language model vLLM's CPU build serves). Every
setup gets the same batch of colour-task prompts (`sharpen.data.visual_tasks`: one image, then the question), and as
their text twins the same token ids with each image's vision tokens (Qwen2-VL: start, placeholders, end; Idefics3:
the ``<fake_token_around_image>``, ``<global-img>`` and ``<image>`` tokens of its block) replaced by as many ordinary
text tokens: prompts of exactly the same length, the same sampling settings and per-request seeds. What the image
prompts add is the image processor (PIL resizing and patching on every call), the vision tower's forward and, for
Qwen2-VL, the 3-D (M-RoPE) positions; on vLLM the multimodal request (sharpen sends each image with one placeholder,
vLLM processes the image and expands the placeholder back into the block, which sharpen checks).

Prints the median generated tokens/s of each, their ratio (image / text) per setup, and vLLM's over hf's on the
same Idefics3.

    .venv/bin/python benchmarks/vision.py [--batch 16] [--max-new-tokens 64] [--repeats 5]
        [--setups hf-qwen2-vl,hf-idefics3,vllm-idefics3] [--qwen2-vl FOLDER] [--idefics3 FOLDER] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sharpen.config.engines import VllmEngineConfig
from sharpen.config.models import resolve_model_path
from sharpen.data.vision import VisionProcessor
from sharpen.data.visual_tasks import make_colour_tasks
from sharpen.rollout.engines.hf import HfEngine
from sharpen.testing import save_tiny_idefics3, save_tiny_qwen2_vl
from sharpen.types import Example, ImagePart, SamplingParams, prompt_images

BUILDERS = {"qwen2-vl": save_tiny_qwen2_vl, "idefics3": save_tiny_idefics3}
VISION_TOKENS = {
    "qwen2-vl": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "idefics3": ("<fake_token_around_image>", "<global-img>", "<image>"),
}
"""The tokens of each family's image block, which a text twin replaces."""
SETUPS = ("hf-qwen2-vl", "hf-idefics3", "vllm-idefics3")


def text_twin(ids: list[int], vision_ids: set[int], filler_id: int) -> list[int]:
    """``ids`` with every vision token (an image's start, placeholders and end) replaced by ``filler_id``."""
    return [filler_id if token in vision_ids else token for token in ids]


@dataclass(kw_only=True, slots=True)
class Setup:
    """One engine on one model: its engine, its image prompts and their text twins, and a line describing them."""

    name: str
    engine: Any
    calls: dict[str, tuple[list[list[int]], list[tuple[ImagePart, ...]]]]
    """``"image"`` and ``"text"``: the prompts and each prompt's images."""
    description: str


def prepare_setup(name: str, folder: Path, examples: list[Example], args: argparse.Namespace) -> Setup:
    """The engine of ``name`` (``engine-family``) on ``folder``, with the prompts of ``examples`` rendered by the
    model's processor and their text twins."""
    engine_type, family = name.split("-", 1)
    vision = VisionProcessor.from_pretrained(folder)
    vision_ids = set(vision.tokenizer.convert_tokens_to_ids(list(VISION_TOKENS[family])))
    filler_id = vision.tokenizer.encode(" colour", add_special_tokens=False)[0]
    image_prompts = [vision.render_prompt(e.prompt) for e in examples]
    text_prompts = [text_twin(ids, vision_ids, filler_id) for ids in image_prompts]
    assert [len(p) for p in text_prompts] == [len(p) for p in image_prompts]
    if engine_type == "hf":
        engine = HfEngine(folder, device=args.device, batch_size=args.batch)
    else:
        from sharpen.rollout.engines.vllm import VllmEngine

        config = VllmEngineConfig(max_model_len=len(image_prompts[0]) + args.max_new_tokens)
        engine = VllmEngine(config, model_path=folder, dtype="float32", seed=0)
    num_vision = sum(token in vision_ids for token in image_prompts[0])
    return Setup(
        name=name,
        engine=engine,
        calls={
            "image": (image_prompts, [prompt_images(e.prompt) for e in examples]),
            "text": (text_prompts, [()] * len(examples)),
        },
        description=f"prompts of {len(image_prompts[0])} tokens ({num_vision} of them the image's)",
    )


def measure(setups: list[Setup], args: argparse.Namespace) -> dict[str, list[float]]:
    """Generated tokens/s of every setup's image and text prompts (keys ``"<setup> image"``, ``"<setup> text"``),
    ``args.repeats`` times each after a warm-up, interleaved so that a busy machine slows every setup alike."""

    def generate(setup: Setup, kind: str, repeat: int) -> int:
        prompts, images = setup.calls[kind]
        params = [
            SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1000 * repeat + i)
            for i in range(len(prompts))
        ]
        return sum(len(c.token_ids) for c in setup.engine.generate_with_images(prompts, images, params))

    for setup in setups:
        for kind in setup.calls:
            generate(setup, kind, -1)  # warm-up
    rates: dict[str, list[float]] = {f"{setup.name} {kind}": [] for setup in setups for kind in setup.calls}
    for repeat in range(args.repeats):
        for setup in setups:
            for kind in setup.calls:
                started = time.perf_counter()
                num_tokens = generate(setup, kind, repeat)
                seconds = time.perf_counter() - started
                name = f"{setup.name} {kind}"
                rates[name].append(num_tokens / seconds)
                print(
                    f"repeat {repeat} {name:19s} {seconds:.3f} s  {num_tokens} tokens  {rates[name][-1]:.0f} tokens/s"
                )
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--qwen2-vl", help="a Qwen2-VL folder (default: the tiny random one, built in a temp folder)")
    parser.add_argument("--idefics3", help="an Idefics3 folder (default: the tiny random one, built in a temp folder)")
    parser.add_argument("--device", default="cpu", help="the hf engine's device (vLLM runs on its build's)")
    args = parser.parse_args()
    names = args.setups.split(",")
    if unknown := set(names) - set(SETUPS):
        parser.error(f"unknown setups {sorted(unknown)}; known: {', '.join(SETUPS)}")
    examples = make_colour_tasks(args.batch, seed=0)
    given = {"qwen2-vl": args.qwen2_vl, "idefics3": args.idefics3}
    with tempfile.TemporaryDirectory() as scratch:
        folders: dict[str, Path] = {}
        for family in sorted({name.split("-", 1)[1] for name in names}):
            if given[family] is None:
                tokenizer_from = resolve_model_path("smollm2-135m-instruct")
                folders[family] = BUILDERS[family](Path(scratch) / family, tokenizer_from=tokenizer_from)
            else:
                folders[family] = Path(given[family])
        setups = [prepare_setup(name, folders[name.split("-", 1)[1]], examples, args) for name in names]
        rates = measure(setups, args)
        for setup in setups:
            setup.engine.close()

    median = {name: statistics.median(values) for name, values in rates.items()}
    models = ", ".join(f"{family} {given[family] or 'tiny random'}" for family in folders)
    print(f"{models}; batch {args.batch} x <= {args.max_new_tokens} new tokens, median of {args.repeats}")
    for setup in setups:
        image, text = median[f"{setup.name} image"], median[f"{setup.name} text"]
        print(f"{setup.name} ({setup.description}):")
        print(f"  image prompts: {image:8.0f} tokens/s")
        print(f"  text prompts:  {text:8.0f} tokens/s")
        print(f"  image / text:  {image / text:8.2f}")
    if {"hf-idefics3", "vllm-idefics3"} <= set(names):
        for kind in ("image", "text"):
            ratio = median[f"vllm-idefics3 {kind}"] / median[f"hf-idefics3 {kind}"]
            print(f"vllm / hf on Idefics3, {kind} prompts: {ratio:8.2f}")


if __name__ == "__main__":
    main()
