"""The Mixture-of-Experts trainer side by side in one run: expert parallelism (ep 1 against ep 2 on 2 gloo ranks) and
the cost of routing replay (none, R2, R3 on one process).

Run: .venv/bin/python benchmarks/moe.py [--steps 3]

The model is a random Mixtral (4 layers, hidden 256, 8 experts of intermediate 512, 2 a token, 8 heads, 4 key/value
heads, vocabulary 8192), float32, one torch thread a process. The batch is 8 rollouts of 48-224 tokens. A step is
`Trainer.step` (GRPO's loss, 2 mini-batches, so an old-policy pass runs), timed after one warm-up step; the median
is printed.

Part 1, expert parallelism: 2 ranks, FSDP2 over both (dp_shard 2); ep 1 keeps every expert on both ranks (FSDP2
shards them like any weight), ep 2 puts 4 experts on each rank and sends tokens to them by all-to-all. Printed: the
step time, rank 0's peak resident memory (``ru_maxrss``; the forked ranks share the parent's pages until they write
them) and rank 0's local bytes of the experts' parameters. With one data shard a rank, FSDP2 at ep 1 and ep 2 both
hold 1 / 2 of the experts; ep's saving is the all-gather of the experts FSDP2 no longer does, which its all-to-all
of tokens replaces. On 2 CPU cores the two ranks share the machine: the times measure the overhead, not a speed-up.

Part 2, routing replay: one process; the rollouts carry random engine routes (R3's input). ``none`` still measures
the engine's routes (two forwards of one micro-batch without gradient); ``r2`` captures the old-policy pass's routes
and replays them; ``r3`` replays the engine's.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

VOCAB, EXPERTS, TOP_K, LAYERS = 8192, 8, 2, 4


def _save_model(folder: Path) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=512,
    )
    MixtralForCausalLM(config).save_pretrained(folder)
    return folder


def _rollouts(with_routes: bool) -> list:
    from sharpen.expert_routes import UNROUTED, expert_routes
    from sharpen.types import Example, Message, Rollout

    rng = random.Random(0)
    example = Example(task_key="bench/0", prompt=(Message(role="user", content="q"),), answer="a")
    out = []
    for index in range(8):
        num_prompt, num_completion = rng.randint(32, 96), rng.randint(16, 128)
        routes = None
        if with_routes:
            generator = torch.Generator().manual_seed(index)
            tokens = num_prompt + num_completion
            indices = torch.rand(tokens, LAYERS, EXPERTS, generator=generator).topk(TOP_K, dim=-1).indices
            indices[-1] = UNROUTED
            routes = expert_routes(indices, num_experts=EXPERTS)
        out.append(
            Rollout(
                example=example,
                prompt_ids=[rng.randrange(1, VOCAB) for _ in range(num_prompt)],
                completion_ids=[rng.randrange(1, VOCAB) for _ in range(num_completion)],
                completion_logprobs=[-5.0] * num_completion,
                versions=[0] * num_completion,
                advantage=rng.uniform(-1, 1),
                routes=routes,
            )
        )
    return out


def _config(replay: str):
    from sharpen.config.schema import TrainerConfig

    return TrainerConfig.model_validate(
        {
            "device": "cpu",
            "precision": "float32",
            "num_threads": 1,
            "micro_batch_size": 4,
            "algorithm": {"num_mini_batches": 2},
            "moe": {"routing_replay": replay},
        }
    )


def _median_step(trainer, rollouts: list, steps: int) -> float:
    from sharpen.types import TrainBatch

    seconds = []
    for step in range(steps + 1):
        start = time.perf_counter()
        trainer.step(TrainBatch(rollouts=rollouts, step=step))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def _ep_rank(rank: int, num_ranks: int, port: int, model: Path, ep: int, steps: int, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from sharpen.trainer import Trainer
    from sharpen.trainer.backends.fsdp2 import FSDP2Backend
    from sharpen.trainer.backends.mesh import init_distributed
    from sharpen.trainer.layout import ParallelLayout

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(num_ranks), "MASTER_ADDR": "127.0.0.1"})
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    init_distributed("gloo")
    config = _config("none")
    backend = FSDP2Backend(config, model_path=model, dtype="float32", layout=ParallelLayout(dp_shard=2, ep=ep))
    trainer = Trainer(config, backend=backend, pad_token_id=0)
    seconds = _median_step(trainer, _rollouts(with_routes=False), steps)
    expert_bytes = sum(  # by name: FSDP2 renames the classes it wraps
        (p.to_local() if isinstance(p, DTensor) else p).numel() * 4
        for name, p in backend.model.named_parameters()
        if ".mlp.experts." in name
    )
    if rank == 0:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        out.write_text(f"{seconds} {peak} {expert_bytes}")
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = _save_model(Path(folder) / "model")
        total_experts = EXPERTS * LAYERS * 3 * 256 * 512 * 4
        print(f"Part 1: expert parallelism, 2 ranks, dp_shard 2 (experts: {total_experts / 2**20:.1f} MiB in all)")
        print(f"{'layout':<22}{'s/step':>9}{'peak GiB':>10}{'rank 0 expert MiB':>19}")
        for ep in (1, 2):
            out = Path(folder) / f"ep{ep}.txt"
            mp.start_processes(
                _ep_rank, args=(2, _free_port(), model, ep, args.steps, out), nprocs=2, start_method="fork"
            )
            seconds, peak, expert_bytes = out.read_text().split()
            name = f"dp_shard 2, ep {ep}"
            print(f"{name:<22}{float(seconds):>9.3f}{float(peak):>10.2f}{int(expert_bytes) / 2**20:>19.1f}")

        from sharpen.trainer import SingleDeviceBackend, Trainer

        torch.set_num_threads(1)
        print("\nPart 2: routing replay, one process")
        print(f"{'routing_replay':<16}{'s/step':>9}{'vs none':>9}")
        baseline = None
        for replay in ("none", "r2", "r3"):
            config = _config(replay)
            backend = SingleDeviceBackend(config, model_path=model, dtype="float32")
            seconds = _median_step(Trainer(config, backend=backend, pad_token_id=0), _rollouts(True), args.steps)
            baseline = baseline or seconds
            print(f"{replay:<16}{seconds:>9.3f}{seconds / baseline:>9.2f}")


if __name__ == "__main__":
    main()
