"""Adapter-only LoRA sync into vLLM against the merged sync, SmolLM2-135M on vLLM's CPU build, in one run.

Run: .venv/bin/python benchmarks/lora_vllm_sync.py [--rank 16] [--repeats 3] [--prompts 16] [--tokens 32]
One LoRA trainer (float32, one optimizer step so B != 0) feeds two vLLM engines in turn, each in this process and
closed before the next starts: ``adapter`` (enable_lora; the trainer sends the adapter tensors, `AdapterFolders`
writes the checked peft folder, vLLM loads it) and ``merged`` (no LoRA; the trainer sends W + (alpha / r) B A of
the target modules through the verified shared-memory buckets). Each syncs ``--repeats`` times (the probe check
included) and generates ``--prompts`` x ``--tokens`` tokens with seeded sampling ``--repeats`` times.
Printed side by side with adapter / merged ratios: engine start-up, bytes per sync, median sync seconds, median
generation seconds, and the probe mismatch against the trainer (both must be float32-close).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")

    from sharpen.config.engines import VllmEngineConfig
    from sharpen.config.models import resolve_model_path
    from sharpen.config.schema import LoraConfig, TrainerConfig
    from sharpen.orchestration.weight_sync import WeightSync
    from sharpen.rollout.engines.vllm import VllmEngine
    from sharpen.trainer import SingleDeviceBackend, Trainer
    from sharpen.types import Example, Message, Rollout, SamplingParams, TrainBatch

    path = resolve_model_path("smollm2-135m-instruct")
    lora = LoraConfig(enabled=True, rank=args.rank, alpha=2 * args.rank, sync="adapter")
    config = TrainerConfig(device="cpu", precision="float32", learning_rate=1e-3, micro_batch_size=8, lora=lora)
    backend = SingleDeviceBackend(config, model_path=path, dtype="float32")
    trainer = Trainer(config, backend=backend, pad_token_id=2)
    rng = random.Random(0)
    example = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")
    rollouts = [
        Rollout(
            example=example,
            prompt_ids=[rng.randrange(100, 20000) for _ in range(24)],
            completion_ids=(completion := [rng.randrange(100, 20000) for _ in range(24)]),
            completion_logprobs=[math.log(1 / 49152)] * len(completion),
            versions=[0] * len(completion),
            sample_index=index,
            advantage=1.0 if index % 2 else -1.0,
        )
        for index in range(8)
    ]
    trainer.step(TrainBatch(rollouts=rollouts, step=0))
    probe = list(range(1000, 1040))
    prompts = [[rng.randrange(100, 20000) for _ in range(16)] for _ in range(args.prompts)]
    params = [SamplingParams(max_new_tokens=args.tokens, seed=index) for index in range(args.prompts)]

    results: dict[str, dict[str, float]] = {}
    for mode in ("adapter", "merged"):
        backend.config = config.model_copy(update={"lora": lora.model_copy(update={"sync": mode})})
        started = time.perf_counter()
        engine = VllmEngine(
            VllmEngineConfig(), model_path=path, dtype="float32", seed=0, lora=lora if mode == "adapter" else None
        )
        startup = time.perf_counter() - started
        sync = WeightSync(probe_ids=probe, tolerance=1e-3, verify=True)
        syncs, generations, mismatch, num_bytes = [], [], 0.0, 0.0
        for version in range(1, args.repeats + 1):
            metrics = sync(trainer, engine, version=version)
            syncs.append(metrics["sync/seconds"])
            mismatch, num_bytes = metrics["sync/probe_mismatch_mean"], metrics["sync/gib"] * 2**30
            started = time.perf_counter()
            completions = engine.generate(prompts, params)
            generations.append(time.perf_counter() - started)
            assert sum(len(c.token_ids) for c in completions) > 0
        engine.close()
        results[mode] = {
            "startup_s": startup,
            "sync_mib": num_bytes / 2**20,
            "sync_s": statistics.median(syncs),
            "generate_s": statistics.median(generations),
            "probe_mismatch": mismatch,
        }
    print(f"SmolLM2-135M, rank {args.rank}, {args.prompts} prompts x {args.tokens} tokens, {args.repeats} repeats")
    print(f"{'measure':<16}{'adapter':>12}{'merged':>12}{'adapter/merged':>16}")
    for key in ("startup_s", "sync_mib", "sync_s", "generate_s", "probe_mismatch"):
        a, m = results["adapter"][key], results["merged"][key]
        print(f"{key:<16}{a:>12.4g}{m:>12.4g}{a / m if m else float('nan'):>16.3f}")


if __name__ == "__main__":
    main()
