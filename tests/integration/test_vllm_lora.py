"""Adapter-only LoRA sync into vLLM on the CPU with SmolLM2 (``trainer.lora.sync = "adapter"``): the engine serves
the base weights plus the adapter of the last sync, its logprobs match the trainer's peft forward, merged weights
sent to it are refused, a load that does not take effect is caught by the probe, and a whole run syncs a few MiB
per step instead of the projections. One engine for the whole module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sharpen.config.engines import VllmEngineConfig
from sharpen.config.schema import LoraConfig, TrainerConfig
from sharpen.orchestration.phases import assign_advantages
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.rollout.engines import EngineError
from sharpen.rollout.weight_sync import WeightSyncError
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.types import (
    Example,
    Message,
    RewardResult,
    RewardStatus,
    Rollout,
    RolloutGroup,
    SamplingParams,
    TrainBatch,
)

pytestmark = pytest.mark.slow

TOLERANCE = 1e-3  # float32 on both sides, as in test_vllm_sync.py
LORA = LoraConfig(enabled=True, rank=8, alpha=16, sync="adapter")


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Iterator:
    from sharpen.rollout.engines.vllm import VllmEngine

    engine = VllmEngine(VllmEngineConfig(), model_path=smollm2_path, dtype="float32", seed=0, lora=LORA)
    yield engine
    engine.close()


def lora_trainer(smollm2_path: Path, *, sync: str = "adapter") -> Trainer:
    config = TrainerConfig(
        learning_rate=2e-3,
        micro_batch_size=4,
        num_threads=2,
        precision="float32",
        lora=LORA.model_copy(update={"sync": sync}),
    )
    return Trainer(
        config, backend=SingleDeviceBackend(config, model_path=smollm2_path, dtype="float32"), pad_token_id=2
    )


@pytest.fixture(scope="module")
def trainer(smollm2_path: Path) -> Trainer:
    return lora_trainer(smollm2_path)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def _mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def _train_one_step(engine, trainer: Trainer, tokenizer, *, step: int) -> None:
    example = Example(task_key="t/0", prompt=(Message(role="user", content="What is 3 + 4?"),), answer="7")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": example.prompt[0].content}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    completions = engine.generate([prompt] * 4, [SamplingParams(max_new_tokens=12, seed=s) for s in range(4)])
    rollouts = [
        Rollout(
            example=example,
            prompt_ids=prompt,
            completion_ids=c.token_ids,
            completion_logprobs=c.logprobs,
            versions=[engine.policy_version] * len(c.token_ids),
            completion_text=c.text,
            sample_index=i,
            reward=RewardResult(score=float(i % 2), status=RewardStatus.OK),
        )
        for i, c in enumerate(completions)
    ]
    for rollout in rollouts:  # the engine samples with the trainer's policy, adapter included
        recomputed = trainer.compute_logprobs(rollout.prompt_ids + rollout.completion_ids)[len(prompt) - 1 :]
        assert _mean_abs(recomputed, rollout.completion_logprobs) < TOLERANCE
    assign_advantages([RolloutGroup(example=example, rollouts=rollouts)], trainer.config.algorithm)
    trainer.step(TrainBatch(rollouts=rollouts, step=step))


def test_the_adapter_sync_takes_effect_and_is_verified(engine, trainer, tokenizer) -> None:
    sync = WeightSync(probe_ids=tokenizer.encode("The capital of France is Paris."), tolerance=TOLERANCE, verify=True)
    sync(trainer, engine, version=0)  # B = 0: the adapter of version 0 is the base model
    before = engine.score(sync.probe_ids)
    for step in (0, 1):
        _train_one_step(engine, trainer, tokenizer, step=step)
        metrics = sync(trainer, engine, version=step + 1)
        assert metrics["sync/probe_mismatch_mean"] < TOLERANCE
        assert metrics["sync/num_tensors"] == 2 * 7 * 30  # A and B of 7 projections in 30 layers, nothing else
        assert metrics["sync/gib"] < 0.01  # rank 8: ~9 MiB against 405 MiB of merged projections
    after = engine.score(sync.probe_ids)
    assert _mean_abs(before, after) > 10 * TOLERANCE  # the engine's logprobs moved...
    assert _mean_abs(after, trainer.compute_logprobs(sync.probe_ids)) < TOLERANCE  # ...to the trainer's
    assert engine.policy_version == 2 and engine.lora_request is not None
    print(f"adapter sync: {metrics['sync/gib'] * 1024:.1f} MiB in {metrics['sync/seconds']:.2f} s")


def test_merged_weights_are_refused_and_a_load_without_effect_is_caught(
    engine, trainer, tokenizer, smollm2_path: Path, monkeypatch
) -> None:
    version = engine.policy_version
    merged = lora_trainer(smollm2_path, sync="merged")
    with pytest.raises(EngineError, match=r"rejected adapter version 7: .* is not a LoRA adapter tensor"):
        engine.load_weights(merged.named_weights(), version=7)
    assert engine.policy_version == version
    del merged

    sync = WeightSync(probe_ids=tokenizer.encode("Two plus two is four."), tolerance=TOLERANCE, verify=True)
    sync(trainer, engine, version=version)
    _train_one_step(engine, trainer, tokenizer, step=5)
    monkeypatch.setattr(engine.llm.llm_engine, "add_lora", lambda request: True)  # claims to load, loads nothing
    monkeypatch.setattr(engine.llm.llm_engine, "remove_lora", lambda lora_id: True)
    previous = engine.lora_request
    monkeypatch.setattr(
        type(engine), "lora_request", property(lambda self: previous, lambda self, value: None), raising=False
    )
    with pytest.raises(WeightSyncError, match=r"had no effect"):
        sync(trainer, engine, version=version + 1)
    monkeypatch.undo()
    metrics = sync(trainer, engine, version=version + 2)  # a real load then passes
    assert metrics["sync/probe_mismatch_mean"] < TOLERANCE


def test_a_lora_run_on_vllm_syncs_the_adapter_alone(engine, tmp_path: Path) -> None:
    from sharpen.config import load_config
    from sharpen.monitoring import read_jsonl
    from sharpen.orchestration.embedded import run_embedded

    config = load_config(
        Path(__file__).parents[2] / "recipes" / "lora.toml",
        [
            f"run.output_dir={json.dumps(str(tmp_path))}",
            "run.num_steps=2",
            "run.export_model=false",
            "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=12",
            "trainer.micro_batch_size=8",
            "monitoring.progress=false",
            'trainer.precision="float32"',  # the engine fixture is float32
            f"trainer.lora.rank={LORA.rank}",
            f"trainer.lora.alpha={LORA.alpha}",
            'trainer.lora.sync="adapter"',
        ],
    )
    rows = read_jsonl(run_embedded(config, engine=engine) / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert row["sync/gib"] < 0.01 and row["sync/probe_mismatch_mean"] < TOLERANCE
        assert row["train/num_loss_tokens"] > 0
