"""Parallel layouts of the trainer side by side on CPU ranks (gloo): step time, memory, and each rank's share of the
parameter + gradient + optimizer bytes against the expected 1 / (tp x pp x dp_shard); then how far each tensor-parallel
plan's logprobs are from one process's on the real SmolLM2-135M.

Run: .venv/bin/python benchmarks/parallel_step.py [--steps 3] [--skip-real-model]

Part 1: a random Llama (4 layers, hidden 256, intermediate 704, 8 heads, 4 key/value heads, vocabulary 8192) and a
fixed batch of 8 rollouts. Every layout trains the same batch (each data-parallel rank its token-balanced share,
micro-batches of 2, zero-weighted filler passes), one torch thread a rank; a step is forward/backward of a
policy-gradient loss (`train_micro_batches`: through the schedule with pp) and `clip_and_step`. Printed per layout:
the median seconds per step after one warm-up step, the peak resident memory of rank 0 (``ru_maxrss``; the forked
ranks share the parent's pages until they write them, so this counts the model, its shards and the step's tensors plus
~0.5 GB of torch), and rank 0's local bytes of parameters, gradients (after the backward) and AdamW state against the
single model's total / (tp x pp x dp_shard): with pp, a stage holds whole layers, so its share is only near 1 / pp
(rank 0's stage: the embedding and 2 layers). The machine has 2 cores: layouts of 4 ranks share them, so their times
measure the overhead, not a speed-up. Then how long a weight sync's tensors take to leave the ranks, by the two paths
of ``weight_sync.assemble`` (medians of 3, the transport to the engine not included): ``gather`` is rank 0's
`named_weights` (every whole tensor gathered by all-gathers and, with pp, broadcasts between stages, and copied to
the host); ``pieces`` is the slowest rank's `weight_shards` (its own boxes copied to the host, no collective) and
``assemble`` the receiver's `assemble_weights` of every rank's pieces in one process.

Part 2: SmolLM2-135M-Instruct (9 heads, 3 key/value heads: tp 3) in float32, one forward of 4 rows of 64 tokens:
the largest difference of each plan's per-token logprobs from the single-device backend's, and whether they are
identical.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from fsdp2_step import (  # the same batch and step as the FSDP2 benchmark (run from benchmarks/: on sys.path)
    _rollouts,
    _time_steps,
)

LAYOUTS = {  # name: (ranks, ParallelLayout sizes)
    "dp_shard 2 (FSDP2 alone)": (2, {"dp_shard": 2}),
    "tp 2": (2, {"tp": 2}),
    "dp_shard 4 (FSDP2 alone)": (4, {"dp_shard": 4}),
    "tp 2 x dp_shard 2": (4, {"tp": 2, "dp_shard": 2}),
    "tp 4": (4, {"tp": 4}),
    "pp 2 (1F1B)": (2, {"pp": 2}),
    "pp 2 (interleaved, 2 a rank)": (2, {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2}),
    "pp 2 x tp 2": (4, {"pp": 2, "tp": 2}),
}


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def _steps(backend, rollouts: list, *, num_steps: int) -> tuple[list[float], int, int, int]:
    """Seconds of each step after a warm-up (`fsdp2_step._time_steps` over this data-parallel rank's share), and
    this rank's parameter, gradient and optimizer-state bytes."""
    grad_bytes = [0]

    def count_gradients(backend) -> None:
        grad_bytes[0] = _local_bytes(p.grad for p in backend.model.parameters() if p.grad is not None)

    seconds = _time_steps(
        backend,
        rollouts,
        rank=backend.rank,
        num_ranks=backend.num_ranks,
        num_steps=num_steps,
        on_gradients=count_gradients,
    )
    state = backend.optimizer.state.values()
    optimizer_bytes = _local_bytes(t for s in state for t in s.values() if isinstance(t, torch.Tensor) and t.dim())
    return seconds, _local_bytes(backend.model.parameters()), grad_bytes[0], optimizer_bytes


def _rank(rank: int, num_ranks: int, port: int, model_dir: Path, sizes: dict, num_steps: int, queue) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(num_ranks)})
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from sharpen.config.schema import TrainerConfig
    from sharpen.trainer.backends.fsdp2 import FSDP2Backend
    from sharpen.trainer.backends.mesh import init_distributed
    from sharpen.trainer.layout import ParallelLayout

    init_distributed("gloo")
    config = TrainerConfig(device="cpu", precision="float32")
    backend = FSDP2Backend(config, model_path=model_dir, dtype="float32", layout=ParallelLayout(**sizes))
    seconds, params, grads, optimizer = _steps(backend, _rollouts(8, 8192), num_steps=num_steps)
    sync = _sync_seconds(backend)
    if rank == 0:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        queue.put((statistics.median(seconds), peak_mb, params, grads, optimizer, *sync))
    torch.distributed.destroy_process_group()


def _sync_seconds(backend, *, repeats: int = 3) -> tuple[float, float, float]:
    """Medians of: rank 0's gathered weights (collective), the slowest rank's pieces, and assembling all pieces."""
    import torch.distributed as dist

    from sharpen.weight_shards import assemble_weights

    gather, pieces, assemble = [], [], []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        for _, tensor in backend.named_weights():
            tensor.to("cpu", copy=True)
        gather.append(time.perf_counter() - started)
        dist.barrier()
        started = time.perf_counter()
        shards = backend.weight_shards()
        slowest = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        pieces.append(slowest.item())
        every_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, shards)
        started = time.perf_counter()
        for _ in assemble_weights(shard for rank_shards in every_rank for shard in rank_shards):
            pass
        assemble.append(time.perf_counter() - started)
    return statistics.median(gather), statistics.median(pieces), statistics.median(assemble)


def _launch(worker, num_ranks: int, *args):
    context = mp.get_context("fork")
    queue = context.SimpleQueue()
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(worker, args=(num_ranks, port, *args, queue), nprocs=num_ranks, join=True, start_method="fork")
    return queue.get()


def _layouts(num_steps: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder)
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=8192,
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        )
        model = LlamaForCausalLM(config)
        model.save_pretrained(model_dir)
        full = sum(p.numel() * p.element_size() for p in model.parameters())  # tied head counted once
        del model
        print(f"model: {full / 2**20:.1f} MiB of float32 parameters; expected per rank: that x (1 + 1 + 2) / share")
        print(
            f"{'layout':28} {'s/step':>7} {'peak RSS MiB':>12} {'params':>7} {'grads':>7} {'AdamW':>7}  (x expected)"
            f"  {'gather s':>8} {'pieces s':>8} {'assemble s':>10}"
        )
        for name, (num_ranks, sizes) in LAYOUTS.items():
            result = _launch(_rank, num_ranks, model_dir, sizes, num_steps)
            seconds, peak_mb, params, grads, optimizer, gather, pieces, assemble = result
            share = sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("dp_shard", 1)
            expected = full / share
            print(
                f"{name:28} {seconds:7.3f} {peak_mb:12.0f} {params / expected:7.2f} {grads / expected:7.2f} "
                f"{optimizer / (2 * expected):7.2f}                {gather:8.4f} {pieces:8.4f} {assemble:10.4f}"
            )


def _plan_worker(rank: int, num_ranks: int, port: int, model_dir: Path, plan: str, queue) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(num_ranks)})
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from sharpen.config.schema import TrainerConfig
    from sharpen.trainer.backends.fsdp2 import FSDP2Backend
    from sharpen.trainer.backends.mesh import init_distributed
    from sharpen.trainer.layout import ParallelLayout

    init_distributed("gloo")
    config = TrainerConfig(device="cpu", precision="float32", parallel={"tp_plan": plan})
    backend = FSDP2Backend(config, model_path=model_dir, dtype="float32", layout=ParallelLayout(tp=num_ranks))
    with torch.no_grad():
        logprobs = backend.token_logprobs(*_probe_batch(), temperature=1.0)
    if rank == 0:
        queue.put(logprobs.tolist())  # plain data: a tensor would be shared through a file the exiting rank closes
    torch.distributed.destroy_process_group()


def _probe_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 49152, (4, 64), generator=generator)
    return ids, torch.ones_like(ids), torch.ones(4, 63, dtype=torch.bool)


def _plans() -> None:
    from sharpen.config.models import resolve_model_path
    from sharpen.config.schema import TrainerConfig
    from sharpen.trainer import SingleDeviceBackend

    model_dir = resolve_model_path("smollm2-135m-instruct")
    got = {plan: torch.tensor(_launch(_plan_worker, 3, model_dir, plan)) for plan in ("gather", "rowwise")}
    torch.set_num_threads(1)
    single = SingleDeviceBackend(
        TrainerConfig(device="cpu", precision="float32"), model_path=model_dir, dtype="float32"
    )
    with torch.no_grad():
        expected = single.token_logprobs(*_probe_batch(), temperature=1.0)
    print("SmolLM2-135M, tp 3, float32, 4 x 63 target tokens, against the single-device backend:")
    for plan, logprobs in got.items():
        difference = (logprobs - expected).abs()
        print(
            f"  {plan:8} max |d logprob| {difference.max().item():.3e}  mean {difference.mean().item():.3e}  "
            f"identical tokens {int((difference == 0).sum())}/{difference.numel()}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-real-model", action="store_true")
    args = parser.parse_args()
    _layouts(args.steps)
    if not args.skip_real_model:
        _plans()


if __name__ == "__main__":
    main()
