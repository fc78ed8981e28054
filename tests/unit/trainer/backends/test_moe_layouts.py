"""A Mixture-of-Experts policy without routing replay under pipeline parallelism (pp 2, 1F1B) trains like one process
(the real `Trainer`, two steps: every metric but the ``moe/`` ones, which a pipeline does not measure, and the
weights), on a tiny random model of each router family; tensor parallelism refuses an MoE in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.trainer.backends import SingleDeviceBackend
from sharpen.trainer.layout import LayoutError, ParallelLayout
from support.parity import PAD, VOCAB, assert_trainer_matches, trainer_config, trainer_steps
from support.ranks import join_process_group, launch_ranks
from support.tiny_moe import FAMILIES, tiny_moe

pytestmark = pytest.mark.slow  # forks 2 ranks


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("moe_layouts")
    for family in FAMILIES:
        tiny_moe(family, vocab_size=VOCAB, pad_token_id=PAD).save_pretrained(folder / family)
    return {family: folder / family for family in FAMILIES}


def _worker(rank: int, num_ranks: int, port: int, models: dict[str, Path], out: Path) -> None:
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    results = {}
    for family, model in models.items():
        backend = FSDP2Backend(trainer_config(), model_path=model, dtype="float32", layout=ParallelLayout(pp=2))
        results[family] = trainer_steps(backend)
    try:
        FSDP2Backend(trainer_config(), model_path=models["mixtral"], dtype="float32", layout=ParallelLayout(tp=2))
    except LayoutError as error:
        results["tp2"] = str(error)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def pp2(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("moe_pp2") / "results.pt"
    launch_ranks(_worker, 2, models, out)
    return torch.load(out)


def _without_moe_metrics(steps: tuple) -> tuple:
    metrics, weights = steps
    return [{k: v for k, v in step.items() if not k.startswith("moe/")} for step in metrics], weights


@pytest.mark.parametrize("family", FAMILIES)
def test_an_moe_trains_on_a_pipeline_like_one_process(pp2: dict, models: dict[str, Path], family: str):
    one = trainer_steps(SingleDeviceBackend(trainer_config(), model_path=models[family], dtype="float32"))
    assert any(name.startswith("moe/") for name in one[0][0])  # one process measures the routes; a pipeline not
    assert not any(name.startswith("moe/") for name in pp2[family][0][0])
    got_metrics, got_weights = pp2[family]
    metrics, weights = _without_moe_metrics(one)
    for name in [name for name, tensor in weights.items() if not tensor.any()]:  # DeepSeek-V3's frozen expert bias
        assert torch.equal(got_weights.pop(name), weights.pop(name)), name
    assert_trainer_matches((got_metrics, got_weights), (metrics, weights))


def test_tensor_parallelism_refuses_an_moe_in_one_line(pp2: dict):
    assert "this model family cannot run with trainer.parallel.tp > 1" in pp2["tp2"]
