"""Adapter-only LoRA sync (``trainer.lora.sync = "adapter"``) up to the engine's door, on the tiny random Llama: the
trainer sends the adapter matrices alone, `AdapterFolders` writes them as a peft folder that peft itself loads
back to the trainer's own logprobs, and refuses what is not the run's adapter (merged weights, another rank or
module, half a pair, a file that reads back different). The vLLM side is tests/integration/test_vllm_lora.py."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from sharpen.config import ConfigError, load_config
from sharpen.config.schema import LoraConfig, TrainerConfig
from sharpen.rollout.weight_sync.adapter import ADAPTER_FILE, AdapterFolders, vllm_max_lora_rank
from sharpen.rollout.weight_sync.buckets import BucketError
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.types import Example, Message, Rollout, TrainBatch

PAD = 0
_LORA = {"enabled": True, "rank": 4, "alpha": 8, "sync": "adapter"}


def _trainer(model_dir: Path, **lora: object) -> Trainer:
    config = TrainerConfig(
        device="cpu",
        precision="float32",
        learning_rate=5e-2,
        micro_batch_size=4,
        lora=LoraConfig.model_validate({**_LORA, **lora}),
    )
    return Trainer(config, backend=SingleDeviceBackend(config, model_path=model_dir, dtype="float32"), pad_token_id=PAD)


def _step(trainer: Trainer) -> None:
    """One optimizer step on random rollouts, so that B != 0 and the adapter moves the logprobs."""
    rng = random.Random(0)
    example = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")
    rollouts = []
    for index in range(4):
        completion = [rng.randrange(1, 128) for _ in range(5)]
        rollouts.append(
            Rollout(
                example=example,
                prompt_ids=[rng.randrange(1, 128) for _ in range(4)],
                completion_ids=completion,
                completion_logprobs=[math.log(1 / 128)] * len(completion),
                versions=[0] * len(completion),
                sample_index=index,
                advantage=1.0 if index % 2 else -1.0,
            )
        )
    trainer.step(TrainBatch(rollouts=rollouts, step=0))


def test_the_trainer_sends_the_adapter_alone_as_a_folder_peft_loads_back(model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = _trainer(model_dir)
    _step(trainer)
    weights = list(trainer.named_weights())
    assert weights and all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name, _ in weights)
    assert len(weights) == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
    folders = AdapterFolders(trainer.config.lora)
    try:
        folder, metrics = folders.write(weights, version=1)
        assert metrics["sync/num_tensors"] == len(weights)
        assert metrics["sync/gib"] == pytest.approx(sum(t.numel() * 4 for _, t in weights) / 2**30)
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, str(folder)).eval()
        ids = list(range(3, 40))
        with torch.no_grad():
            logits = loaded(input_ids=torch.tensor([ids])).logits[0, :-1]
        peft_logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        trainer_logprobs = torch.tensor(trainer.compute_logprobs(ids))
        with torch.no_grad(), loaded.disable_adapter():
            base_logits = loaded(input_ids=torch.tensor([ids])).logits[0, :-1]
        base_logprobs = torch.log_softmax(base_logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert (peft_logprobs - trainer_logprobs).abs().max() < 1e-5
        assert (base_logprobs - trainer_logprobs).abs().mean() > 1e-3  # the adapter really moves them
    finally:
        folders.close()
    assert not folders.root.exists()


def test_anything_but_the_runs_adapter_is_refused(model_dir: Path) -> None:
    trainer = _trainer(model_dir)
    adapter = dict(trainer.named_weights())
    folders = AdapterFolders(trainer.config.lora)
    merged = _trainer(model_dir, sync="merged")
    try:
        with pytest.raises(BucketError, match=r"is not a LoRA adapter tensor.*merged weights"):
            folders.write(merged.named_weights(), version=1)
        name_a = next(name for name in adapter if name.endswith("q_proj.lora_A.weight"))
        with pytest.raises(BucketError, match=r"not rank 4 on dim 0"):
            folders.write([(name_a, torch.zeros(8, 32))], version=1)
        with pytest.raises(BucketError, match=r"module 'lm_head' is not in trainer\.lora\.target_modules"):
            folders.write([("base_model.model.lm_head.lora_A.weight", torch.zeros(4, 32))], version=1)
        with pytest.raises(BucketError, match=r"without both lora_A and lora_B"):
            folders.write([(name_a, adapter[name_a])], version=1)
        with pytest.raises(BucketError, match=r"sent no tensors"):
            folders.write([], version=1)
        assert list(folders.root.iterdir()) == []  # nothing was written for a refused sync
    finally:
        folders.close()


def test_a_file_that_reads_back_different_is_refused_and_removed(model_dir: Path, monkeypatch) -> None:
    import safetensors.torch

    trainer = _trainer(model_dir)
    _step(trainer)
    folders = AdapterFolders(trainer.config.lora)
    real_load = safetensors.torch.load_file

    def flipped(path: str) -> dict[str, torch.Tensor]:
        state = real_load(path)
        name = sorted(state)[3]
        state[name] = state[name].clone()
        state[name].view(-1)[0] += 1.0
        return state

    monkeypatch.setattr(safetensors.torch, "load_file", flipped)
    try:
        with pytest.raises(BucketError, match=r"reads back different"):
            folders.write(trainer.named_weights(), version=2)
        assert list(folders.root.iterdir()) == []
    finally:
        folders.close()


def test_the_two_newest_folders_are_kept(model_dir: Path) -> None:
    trainer = _trainer(model_dir)
    folders = AdapterFolders(trainer.config.lora)
    try:
        written = [folders.write(trainer.named_weights(), version=v)[0] for v in (1, 2, 3)]
        assert sorted(folders.root.iterdir()) == sorted(written[1:])
        assert all((folder / ADAPTER_FILE).is_file() for folder in written[1:])
    finally:
        folders.close()


def test_vllm_rank_and_the_config_checks() -> None:
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 16, 17, 512)] == [1, 8, 8, 16, 32, 512]
    with pytest.raises(BucketError, match="above the largest LoRA rank"):
        vllm_max_lora_rank(513)
    assert LoraConfig(enabled=True, sync="adapter").syncs_adapter
    assert not LoraConfig(enabled=False, sync="adapter").syncs_adapter
    assert not LoraConfig(enabled=True).syncs_adapter  # auto: merged
    lora = ["trainer.lora.enabled=true", 'trainer.lora.sync="adapter"']
    assert load_config(None, lora).trainer.lora.syncs_adapter  # the default engine is vllm
    with pytest.raises(ConfigError, match=r'needs rollout\.engine\.type = "vllm".*not hf'):
        load_config(None, [*lora, 'rollout.engine.type="hf"'])
    with pytest.raises(ConfigError, match=r"not vllm with async_engine"):
        load_config(None, [*lora, "rollout.engine.async_engine=true"])
