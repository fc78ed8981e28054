"""A Mixture-of-Experts policy under pipeline parallelism trains like one process (the real `Trainer`, two steps of
two mini-batches: every metric and the weights): without routing replay (pp 2, 1F1B) on a tiny random model of each
router family, and with the engine's routes replayed (R3) on an interleaved pipeline (pp 2, 2 stages a rank, a
4-layer Mixtral), on a DeepSeek-V3 whose first layer is dense (so a stage's MoE layers are not its decoder
layers' numbers) and with activation checkpointing (the backward's recomputation replays its forward's routes); and
with the load-balancing loss, which each stage adds for its own layers. Tensor parallelism of an MoE:
test_moe_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.trainer.backends import SingleDeviceBackend
from sharpen.trainer.layout import ParallelLayout
from support.parity import PAD, VOCAB, assert_trainer_matches, trainer_config, trainer_steps
from support.ranks import join_process_group, launch_ranks
from support.tiny_moe import FAMILIES, decisive_routers, replayed_steps, tiny_moe

REPLAYED = {  # name: family, config overrides, layout, MoE layers
    "mixtral, interleaved": (
        "mixtral",
        {"num_hidden_layers": 4},
        ParallelLayout(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2),
        4,
    ),
    "deepseek_v3, a dense first layer": (
        "deepseek_v3",
        {"num_hidden_layers": 3, "first_k_dense_replace": 1},
        ParallelLayout(pp=2),
        2,
    ),
    # activation checkpointing: the backward recomputes a layer while the schedule replays another micro-batch's
    # routes; the recomputation must replay the routes of its own forward (expert_routes.checkpoint_contexts)
    "mixtral, gradient checkpointing": ("mixtral", {}, ParallelLayout(pp=2), 2),
}
OPTIONS = {"mixtral, gradient checkpointing": {"gradient_checkpointing": True}}
BALANCED = {  # name: model, layout: the load-balancing loss, each stage adding its own layers' share
    "qwen3_moe, balancing loss": ("qwen3_moe", ParallelLayout(pp=2)),
    "mixtral, balancing loss": ("mixtral", ParallelLayout(pp=2)),
}
BALANCE = {"moe": {"aux_loss_coef": 0.5}}  # large enough to move the routers visibly in two steps

pytestmark = pytest.mark.slow  # forks 2 ranks


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("moe_layouts")
    for family in FAMILIES:
        tiny_moe(family, vocab_size=VOCAB, pad_token_id=PAD).save_pretrained(folder / family)
    for name, (family, overrides, _, _) in REPLAYED.items():
        model = tiny_moe(family, vocab_size=VOCAB, pad_token_id=PAD, **overrides)
        decisive_routers(model)
        model.save_pretrained(folder / name)
    return {name: folder / name for name in (*FAMILIES, *REPLAYED)}


def _worker(rank: int, num_ranks: int, port: int, models: dict[str, Path], out: Path) -> None:
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    results = {}
    for family in FAMILIES:
        backend = FSDP2Backend(
            trainer_config(), model_path=models[family], dtype="float32", layout=ParallelLayout(pp=2)
        )
        results[family] = trainer_steps(backend)
    for name, (_, _, layout, num_layers) in REPLAYED.items():
        backend = FSDP2Backend(_r3_config(name), model_path=models[name], dtype="float32", layout=layout)
        results[name] = replayed_steps(backend, num_layers)
    for name, (model, layout) in BALANCED.items():
        backend = FSDP2Backend(trainer_config(**BALANCE), model_path=models[model], dtype="float32", layout=layout)
        results[name] = trainer_steps(backend)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def pp2(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("moe_pp2") / "results.pt"
    launch_ranks(_worker, 2, models, out)
    return torch.load(out)


def _r3_config(name: str):
    return trainer_config(moe={"routing_replay": "r3"}, **OPTIONS.get(name, {}))


def _assert_matches(got: tuple, expected: tuple) -> None:
    """`assert_trainer_matches`, but a pipeline measures no balancing loss (the routers' probabilities stay on their
    stages), and an all-zero weight is compared exactly."""
    got_metrics, got_weights = got
    metrics, weights = expected
    assert all("moe/train_aux_loss" not in step for step in got_metrics)
    metrics = [{k: v for k, v in step.items() if k != "moe/train_aux_loss"} for step in metrics]
    for name in [name for name, tensor in weights.items() if not tensor.any()]:  # DeepSeek-V3's frozen expert bias
        assert torch.equal(got_weights.pop(name), weights.pop(name)), name
    assert_trainer_matches((got_metrics, got_weights), (metrics, weights))


@pytest.mark.parametrize("family", FAMILIES)
def test_an_moe_trains_on_a_pipeline_like_one_process(pp2: dict, models: dict[str, Path], family: str):
    one = trainer_steps(SingleDeviceBackend(trainer_config(), model_path=models[family], dtype="float32"))
    _assert_matches(pp2[family], one)
    assert "moe/train_load_max_over_mean" in pp2[family][0][0]  # the stages' routes, gathered


@pytest.mark.parametrize("name", list(REPLAYED))
def test_a_pipeline_replays_the_engine_routes_like_one_process(pp2: dict, models: dict[str, Path], name: str):
    num_layers = REPLAYED[name][3]
    one = replayed_steps(SingleDeviceBackend(_r3_config(name), model_path=models[name], dtype="float32"), num_layers)
    assert one[0][0]["moe/engine_disagreement"] > 0.1  # the replayed routes are not the routers' own
    assert f"moe/engine_disagreement/layer_{num_layers - 1:03d}" in one[0][0]
    _assert_matches(pp2[name], one)


@pytest.mark.parametrize("name", list(BALANCED))
def test_a_pipeline_adds_the_balancing_loss_like_one_process(pp2: dict, models: dict[str, Path], name: str):
    model = models[BALANCED[name][0]]
    one = trainer_steps(SingleDeviceBackend(trainer_config(**BALANCE), model_path=model, dtype="float32"))
    without = trainer_steps(SingleDeviceBackend(trainer_config(), model_path=model, dtype="float32"))
    assert one[0][0]["moe/train_aux_loss"] > 0
    routers = [key for key in one[1] if key.endswith(".gate.weight")]
    assert any(not torch.allclose(one[1][key], without[1][key], atol=1e-4) for key in routers)  # the loss acts
    _assert_matches(pp2[name], one)
