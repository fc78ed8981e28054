"""LoRA on the FSDP2 backend, 2 CPU ranks (gloo), against LoRA on one device: the `Trainer`'s steps give the same
merged weights, the base stays frozen, a sharded checkpoint resumes bit-exactly, and the export is the merged model.
One launch of 2 forked processes (~10-20 s on 2 shared cores)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from sharpen.config.schema import TrainerConfig
from sharpen.trainer import Trainer
from sharpen.types import Rollout, TrainBatch
from support.tiny_trainer import PAD, random_rollouts, single_device_trainer

NUM_RANKS = 2


def _config() -> TrainerConfig:
    return TrainerConfig(
        device="cpu",
        precision="float32",
        learning_rate=1e-2,
        micro_batch_size=2,
        num_threads=1,
        lora={"enabled": True, "rank": 4, "alpha": 8},
    )


def _rollouts(seed: int) -> list[Rollout]:
    return random_rollouts(seed, prompt_lengths=(2, 6), completion_lengths=(2, 6), spread=0.3, completion_first=True)


def _steps(trainer: Trainer, seeds: range) -> dict[str, torch.Tensor]:
    for seed in seeds:
        trainer.step(TrainBatch(rollouts=_rollouts(seed), step=seed))
    return {name: tensor.detach().cpu().clone() for name, tensor in trainer.named_weights()}


def _worker(rank: int, num_ranks: int, port: int, model_dir: Path, out_dir: Path) -> None:
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(num_ranks)})
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    from sharpen.trainer.backends.fsdp2 import FSDP2Backend
    from sharpen.trainer.backends.mesh import init_distributed

    init_distributed("gloo")
    trainer = Trainer(
        _config(), backend=FSDP2Backend(_config(), model_path=model_dir, dtype="float32"), pad_token_id=PAD
    )
    trainable = sorted(n for n, p in trainer.backend.model.named_parameters() if p.requires_grad)  # pyright: ignore[reportAttributeAccessIssue]
    _steps(trainer, range(1))
    trainer.save_checkpoint(out_dir / "checkpoint")
    continued = _steps(trainer, range(1, 3))
    trainer.export(out_dir / "export")
    resumed = Trainer(
        _config(), backend=FSDP2Backend(_config(), model_path=model_dir, dtype="float32"), pad_token_id=PAD
    )
    resumed.load_checkpoint(out_dir / "checkpoint")
    resumed_weights = _steps(resumed, range(1, 3))
    if rank == 0:
        torch.save({"trainable": trainable, "continued": continued, "resumed": resumed_weights}, out_dir / "r.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_lora_on_2_fsdp2_ranks_matches_one_device(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    args = (NUM_RANKS, _free_port(), model_dir, tmp_path)
    mp.start_processes(_worker, args=args, nprocs=NUM_RANKS, join=True, start_method="fork")
    results = torch.load(tmp_path / "r.pt")
    assert results["trainable"] and all(".lora_" in name for name in results["trainable"])
    torch.manual_seed(0)  # what FSDP2Backend does before loading: the adapters' random A start the same
    single = single_device_trainer(_config(), model_dir)
    expected = _steps(single, range(3))
    assert set(results["continued"]) == set(expected) and len(expected) == 2 * 7
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    for name, tensor in expected.items():
        assert (tensor - base[name]).abs().max() > 1e-5, name  # the adapters moved the merged weight
        torch.testing.assert_close(results["continued"][name], tensor, rtol=1e-4, atol=1e-6)
        assert torch.equal(results["resumed"][name], results["continued"][name]), name
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).state_dict()
    for name, tensor in results["continued"].items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0)
    assert (tmp_path / "export" / "adapter" / "adapter.safetensors").is_file()
