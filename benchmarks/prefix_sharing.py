"""Tokens and forward+backward time of one group of rollouts with and without prefix sharing, side by side.

Run: .venv/bin/python benchmarks/prefix_sharing.py [--model tiny|PATH] [--repeats 3] [--bf16]
Two shapes: the demo's (one prompt of ~60-100 tokens, 4 samples, <= 32 new tokens) and a long system prompt (~1000
prompt tokens, 8 samples, <= 32 new tokens). Each group is one micro-batch, scored by `score_tokens` on the
right-padded full sequences (unshared) and by `score_shared_prompts` (the prompt once), then a policy-gradient
loss's backward; the two alternate and the median of ``--repeats`` timed runs after a warm-up is printed, with
the token positions each runs through the model (padding included) and the largest logprob difference between them.
Both wall and CPU seconds are printed: on a shared machine the CPU seconds of a one-thread run (the default) are the
steadier measure of the work done, and the speed-up is theirs.
``--model tiny`` (default): a random Llama of SmolLM2's vocabulary, 4 layers of hidden 256 (~17M parameters);
a PATH: a HF causal-LM folder, e.g. ~/.cache/sharpen/models/smollm2-135m-instruct.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import time
from pathlib import Path

import torch

SHAPES = {"demo": (80, 4, 32), "long system prompt": (1000, 8, 32)}  # (prompt tokens, samples, max new tokens)


def _model(name: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if name == "tiny":
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=49152,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=768,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
        model = LlamaForCausalLM(config)
    else:
        model = AutoModelForCausalLM.from_pretrained(Path(name).expanduser(), dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


def _group(num_prompt: int, num_samples: int, max_new: int, vocab: int, seed: int):
    """One prompt's rollouts packed as one micro-batch; completion lengths spread over max_new/2..max_new."""
    from sharpen.trainer.packing import pack_micro_batch
    from sharpen.types import Example, Message, Rollout

    rng = random.Random(seed)
    example = Example(task_key="bench/0", prompt=(Message(role="user", content="q"),), answer="a")
    prompt = [rng.randrange(1, vocab) for _ in range(num_prompt)]
    rollouts = []
    for index in range(num_samples):
        completion = [rng.randrange(1, vocab) for _ in range(rng.randint(max_new // 2, max_new))]
        rollouts.append(
            Rollout(
                example=example,
                prompt_ids=list(prompt),
                completion_ids=completion,
                completion_logprobs=[-5.0] * len(completion),
                versions=[0] * len(completion),
                sample_index=index,
                advantage=rng.uniform(-1, 1),
            )
        )
    micro = pack_micro_batch(rollouts, pad_token_id=0, device=torch.device("cpu"))
    return micro, [num_prompt] * num_samples


def _step(
    model, micro, prompt_lengths: list[int], *, is_shared: bool, use_bf16: bool
) -> tuple[float, float, torch.Tensor]:
    """Wall and CPU seconds of one forward+backward of a policy-gradient loss, and the logprobs it computed."""
    from sharpen.trainer.backends.single_device import score_tokens
    from sharpen.trainer.prefix import score_shared_prompts

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()
    model.zero_grad(set_to_none=True)
    start, start_cpu = time.perf_counter(), time.process_time()
    with autocast:
        args = (model, micro.input_ids, micro.attention_mask, micro.loss_mask)
        if is_shared:
            logprobs = score_shared_prompts(*args, prompt_lengths=prompt_lengths, temperature=1.0).logprobs
        else:
            logprobs = score_tokens(*args, temperature=1.0).logprobs
    loss = -(logprobs * micro.advantages).sum() / micro.num_loss_tokens
    loss.backward()
    return time.perf_counter() - start, time.process_time() - start_cpu, logprobs.detach()


def main() -> None:
    from sharpen.trainer.prefix import build_layout

    parser = argparse.ArgumentParser(description="Prefix sharing: tokens and forward+backward time of a group.")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (float32 master weights)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: this process's cores)")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    model = _model(args.model)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"model {args.model} ({num_params / 1e6:.1f}M parameters), {'bf16 autocast' if args.bf16 else 'float32'}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} after a warm-up"
    )
    columns = f"{'tokens':>15} {'wall s':>15} {'CPU s':>15} {'speed-up':>8} {'max |dlp|':>9}"
    print(f"{'shape':<20} {'rows':>4} {'prompt':>6} {columns}")
    print(f"{'':<32} {'unshared shared':>15} {'unshared shared':>15} {'unshared shared':>15}")
    for name in args.shapes:
        num_prompt, num_samples, max_new = SHAPES[name]
        micro, prompt_lengths = _group(num_prompt, num_samples, max_new, model.config.vocab_size, seed=1)
        layout = build_layout(micro.input_ids, micro.attention_mask, micro.loss_mask, prompt_lengths=prompt_lengths)
        wall: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        logprobs = {}
        for repeat in range(args.repeats + 1):
            for is_shared in (False, True) if repeat % 2 == 0 else (True, False):  # alternate who goes first
                seconds, cpu_seconds, logprobs[is_shared] = _step(
                    model, micro, prompt_lengths, is_shared=is_shared, use_bf16=args.bf16
                )
                if repeat:  # the first round is the warm-up
                    wall[is_shared].append(seconds)
                    cpu[is_shared].append(cpu_seconds)
        medians = {key: (statistics.median(wall[key]), statistics.median(cpu[key])) for key in (False, True)}
        diff = (logprobs[True] - logprobs[False]).abs().max().item()
        print(
            f"{name:<20} {num_samples:>4} {num_prompt:>6} {micro.input_ids.numel():>8} {layout.num_input_tokens:>6} "
            f"{medians[False][0]:>8.3f} {medians[True][0]:>6.3f} {medians[False][1]:>8.3f} {medians[True][1]:>6.3f} "
            f"{medians[False][1] / medians[True][1]:>7.2f}x {diff:>9.1e}"
        )


if __name__ == "__main__":
    main()
