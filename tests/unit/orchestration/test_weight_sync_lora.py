"""Weight sync of a LoRA policy into the transformers engine (tiny random Llama, float32): the merged target weights
are the only tensors sent, the probe then passes, and a sync that was missed is caught."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from sharpen.config.schema import LoraConfig, TrainerConfig
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.rollout.engines.hf import HfEngine
from sharpen.rollout.weight_sync import WeightSyncError
from sharpen.rollout.weight_sync.verify import FLOAT32_TOLERANCE
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.types import Example, Message, Rollout, TrainBatch

PROBE = list(range(100, 140))
_EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")


def _trainer(model_path: Path) -> Trainer:
    config = TrainerConfig(
        device="cpu",
        precision="float32",
        learning_rate=1e-2,
        num_threads=1,
        lora=LoraConfig(enabled=True, rank=4, alpha=8),
    )
    backend = SingleDeviceBackend(config, model_path=model_path, dtype="float32")
    return Trainer(config, backend=backend, pad_token_id=0)


def _step(trainer: Trainer, seed: int) -> None:
    rng = random.Random(seed)
    rollouts = [
        Rollout(
            example=_EXAMPLE,
            prompt_ids=[rng.randrange(1, 1000) for _ in range(4)],
            completion_ids=(completion := [rng.randrange(1, 1000) for _ in range(5)]),
            completion_logprobs=[math.log(1e-4)] * len(completion),
            versions=[0] * len(completion),
            sample_index=index,
            advantage=rng.uniform(-1.5, 1.5),
        )
        for index in range(4)
    ]
    trainer.step(TrainBatch(rollouts=rollouts, step=seed))


class _CountingEngine:
    """The HF engine, counting what each sync sends."""

    def __init__(self, engine: HfEngine) -> None:
        self.engine = engine
        self.names: list[str] = []
        self.num_bytes = 0

    def load_weights(self, weights, *, version):
        def counted():
            for name, tensor in weights:
                self.names.append(name)
                self.num_bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        return self.engine.load_weights(counted(), version=version)

    def score(self, token_ids):
        return self.engine.score(token_ids)


def test_merged_sync_sends_the_projections_only_and_the_probe_passes(tiny_model_path):
    torch.manual_seed(0)
    trainer = _trainer(tiny_model_path)
    engine = _CountingEngine(HfEngine(tiny_model_path, dtype="float32"))
    sync = WeightSync(probe_ids=PROBE, tolerance=FLOAT32_TOLERANCE, verify=True)
    sync(trainer, engine, version=0)  # type: ignore[arg-type]
    for version in (1, 2):
        _step(trainer, seed=version)
        engine.names.clear()
        engine.num_bytes = 0
        metrics = sync(trainer, engine, version=version)  # type: ignore[arg-type]
        assert metrics["sync/probe_trainer_delta"] > 1e-4  # the policy really moved
        assert metrics["sync/probe_mismatch_mean"] < 1e-5
    assert engine.names and all(name.endswith("_proj.weight") for name in engine.names)
    full_bytes = sum(p.numel() * p.element_size() for p in engine.engine.model.state_dict().values())
    projections = sum(
        t.numel() * t.element_size() for n, t in engine.engine.model.state_dict().items() if n.endswith("_proj.weight")
    )
    assert engine.num_bytes == projections < full_bytes


def test_a_missed_lora_sync_is_caught(tiny_model_path):
    torch.manual_seed(0)
    trainer = _trainer(tiny_model_path)
    engine = HfEngine(tiny_model_path, dtype="float32")
    sync = WeightSync(probe_ids=PROBE, tolerance=FLOAT32_TOLERANCE, verify=True)
    sync(trainer, engine, version=0)
    _step(trainer, seed=1)
    with pytest.raises(WeightSyncError):
        sync.load([], engine, version=1, reference=lambda: sync.reference(trainer))  # nothing arrived
