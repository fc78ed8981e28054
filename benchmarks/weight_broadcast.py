"""Weight sync by torch.distributed broadcast (the Ray runtime's ``weight_sync.transport = "broadcast"``) of
SmolLM2-135M to another process, beside a plain memory copy of the same bytes, measured in the same run.

Run: .venv/bin/python benchmarks/weight_broadcast.py [--repeats 5] [--bucket-mb 128 32]
The receiver is a second process that joins the gloo weight group and copies every received tensor into its own
copy of the weights (what an engine's load does); each sync is timed from the sender's first bucket to the
receiver's acknowledgement. Printed: median seconds, GB/s, and the fraction of memcpy bandwidth.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def receiver(port: int, num_syncs: int, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    from sharpen.rollout.weight_sync.broadcast import open_weight_group, receive_weights

    torch.set_num_threads(1)
    group = open_weight_group(rank=1, world_size=2, master_addr="127.0.0.1", master_port=port)
    state = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
    done = torch.zeros(1)
    for version in range(num_syncs):
        for name, tensor in receive_weights(group, version=version):
            state[name].copy_(tensor)
        options = torch.distributed.AllreduceOptions()
        group.allreduce([done], options).wait()  # the acknowledgement: every tensor is in place


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[128, 32])
    args = parser.parse_args()

    from sharpen.config.models import resolve_model_path
    from sharpen.config.schema import TrainerConfig
    from sharpen.rollout.weight_sync.broadcast import open_weight_group, send_weights
    from sharpen.trainer import SingleDeviceBackend

    backend = SingleDeviceBackend(
        TrainerConfig(num_threads=1), model_path=resolve_model_path("smollm2-135m-instruct"), dtype="float32"
    )
    tensors = dict(backend.named_weights())
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    port, num_syncs = free_port(), args.repeats * len(args.bucket_mb)
    shapes = {name: (t.shape, t.dtype) for name, t in tensors.items()}
    context = mp.get_context("spawn")
    process = context.Process(target=receiver, args=(port, num_syncs, shapes))
    process.start()
    group = open_weight_group(rank=0, world_size=2, master_addr="127.0.0.1", master_port=port)
    done = torch.zeros(1)
    print(f"SmolLM2-135M: {num_bytes / 2**30:.2f} GiB in {len(tensors)} tensors, gloo over loopback, 2 processes")
    print(f"{'bucket MiB':>10} {'buckets':>8} {'sync s':>7} {'GB/s':>6} {'memcpy s':>9} {'of memcpy':>10}")
    version = 0
    for bucket_mb in args.bucket_mb:
        syncs, copies, buckets = [], [], 0.0
        for _ in range(args.repeats):
            started = time.perf_counter()
            metrics = send_weights(group, tensors.items(), version=version, bucket_bytes=bucket_mb << 20)
            group.allreduce([done], torch.distributed.AllreduceOptions()).wait()
            syncs.append(time.perf_counter() - started)
            buckets = metrics["sync/num_buckets"]
            version += 1
            started = time.perf_counter()
            copied = {name: tensor.clone() for name, tensor in tensors.items()}
            copies.append(time.perf_counter() - started)
            del copied
        sync, copy = statistics.median(syncs), statistics.median(copies)
        print(
            f"{bucket_mb:>10} {buckets:>8.0f} {sync:>7.3f} {num_bytes / sync / 1e9:>6.2f} {copy:>9.3f} "
            f"{copy / sync:>10.1%}"
        )
    process.join(timeout=60)


if __name__ == "__main__":
    main()
