"""LoRA against full fine-tuning of SmolLM2-135M, in one run: trainer memory and weight-sync cost.

Run: .venv/bin/python benchmarks/lora.py [--steps 2] [--rank 16] [--threads 2]
Each mode runs in its own fresh process (so peak RSS is its own): the single-device backend in float32 takes
``--steps`` GRPO-style steps on a fixed synthetic batch (8 rollouts, 48 prompt + 48 completion tokens), then syncs
its weights into a transformers engine (in-process copies of the tensors the sync sends) ``--repeats`` times.
Printed side by side with LoRA / full ratios: peak RSS during training (before the engine exists), trainable
parameters, AdamW state bytes, step time, bytes per sync, median sync time, and the adapter's own bytes (what an
adapter-only sync would send).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import statistics
import subprocess
import sys
import time


def _measure(mode: str, *, steps: int, rank: int, threads: int, repeats: int) -> dict[str, float]:
    import torch

    from sharpen.config.models import resolve_model_path
    from sharpen.config.schema import LoraConfig, TrainerConfig
    from sharpen.rollout.engines.hf import HfEngine
    from sharpen.trainer import SingleDeviceBackend, Trainer
    from sharpen.types import Example, Message, Rollout, TrainBatch

    path = resolve_model_path("smollm2-135m-instruct")
    lora = LoraConfig(enabled=mode == "lora", rank=rank, alpha=2 * rank)
    config = TrainerConfig(
        device="cpu", precision="float32", learning_rate=1e-5, micro_batch_size=8, num_threads=threads, lora=lora
    )
    backend = SingleDeviceBackend(config, model_path=path, dtype="float32")
    trainer = Trainer(config, backend=backend, pad_token_id=0)
    rng = random.Random(0)
    example = Example(task_key="bench/0", prompt=(Message(role="user", content="q"),), answer="a")
    rollouts = [
        Rollout(
            example=example,
            prompt_ids=[rng.randrange(1, 49_000) for _ in range(48)],
            completion_ids=[rng.randrange(1, 49_000) for _ in range(48)],
            completion_logprobs=[math.log(1e-4)] * 48,
            versions=[0] * 48,
            sample_index=index,
            advantage=rng.uniform(-1.0, 1.0),
        )
        for index in range(8)
    ]
    step_seconds = []
    for step in range(steps):
        started = time.perf_counter()
        trainer.step(TrainBatch(rollouts=rollouts, step=step))
        step_seconds.append(time.perf_counter() - started)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    optimizer_bytes = sum(
        t.numel() * t.element_size()
        for state in backend.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    trainable = sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    adapter_bytes = 0.0
    if backend.lora is not None:
        from sharpen.trainer.backends.lora import adapter_num_bytes

        adapter_bytes = float(adapter_num_bytes(backend.lora))
    engine = HfEngine(path, dtype="float32")
    sync_seconds, sync_bytes = [], 0
    for version in range(1, repeats + 1):
        started = time.perf_counter()
        sent = list(trainer.named_weights())
        engine.load_weights(sent, version=version)
        sync_seconds.append(time.perf_counter() - started)
        sync_bytes = sum(t.numel() * t.element_size() for _, t in sent)
    return {
        "peak_rss_gib": peak_rss / 2**30,
        "trainable_params_m": trainable / 1e6,
        "optimizer_state_mib": optimizer_bytes / 2**20,
        "step_seconds": statistics.median(step_seconds),
        "sync_mib": sync_bytes / 2**20,
        "sync_seconds": statistics.median(sync_seconds),
        "adapter_mib": adapter_bytes / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mode", choices=["lora", "full"], help="internal: measure one mode in this process")
    args = parser.parse_args()
    if args.mode:
        result = _measure(args.mode, steps=args.steps, rank=args.rank, threads=args.threads, repeats=args.repeats)
        print(json.dumps(result))
        return
    results = {}
    for mode in ("full", "lora"):
        command = [sys.executable, __file__, "--mode", mode, *sys.argv[1:]]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(output.strip().splitlines()[-1])
    print(f"SmolLM2-135M, float32, rank {args.rank}, {args.steps} steps of 8 x 96 tokens, {args.threads} threads")
    print(f"{'metric':<22}{'full':>12}{'lora':>12}{'lora/full':>12}")
    for name in results["full"]:
        full, lora = results["full"][name], results["lora"][name]
        ratio = f"{lora / full:.3f}" if full else "-"
        print(f"{name:<22}{full:>12.3f}{lora:>12.3f}{ratio:>12}")


if __name__ == "__main__":
    main()
