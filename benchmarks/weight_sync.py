"""Weight sync of SmolLM2-135M into a running vLLM engine, beside a plain memory copy of the same bytes.

Run: .venv/bin/python benchmarks/weight_sync.py [--repeats 5]
Prints seconds per sync (write to shared memory + load in the engine worker), the bytes moved, and the ratio to
`torch` copying the same tensors once, measured in the same run (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from sharpen.config.models import resolve_model_path
    from sharpen.config.schema import TrainerConfig, VllmEngineConfig
    from sharpen.rollout.engines.vllm import VllmEngine
    from sharpen.trainer import SingleDeviceBackend

    path = resolve_model_path("smollm2-135m-instruct")
    backend = SingleDeviceBackend(TrainerConfig(num_threads=2), model_path=path, dtype="float32")
    engine = VllmEngine(VllmEngineConfig(), model_path=path, dtype="float32", seed=0)
    try:
        tensors = dict(backend.named_weights())
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        sync_seconds, copy_seconds, parts = [], [], []
        for version in range(1, args.repeats + 1):
            started = time.perf_counter()
            metrics = engine.load_weights(iter(tensors.items()), version=version)
            sync_seconds.append(time.perf_counter() - started)
            parts.append(metrics)
            started = time.perf_counter()
            copies = {name: tensor.clone() for name, tensor in tensors.items()}
            copy_seconds.append(time.perf_counter() - started)
            del copies
    finally:
        engine.close()
    sync, copy = statistics.median(sync_seconds), statistics.median(copy_seconds)
    write = statistics.median(p["sync/write_seconds"] for p in parts)
    load = statistics.median(p["sync/load_seconds"] for p in parts)
    gib = num_bytes / 2**30
    print(f"bytes per sync            {gib:.3f} GiB ({len(tensors)} tensors)")
    print(f"sync (median of {args.repeats})       {sync:.2f} s  ({gib / sync:.2f} GiB/s)")
    print(f"  of which write / load   {write:.2f} s / {load:.2f} s")
    print(f"plain memory copy         {copy:.3f} s  ({gib / copy:.2f} GiB/s)")
    print(f"sync / memcpy time ratio  {sync / copy:.1f}x  (bandwidth fraction {copy / sync:.2%})")


if __name__ == "__main__":
    main()
