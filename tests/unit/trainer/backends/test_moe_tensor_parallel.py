"""A Mixture-of-Experts policy under tensor parallelism trains like one process (the real `Trainer`, two steps of two
mini-batches: every metric and the weights, float32): tp 2 with sequence parallelism on a tiny random model of each
softmax router family (the experts split by output rows), without sequence parallelism, with the engine's routes
replayed (R3) on routers decisive enough that the replayed routes are not their own, and with the load-balancing
loss on. DeepSeek-V3, whose plan leaves its latent attention whole, is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.trainer.backends import SingleDeviceBackend
from sharpen.trainer.layout import LayoutError, ParallelLayout
from support.parity import PAD, VOCAB, assert_trainer_matches, trainer_config, trainer_steps
from support.ranks import join_process_group, launch_ranks
from support.tiny_moe import FAMILIES, decisive_routers, replayed_steps, tiny_moe

CASES = {  # name: model folder, trainer config overrides
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral, no sequence parallelism": ("mixtral", {"parallel": {"sequence_parallel": False}}),
    "qwen3_moe, balancing loss": ("qwen3_moe", {"moe": {"aux_loss_coef": 0.1}}),
}
REPLAYED = "mixtral, decisive routers"  # R3 on routers whose own choices differ from the replayed routes

pytestmark = pytest.mark.slow  # forks 2 ranks


def _config(overrides: dict):
    return trainer_config(**overrides)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("moe_tp")
    for family in FAMILIES:
        tiny_moe(family, vocab_size=VOCAB, pad_token_id=PAD).save_pretrained(folder / family)
    model = tiny_moe("mixtral", vocab_size=VOCAB, pad_token_id=PAD)
    decisive_routers(model)
    model.save_pretrained(folder / REPLAYED)
    return {name: folder / name for name in (*FAMILIES, REPLAYED)}


def _worker(rank: int, num_ranks: int, port: int, models: dict[str, Path], out: Path) -> None:
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    results = {}
    for name, (model, overrides) in CASES.items():
        backend = FSDP2Backend(
            _config(overrides), model_path=models[model], dtype="float32", layout=ParallelLayout(tp=2)
        )
        results[name] = trainer_steps(backend)
    r3 = trainer_config(moe={"routing_replay": "r3"})
    backend = FSDP2Backend(r3, model_path=models[REPLAYED], dtype="float32", layout=ParallelLayout(tp=2))
    results[REPLAYED] = replayed_steps(backend, 2)
    try:
        FSDP2Backend(trainer_config(), model_path=models["deepseek_v3"], dtype="float32", layout=ParallelLayout(tp=2))
    except LayoutError as error:
        results["deepseek_v3"] = str(error)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("moe_tp2") / "results.pt"
    launch_ranks(_worker, 2, models, out)
    return torch.load(out)


@pytest.mark.parametrize("name", list(CASES))
def test_an_moe_trains_with_tensor_parallelism_like_one_process(tp2: dict, models: dict[str, Path], name: str):
    model, overrides = CASES[name]
    one = trainer_steps(SingleDeviceBackend(_config(overrides), model_path=models[model], dtype="float32"))
    assert "moe/train_load_max_over_mean" in one[0][0]
    if "aux_loss_coef" in overrides.get("moe", {}):
        assert one[0][0]["moe/train_aux_loss"] > 0
    assert_trainer_matches(tp2[name], one)


def test_tensor_parallelism_replays_the_engine_routes_like_one_process(tp2: dict, models: dict[str, Path]):
    r3 = trainer_config(moe={"routing_replay": "r3"})
    one = replayed_steps(SingleDeviceBackend(r3, model_path=models[REPLAYED], dtype="float32"), 2)
    assert one[0][0]["moe/engine_disagreement"] > 0.1  # the replayed routes are not the routers' own
    assert_trainer_matches(tp2[REPLAYED], one)


def test_a_model_whose_plan_leaves_its_attention_whole_is_refused_in_one_line(tp2: dict):
    assert tp2["deepseek_v3"] == (
        "DeepseekV3Config's tensor-parallel plan does not split its attention: this model family cannot run with "
        "trainer.parallel.tp > 1"
    )
