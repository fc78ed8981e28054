"""Image-prompt generation against text-prompt generation on the hf engine, side by side in one run: the same model
(the tiny random Qwen2-VL of `sharpen.testing.save_tiny_qwen2_vl`, or ``--model``), the same batch of colour-task
prompts (`sharpen.data.visual_tasks`: one image, then the question), and as their text twins the same token ids with
each image's vision block (start, placeholders, end) replaced by as many ordinary text tokens: prompts of exactly the
same length, the same sampling settings and per-request seeds. What the image prompts add is the image processor
(PIL resizing and patching on every call), the vision tower's forward and the 3-D (M-RoPE) positions.

Prints the median generated tokens/s of each and their ratio (image / text).

    .venv/bin/python benchmarks/vision.py [--batch 16] [--max-new-tokens 64] [--repeats 5] [--model FOLDER]
        [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from sharpen.config.models import resolve_model_path
from sharpen.data.visual_tasks import make_colour_tasks
from sharpen.rollout.engines.hf import HfEngine
from sharpen.testing import save_tiny_qwen2_vl
from sharpen.types import ImagePart, SamplingParams, prompt_images


def text_twin(ids: list[int], vision_ids: set[int], filler_id: int) -> list[int]:
    """``ids`` with every vision token (an image's start, placeholders and end) replaced by ``filler_id``."""
    return [filler_id if token in vision_ids else token for token in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", help="a Qwen2-VL folder (default: the tiny random one, built in a temp folder)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        if args.model is None:
            folder = save_tiny_qwen2_vl(Path(scratch), tokenizer_from=resolve_model_path("smollm2-135m-instruct"))
        else:
            folder = Path(args.model)
        engine = HfEngine(folder, device=args.device, batch_size=args.batch)
        assert engine.vision is not None, f"{folder} is not a vision-language model"
        tokenizer = engine.vision.tokenizer
        vision_ids = set(tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]))
        filler_id = tokenizer.encode(" colour", add_special_tokens=False)[0]
        examples = make_colour_tasks(args.batch, seed=0)
        image_prompts = [engine.vision.render_prompt(e.prompt) for e in examples]
        images = [prompt_images(e.prompt) for e in examples]
        text_prompts = [text_twin(ids, vision_ids, filler_id) for ids in image_prompts]
        assert [len(p) for p in text_prompts] == [len(p) for p in image_prompts]
        no_images: list[tuple[ImagePart, ...]] = [()] * args.batch
        calls = {"image": (image_prompts, images), "text": (text_prompts, no_images)}

        def generate(name: str, repeat: int) -> int:
            prompts, prompt_images_ = calls[name]
            params = [
                SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1000 * repeat + i)
                for i in range(args.batch)
            ]
            return sum(len(c.token_ids) for c in engine.generate_with_images(prompts, prompt_images_, params))

        for name in calls:
            generate(name, -1)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in calls}
        for repeat in range(args.repeats):  # interleaved, so a busy machine slows both alike
            for name in calls:
                started = time.perf_counter()
                num_tokens = generate(name, repeat)
                seconds = time.perf_counter() - started
                rates[name].append(num_tokens / seconds)
                print(f"repeat {repeat} {name:5s} {seconds:.3f} s  {num_tokens} tokens  {rates[name][-1]:.0f} tokens/s")
        engine.close()

    num_image_tokens = sum(token in vision_ids for token in image_prompts[0])
    image_rate, text_rate = statistics.median(rates["image"]), statistics.median(rates["text"])
    print(
        f"{folder.name if args.model else 'tiny random Qwen2-VL'} on {args.device}: batch {args.batch} x "
        f"<= {args.max_new_tokens} new tokens, prompts of {len(image_prompts[0])} tokens "
        f"({num_image_tokens} of them the image's), median of {args.repeats}"
    )
    print(f"image prompts: {image_rate:8.0f} tokens/s")
    print(f"text prompts:  {text_rate:8.0f} tokens/s")
    print(f"image / text:  {image_rate / text_rate:8.2f}")


if __name__ == "__main__":
    main()
