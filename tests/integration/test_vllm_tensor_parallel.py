"""A tensor-parallel vLLM engine (two workers on the CPU build, one core each) takes every weight sync into both
workers: the bucketed shared-memory sync and the broadcast into the weight group, where each worker is a rank of
its own. A random Llama with head_dim 64 (the CPU attention kernels' smallest) and 4 heads, so 2 ranks split it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sharpen.config.engines import VllmEngineConfig
from sharpen.config.schema import TrainerConfig
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.testing import save_tiny_llama
from sharpen.trainer import SingleDeviceBackend, Trainer

pytestmark = pytest.mark.slow

TOLERANCE = 1e-3
PROBE = [1, 504, 3458, 282, 4193, 314, 260, 2451, 30]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tp-llama"), tokenizer_from=smollm2_path, hidden_size=256)


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator:
    from sharpen.rollout.engines.vllm import VllmEngine

    config = VllmEngineConfig(tensor_parallel_size=2, max_model_len=256)
    engine = VllmEngine(config, model_path=model_path, dtype="float32", seed=0, bucket_bytes=8 << 20)
    yield engine
    engine.close()


@pytest.fixture
def trainer(model_path: Path) -> Trainer:
    config = TrainerConfig(micro_batch_size=4, num_threads=1, precision="float32")  # compared with float32 vLLM
    backend = SingleDeviceBackend(config, model_path=model_path, dtype="float32")
    trainer = Trainer(config, backend=backend, pad_token_id=2)
    with torch.no_grad():  # weights the engine does not hold yet
        for parameter in trainer.backend.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    return trainer


def mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def test_a_bucketed_sync_reaches_both_tensor_parallel_workers(engine, trainer: Trainer) -> None:
    assert engine.num_weight_group_members == 2
    assert mean_abs(engine.score(PROBE), trainer.compute_logprobs(PROBE)) > 10 * TOLERANCE
    metrics = WeightSync(probe_ids=PROBE, tolerance=TOLERANCE, verify=True)(trainer, engine, version=1)
    assert metrics["sync/num_buckets"] >= 2 and metrics["sync/probe_mismatch_mean"] < TOLERANCE
    assert engine.policy_version == 1


def test_a_broadcast_lands_in_both_tensor_parallel_workers(engine, trainer: Trainer) -> None:
    from sharpen.rollout.weight_sync.broadcast import open_weight_group, send_weights

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    opened: dict[str, object] = {}
    address = {"master_addr": "127.0.0.1", "master_port": port}
    opening = threading.Thread(target=lambda: opened.update(group=open_weight_group(rank=0, world_size=3, **address)))
    opening.start()
    engine.join_weight_group(**address, first_rank=1, world_size=3, backend="gloo")  # ranks 1 and 2
    opening.join(timeout=60)
    sent: dict[str, object] = {}
    sender = threading.Thread(
        target=lambda: sent.update(
            metrics=send_weights(opened["group"], trainer.named_weights(), version=2, bucket_bytes=8 << 20)
        )
    )
    sender.start()
    metrics = engine.receive_broadcast(version=2)
    sender.join(timeout=120)
    assert metrics["sync/num_workers"] == 2 and engine.policy_version == 2
    assert sent["metrics"]["sync/num_buckets"] >= 2
    assert mean_abs(engine.score(PROBE), trainer.compute_logprobs(PROBE)) < TOLERANCE
