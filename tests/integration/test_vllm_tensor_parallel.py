"""A tensor-parallel vLLM engine (two workers on the CPU build, one core each) takes every weight sync into both
workers: the bucketed shared-memory sync and the broadcast into the weight group, where each worker is a rank of
its own. A random Llama with head_dim 64 (the CPU attention kernels' smallest) and 4 heads, so 2 ranks split it.

Weight sync from a sharded trainer, by both paths, into engines of TP 1 and 2: trainer ranks (gloo, forked before
this module's engines start) of the layouts tp2, pp2 and tp2 x dp_shard2 hold a changed copy of the model; the
golden path (`named_weights`: the ranks gather, rank 0 has whole tensors) and the direct path (`weight_shards`: each
rank's pieces, put together by `assemble_weights`) must both give the weights on disk, bit for bit, and each engine
loading either must then score the probe identically, and as the trainer does."""

from __future__ import annotations

import itertools
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
from sharpen.trainer.layout import ParallelLayout
from sharpen.weight_shards import assemble_weights
from support.ranks import join_process_group, launch_ranks

pytestmark = pytest.mark.slow
_versions = itertools.count(100)  # every load in this module a new policy version

TOLERANCE = 1e-3
PROBE = [1, 504, 3458, 282, 4193, 314, 260, 2451, 30]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tp-llama"), tokenizer_from=smollm2_path, hidden_size=256)


@pytest.fixture(scope="module")
def trained_path(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    """The model with every weight changed (seeded): what the trainer ranks hold and the engines do not."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    folder = tmp_path_factory.mktemp("tp-llama-trained")
    model.save_pretrained(folder)
    return folder


LAYOUTS = {
    2: {"tp2": ParallelLayout(tp=2), "pp2": ParallelLayout(pp=2)},
    4: {"tp2 x dp_shard2": ParallelLayout(tp=2, dp_shard=2)},
}


def _layout_worker(rank: int, num_ranks: int, port: int, model: Path, out_dir: Path) -> None:
    """Each layout of `num_ranks` ranks in turn: the golden path's whole tensors (rank 0's) and this rank's
    pieces."""
    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    for index, layout in enumerate(LAYOUTS[num_ranks].values()):
        config = TrainerConfig(device="cpu", precision="float32", num_threads=1, micro_batch_size=4)
        backend = FSDP2Backend(config, model_path=model, dtype="float32", layout=layout)
        golden = {name: tensor.detach().cpu().clone() for name, tensor in backend.named_weights()}  # collective
        result = {"golden": golden if rank == 0 else None, "pieces": backend.weight_shards()}
        torch.save(result, out_dir / f"{num_ranks}-{index}-{rank}.pt")
        del backend


@pytest.fixture(scope="module")
def layout_weights(tmp_path_factory: pytest.TempPathFactory, trained_path: Path) -> dict[str, dict]:
    """Per layout: the golden whole tensors and every rank's pieces."""
    out_dir = tmp_path_factory.mktemp("layout-weights")
    results = {}
    for num_ranks, layouts in LAYOUTS.items():
        launch_ranks(_layout_worker, num_ranks, trained_path, out_dir)
        for index, name in enumerate(layouts):
            ranks = [
                torch.load(out_dir / f"{num_ranks}-{index}-{rank}.pt", weights_only=False) for rank in range(num_ranks)
            ]
            results[name] = {"golden": ranks[0]["golden"], "pieces": [p for r in ranks for p in r["pieces"]]}
    return results


@pytest.fixture(scope="module")
def engine(model_path: Path, layout_weights: dict) -> Iterator:
    """Started after the trainer ranks (``layout_weights``) were forked and gone."""
    from sharpen.rollout.engines.vllm import VllmEngine

    config = VllmEngineConfig(tensor_parallel_size=2, max_model_len=256)
    engine = VllmEngine(config, model_path=model_path, dtype="float32", seed=0, bucket_bytes=8 << 20)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def engine_tp1(model_path: Path, layout_weights: dict) -> Iterator:
    from sharpen.rollout.engines.vllm import VllmEngine

    engine = VllmEngine(VllmEngineConfig(max_model_len=256), model_path=model_path, dtype="float32", seed=0)
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


@pytest.mark.parametrize("layout", [name for layouts in LAYOUTS.values() for name in layouts])
def test_both_paths_give_the_weights_on_disk_from_every_layout(layout: str, layout_weights: dict, trained_path) -> None:
    from safetensors.torch import load_file

    on_disk = load_file(str(trained_path / "model.safetensors"))
    on_disk.pop("lm_head.weight", None)  # tied: the engine ties the head to the embedding
    golden = layout_weights[layout]["golden"]
    pieces = layout_weights[layout]["pieces"]
    direct = dict(assemble_weights(pieces))
    assert list(direct) == list(golden)  # the same weights, in the same (HF) order
    assert set(direct) == set(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(golden[name], tensor), name
        assert torch.equal(direct[name], tensor), name
    # the pieces really are pieces: a column-parallel projection of a layer comes in tp x dp_shard boxes, from the
    # ranks of its stage only
    query = [p for p in pieces if p.name == "model.layers.1.self_attn.q_proj.weight"]
    assert len(query) == {"tp2": 2, "pp2": 1, "tp2 x dp_shard2": 4}[layout]
    assert sum(p.tensor.numel() for p in pieces) == sum(t.numel() for t in on_disk.values())  # no replica twice


def _probe_after(engine, weights) -> list[float]:
    engine.load_weights(weights, version=next(_versions))
    return engine.score(PROBE)


@pytest.mark.parametrize("engine_tp", [1, 2])
def test_an_engine_of_tp_1_or_2_loads_both_paths_identically(
    engine_tp: int, request: pytest.FixtureRequest, layout_weights: dict, model_path: Path, trained_path: Path
) -> None:
    from safetensors.torch import load_file

    engine = request.getfixturevalue("engine_tp1" if engine_tp == 1 else "engine")
    original = load_file(str(model_path / "model.safetensors"))
    original.pop("lm_head.weight", None)
    config = TrainerConfig(micro_batch_size=4, num_threads=1, precision="float32")
    backend = SingleDeviceBackend(config, model_path=trained_path, dtype="float32")
    expected = Trainer(config, backend=backend, pad_token_id=2).compute_logprobs(PROBE)
    for layout, weights in layout_weights.items():
        before = _probe_after(engine, original.items())
        golden = _probe_after(engine, weights["golden"].items())
        _probe_after(engine, original.items())  # back to the start, so the direct path must change the engine too
        direct = _probe_after(engine, assemble_weights(weights["pieces"]))
        assert direct == golden, layout
        assert mean_abs(golden, before) > 10 * TOLERANCE, layout
        assert mean_abs(golden, expected) < TOLERANCE, layout
