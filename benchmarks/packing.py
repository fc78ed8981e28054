"""Padded against packed micro-batches: tokens computed and seconds per train step on a long-tailed length mix.

Run: .venv/bin/python benchmarks/packing.py [--steps 3] [--num-rollouts 32] [--micro-batch-size 8]
     [--micro-batch-tokens 512]
A random Llama of 4 layers (hidden 256, vocab 8192; the decoder, not the LM head, is what padding costs: the head
runs on the completion tokens only either way) trains on one fixed batch: prompts of 32-96 tokens, completions of
mostly 8-48 tokens with one in eight of 200-400 (a long tail, as when a few samples ramble). The same `Trainer`
steps with ``packing = false`` (micro-batches of ``--micro-batch-size`` rollouts, sorted by length, right-padded)
and ``packing = true`` (first-fit into ``--micro-batch-tokens``), alternating, from the same weights. Prints the
tokens each layout runs through the model (real ones and padding) and the median seconds per step, with ratios,
all measured in this run (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path


def _rollouts(num: int, vocab: int) -> list:
    from sharpen.types import Example, Message, Rollout

    rng = random.Random(0)
    example = Example(task_key="bench/0", prompt=(Message(role="user", content="q"),), answer="a")
    out = []
    for index in range(num):
        num_completion = rng.randint(200, 400) if index % 8 == 7 else rng.randint(8, 48)
        out.append(
            Rollout(
                example=example,
                prompt_ids=[rng.randrange(1, vocab) for _ in range(rng.randint(32, 96))],
                completion_ids=[rng.randrange(1, vocab) for _ in range(num_completion)],
                completion_logprobs=[-9.0] * num_completion,
                versions=[0] * num_completion,
                sample_index=index,
                advantage=rng.uniform(-1.0, 1.0),
            )
        )
    return out


def _model(folder: Path, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=768,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--num-rollouts", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-tokens", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()

    from sharpen.config.schema import TrainerConfig
    from sharpen.trainer import SingleDeviceBackend, Trainer
    from sharpen.trainer.packing import split_micro_batches, split_micro_batches_by_tokens
    from sharpen.types import TrainBatch

    rollouts = _rollouts(args.num_rollouts, args.vocab)
    real = sum(r.num_tokens for r in rollouts)
    padded_chunks = split_micro_batches(rollouts, args.micro_batch_size)
    padded = sum(len(chunk) * max(r.num_tokens for r in chunk) for chunk in padded_chunks)
    packed_chunks = split_micro_batches_by_tokens(rollouts, args.micro_batch_tokens)
    packed = sum(r.num_tokens for chunk in packed_chunks for r in chunk)
    lengths = sorted(r.num_tokens for r in rollouts)
    print(
        f"{len(rollouts)} rollouts, tokens each: min {lengths[0]}, median {lengths[len(lengths) // 2]}, "
        f"max {lengths[-1]}"
    )
    print(f"real tokens: {real}")
    print(
        f"padded: {padded} tokens in {len(padded_chunks)} micro-batches of {args.micro_batch_size} "
        f"({padded / real:.2f}x real)"
    )
    print(
        f"packed: {packed} tokens in {len(packed_chunks)} micro-batches of <= {args.micro_batch_tokens} tokens "
        f"({packed / real:.2f}x real); packed / padded tokens {packed / padded:.2f}"
    )

    with tempfile.TemporaryDirectory() as folder:
        _model(Path(folder), args.vocab)
        trainers = {}
        for name, is_packed in (("padded", False), ("packed", True)):
            config = TrainerConfig(
                device="cpu",
                learning_rate=1e-6,
                micro_batch_size=args.micro_batch_size,
                packing=is_packed,
                micro_batch_tokens=args.micro_batch_tokens,
            )
            backend = SingleDeviceBackend(config, model_path=Path(folder), dtype="float32")
            trainers[name] = Trainer(config, backend=backend, pad_token_id=0)
        times: dict[str, list[float]] = {name: [] for name in trainers}
        losses: dict[str, list[float]] = {name: [] for name in trainers}
        for step in range(args.steps + 1):  # the first round warms up and is not timed
            for name, trainer in trainers.items():
                start = time.perf_counter()
                metrics = trainer.step(TrainBatch(rollouts=rollouts, step=step))
                if step:
                    times[name].append(time.perf_counter() - start)
                losses[name].append(metrics["train/loss"])
        median = {name: statistics.median(values) for name, values in times.items()}
    for name in trainers:
        print(f"{name}: median {median[name]:.2f} s/step over {args.steps} steps; losses {losses[name]}")
    print(f"packed / padded time per step: {median['packed'] / median['padded']:.2f}")


if __name__ == "__main__":
    main()
