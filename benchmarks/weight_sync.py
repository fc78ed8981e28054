"""Weight sync of SmolLM2-135M into a running vLLM engine (another process), beside a plain memory copy of the same
bytes, measured in the same run (the machine is shared and noisy).

Run: .venv/bin/python benchmarks/weight_sync.py [--repeats 5] [--bucket-mb 128 64]
For each bucket size it prints the median end-to-end sync (stream buckets through shared memory, verify every
bucket, vLLM's own loader and kernel repacking in the worker), the transport alone (end-to-end minus the time the
worker's vLLM loader took: copy into shared memory, checksums, RPCs), and both as a fraction of memcpy bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[128, 32])
    args = parser.parse_args()

    from sharpen.config.engines import VllmEngineConfig
    from sharpen.config.models import resolve_model_path
    from sharpen.config.schema import TrainerConfig
    from sharpen.rollout.engines.vllm import VllmEngine
    from sharpen.trainer import SingleDeviceBackend

    path = resolve_model_path("smollm2-135m-instruct")
    backend = SingleDeviceBackend(TrainerConfig(num_threads=2), model_path=path, dtype="float32")
    engine = VllmEngine(VllmEngineConfig(), model_path=path, dtype="float32", seed=0)
    tensors = dict(backend.named_weights())
    gib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30
    rows = []
    try:
        for bucket_mb in args.bucket_mb:
            engine.bucket_bytes = bucket_mb << 20
            if engine.sender is not None:
                engine.sender.close()
                engine.sender = None
            sync, transport, copy, buckets = [], [], [], 0.0
            for version in range(1, args.repeats + 1):
                started = time.perf_counter()
                metrics = engine.load_weights(iter(tensors.items()), version=version)
                sync.append(time.perf_counter() - started)
                transport.append(sync[-1] - metrics["sync/receiver_load_seconds"])
                buckets = metrics["sync/num_buckets"]
                started = time.perf_counter()
                copies = {name: tensor.clone() for name, tensor in tensors.items()}
                copy.append(time.perf_counter() - started)
                del copies
            rows.append((bucket_mb, int(buckets), *(statistics.median(v) for v in (sync, transport, copy))))
    finally:
        engine.close()
    print(f"bytes per sync: {gib:.3f} GiB ({len(tensors)} tensors); medians of {args.repeats}")
    print(
        f"{'bucket MiB':>10} {'buckets':>8} {'sync s':>8} {'transport s':>12} {'memcpy s':>9} "
        f"{'sync/memcpy bw':>15} {'transport/memcpy bw':>20}"
    )
    for bucket_mb, buckets, sync_s, transport_s, copy_s in rows:
        print(
            f"{bucket_mb:>10} {buckets:>8} {sync_s:>8.2f} {transport_s:>12.2f} {copy_s:>9.3f} "
            f"{copy_s / sync_s:>15.0%} {copy_s / transport_s:>20.0%}"
        )


if __name__ == "__main__":
    main()
