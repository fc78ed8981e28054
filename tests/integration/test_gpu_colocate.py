"""Colocation on a GPU (runtime.colocate with vLLM's sleep mode), for `benchmarks/gpu_check.sh`: skipped without
CUDA. vLLM frees its weights and KV cache while asleep, reloads the trainer's weights after waking and samples as
before; a colocated run trains in one process and with the trainer and engine actors sharing one GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = {"max_new_tokens": 16, "temperature": 0.0}


def test_vllm_sleeps_frees_the_device_and_wakes_to_the_trainers_weights(smollm2_path: Path) -> None:
    from sharpen.config.engines import VllmEngineConfig
    from sharpen.config.schema import TrainerConfig
    from sharpen.rollout.engines import EngineError
    from sharpen.rollout.engines.vllm import VllmEngine
    from sharpen.trainer import SingleDeviceBackend
    from sharpen.types import SamplingParams

    config = VllmEngineConfig(gpu_memory_utilization=0.2, enforce_eager=True)
    engine = VllmEngine(config, model_path=smollm2_path, dtype="bfloat16", seed=0, sleep_mode=True)
    try:
        prompt = [[1, 504, 3458, 282, 4193, 314]]
        before = engine.generate(prompt, [SamplingParams(**GREEDY)])[0]
        probe = engine.score(prompt[0])
        freed = engine.sleep()["colocate/freed_bytes"]
        print(f"vLLM sleep freed {freed / 2**30:.2f} GiB")
        assert freed > 0.5 * 135e6 * 2  # at least half of the bf16 weights (plus the KV cache)
        with pytest.raises(EngineError, match="while asleep"):
            engine.generate(prompt, [SamplingParams(**GREEDY)])
        engine.wake_up()
        backend = SingleDeviceBackend(TrainerConfig(device="cuda"), model_path=smollm2_path, dtype="bfloat16")
        engine.load_weights(backend.named_weights(), version=1)
        after = engine.generate(prompt, [SamplingParams(**GREEDY)])[0]
        assert after.token_ids == before.token_ids
        assert engine.score(prompt[0]) == pytest.approx(probe, abs=1e-2)
    finally:
        engine.close()


def _demo(tmp_path: Path, name: str, *extra: str):
    from sharpen.config import load_config

    return load_config(
        Path(__file__).parents[2] / "recipes" / "demo.toml",
        [
            f"run.output_dir={json.dumps(str(tmp_path))}",
            f'run.name="{name}"',
            "run.num_steps=2",
            "run.export_model=false",
            "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=32",
            "trainer.micro_batch_size=8",
            "trainer.device='cuda'",
            "rollout.engine.gpu_memory_utilization=0.2",
            "runtime.colocate=true",
            "monitoring.progress=false",
            *extra,
        ],
    )


def test_a_colocated_vllm_run_on_one_gpu(smollm2_path: Path, tmp_path: Path) -> None:
    from sharpen.monitoring import read_jsonl
    from sharpen.orchestration.runtime import run

    rows = read_jsonl(run(_demo(tmp_path, "local")) / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        print({k: row[k] for k in ("colocate/freed_bytes", "time/sleep", "time/wake", "sync/probe_mismatch_mean")})
        assert row["colocate/freed_bytes"] > 0 and row["sync/probe_mismatch_mean"] < 1e-2


@pytest.mark.ray
@pytest.mark.usefixtures("ray_instance")
def test_colocated_ray_actors_on_one_gpu(smollm2_path: Path, tmp_path: Path) -> None:
    from sharpen.config.runtime import RuntimeConfig
    from sharpen.monitoring import read_jsonl
    from sharpen.orchestration.runtime import run

    runtime = RuntimeConfig(
        type="ray", colocate=True, trainer_cpus=0.5, engine_cpus=0.5, trainer_gpus=0.5, engine_gpus=0.5
    )
    rows = read_jsonl(run(_demo(tmp_path, "ray", 'runtime.type="ray"'), runtime=runtime) / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert row["colocate/freed_bytes"] > 0 and row["sync/probe_mismatch_mean"] < 1e-2
