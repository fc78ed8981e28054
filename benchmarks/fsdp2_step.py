"""FSDP2 optimizer-step time on 1 and 2 CPU ranks (gloo), beside the single-device backend on the same batch.

Run: .venv/bin/python benchmarks/fsdp2_step.py [--steps 5] [--vocab 49152] [--num-rollouts 8]
A tiny random Llama (2 layers, hidden 32; the vocabulary sets most of the cost, 49152 like SmolLM2's) and a fixed
batch of rollouts; one step is forward/backward of a policy-gradient loss over this rank's share of the batch
(split by `split_rollouts_by_tokens`, micro-batches of 2, zero-weighted filler passes to keep ranks in step), then
`clip_and_step`. Prints the median seconds per step and the ratios, measured in the same run (the machine is
shared and noisy). Every rank and the single-device baseline use one torch thread, so 2 ranks use 2 cores; the
single-device run on 2 threads is printed too.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

MICRO_BATCH_SIZE = 2


def _rollouts(num: int, vocab: int) -> list:
    from sharpen.types import Example, Message, Rollout

    rng = random.Random(0)
    example = Example(task_key="bench/0", prompt=(Message(role="user", content="q"),), answer="a")
    out = []
    for _ in range(num):
        num_prompt, num_completion = rng.randint(32, 96), rng.randint(16, 128)
        out.append(
            Rollout(
                example=example,
                prompt_ids=[rng.randrange(1, vocab) for _ in range(num_prompt)],
                completion_ids=[rng.randrange(1, vocab) for _ in range(num_completion)],
                completion_logprobs=[-5.0] * num_completion,
                versions=[0] * num_completion,
                advantage=rng.uniform(-1, 1),
            )
        )
    return out


def _time_steps(
    backend, rollouts: list, *, rank: int, num_ranks: int, num_steps: int, on_gradients=None
) -> list[float]:
    """Seconds of each of ``num_steps`` steps after one warm-up step; ``on_gradients(backend)`` runs once the step's
    gradients are accumulated, before `clip_and_step` (inside the timed span)."""
    from sharpen.trainer.backends.base import ScoreInputs
    from sharpen.trainer.packing import pack_micro_batch, split_micro_batches
    from sharpen.trainer.sharding import split_rollouts_by_tokens

    normalizer = float(sum(r.num_loss_tokens for r in rollouts))
    chunks = split_micro_batches(split_rollouts_by_tokens(rollouts, num_ranks)[rank], MICRO_BATCH_SIZE)
    num_passes = backend.all_reduce_max(len(chunks)) if num_ranks > 1 else len(chunks)
    micros = [
        pack_micro_batch(rollouts[:1] if index >= len(chunks) else chunks[index], pad_token_id=0, device=backend.device)
        for index in range(num_passes)
    ]
    inputs = [
        ScoreInputs(input_ids=m.input_ids, attention_mask=m.attention_mask, target_mask=m.loss_mask) for m in micros
    ]

    def loss(index: int, scores) -> torch.Tensor:
        value = -(scores.logprobs * micros[index].advantages).sum() / normalizer
        return value * 0.0 if index >= len(chunks) else value  # a filler pass keeps the ranks in step

    seconds = []
    for _ in range(num_steps + 1):
        if num_ranks > 1:
            torch.distributed.barrier()
        started = time.perf_counter()
        backend.train_micro_batches(inputs, loss, temperature=1.0)
        if on_gradients is not None:
            on_gradients(backend)
        backend.clip_and_step()
        seconds.append(time.perf_counter() - started)
    return seconds[1:]


def _rank(rank: int, num_ranks: int, port: int, model_dir: Path, args: argparse.Namespace, queue) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(num_ranks)})
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from sharpen.config.schema import TrainerConfig
    from sharpen.trainer.backends.fsdp2 import FSDP2Backend
    from sharpen.trainer.backends.mesh import init_distributed

    init_distributed("gloo")
    backend = FSDP2Backend(TrainerConfig(device="cpu"), model_path=model_dir, dtype="float32")
    seconds = _time_steps(
        backend, _rollouts(args.num_rollouts, args.vocab), rank=rank, num_ranks=num_ranks, num_steps=args.steps
    )
    if rank == 0:
        queue.put(seconds)
    torch.distributed.destroy_process_group()


def _fsdp2_seconds(num_ranks: int, model_dir: Path, args: argparse.Namespace) -> float:
    # forked, not spawned: the ranks inherit the imported torch and transformers (tens of seconds a process here)
    context = mp.get_context("fork")
    queue = context.SimpleQueue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(
        _rank, args=(num_ranks, port, model_dir, args, queue), nprocs=num_ranks, join=True, start_method="fork"
    )
    return statistics.median(queue.get())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--num-rollouts", type=int, default=8)
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    from sharpen.config.schema import TrainerConfig
    from sharpen.trainer import SingleDeviceBackend

    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder)
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        )
        LlamaForCausalLM(config).save_pretrained(model_dir)
        rollouts = _rollouts(args.num_rollouts, args.vocab)
        single = {}
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            backend = SingleDeviceBackend(TrainerConfig(device="cpu"), model_path=model_dir, dtype="float32")
            seconds = _time_steps(backend, rollouts, rank=0, num_ranks=1, num_steps=args.steps)
            single[num_threads] = statistics.median(seconds)
        torch.set_num_threads(1)
        fsdp2 = {num_ranks: _fsdp2_seconds(num_ranks, model_dir, args) for num_ranks in (1, 2)}
    num_tokens = sum(r.num_tokens for r in rollouts)
    print(f"batch                          {len(rollouts)} rollouts, {num_tokens} tokens, vocab {args.vocab}")
    print(f"single device, 1 thread        {single[1]:.3f} s/step")
    print(f"single device, 2 threads       {single[2]:.3f} s/step")
    print(f"FSDP2, 1 rank                  {fsdp2[1]:.3f} s/step  ({fsdp2[1] / single[1]:.2f}x single, 1 thread)")
    print(f"FSDP2, 2 ranks                 {fsdp2[2]:.3f} s/step  ({fsdp2[2] / single[1]:.2f}x single, 1 thread)")
    print(f"speed-up 2 ranks over 1 rank   {fsdp2[1] / fsdp2[2]:.2f}x")


if __name__ == "__main__":
    main()
