"""The parallel layout, torch-free: its world size, each rank's coordinates and groups, and one clear line for
every way a layout can fail to fit the world, the model or the pipeline's micro-batches."""

from __future__ import annotations

import re

import pytest

from sharpen.trainer.layout import AXES, LayoutError, ModelShape, ParallelLayout

LLAMA_8B = ModelShape(
    num_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
)
SMOLLM2 = ModelShape.from_hf_config(
    {
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
    }
)


def _error(layout: ParallelLayout, **kwargs) -> str:
    with pytest.raises(LayoutError) as info:
        layout.check(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_world_is_the_product_of_the_axes():
    layout = ParallelLayout(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert layout.world_size == 32 and layout.sizes == (2, 2, 2, 2, 2)
    assert layout.describe() == "pp 2 x dp_replicate 2 x dp_shard 2 x cp 2 x tp 2"
    assert ParallelLayout().describe() == "single device"
    assert ParallelLayout.filling(64, tp=4, pp=2) == ParallelLayout(tp=4, pp=2, dp_shard=8)
    with pytest.raises(LayoutError, match=r"pp 1 x dp_replicate 1 x cp 1 x tp 3 = 3 ranks does not divide .* 8"):
        ParallelLayout.filling(8, tp=3)


def test_coordinates_are_row_major_with_tp_innermost():
    layout = ParallelLayout(pp=2, dp_shard=2, tp=2)  # ranks 0..7
    # rank = ((pp * 1 + dp_replicate) * 2 + dp_shard) * 1 + cp) * 2 + tp
    assert layout.coordinates(0) == dict.fromkeys(AXES, 0)
    assert layout.coordinates(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert layout.coordinates(6) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0}
    assert layout.group("tp", 5) == [4, 5]  # neighbours: the most traffic on the closest ranks
    assert layout.group("dp_shard", 5) == [5, 7]
    assert layout.group("pp", 5) == [1, 5]
    assert layout.group("cp", 5) == [5]
    with pytest.raises(LayoutError, match="rank 8 is outside the world of 8 ranks"):
        layout.coordinates(8)


@pytest.mark.parametrize("world_size", [8, 16, 64])
def test_every_rank_is_in_exactly_one_group_per_axis(world_size: int):
    layout = ParallelLayout.filling(world_size, tp=2, pp=2)
    for axis in AXES:
        groups = {tuple(layout.group(axis, rank)) for rank in range(world_size)}
        assert sorted(rank for group in groups for rank in group) == list(range(world_size))
        assert {len(group) for group in groups} == {getattr(layout, axis)}


def test_a_layout_that_fits_says_nothing():
    ParallelLayout(tp=8, pp=4, dp_shard=2).check(world_size=64, model=LLAMA_8B, num_micro_batches=8)
    ParallelLayout(tp=3, dp_shard=2).check(world_size=6, model=SMOLLM2)  # SmolLM2's 9 heads, 3 key/value heads


@pytest.mark.parametrize(
    ("layout", "kwargs", "message"),
    [
        (
            ParallelLayout(tp=2, dp_shard=3),
            {"world_size": 8},
            "pp 1 x dp_replicate 1 x dp_shard 3 x cp 1 x tp 2 = 6 ranks, but the trainer has 8",
        ),
        (
            ParallelLayout(tp=2),
            {"world_size": 2, "model": SMOLLM2},
            "the model's attention heads (9) are not divisible by tp x cp",
        ),
        (
            ParallelLayout(tp=3, cp=2),
            {"world_size": 6, "model": SMOLLM2},
            "the model's attention heads (9) are not divisible by tp x cp (Ulysses splits heads over cp) = 6",
        ),
        (
            ParallelLayout(tp=16),
            {"world_size": 16, "model": LLAMA_8B},
            "the model's key/value heads (8) are not divisible by tp = 16",
        ),
        (
            ParallelLayout(pp=8, pp_schedule="interleaved_1f1b", pp_stages_per_rank=5),
            {"world_size": 8, "model": LLAMA_8B},
            "40 pipeline stages (pp 8 x 5 per rank) for 32 layers",
        ),
        (
            ParallelLayout(pp=4),
            {"world_size": 4, "num_micro_batches": 2},
            "2 micro-batches per optimizer step for pp 4",
        ),
        (
            ParallelLayout(pp=4, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2),
            {"world_size": 4, "num_micro_batches": 6},
            "interleaved 1F1B needs a multiple of pp 4 micro-batches per step, got 6",
        ),
        (
            ParallelLayout(dp_shard=4, ep=2),
            {"world_size": 4, "model": LLAMA_8B},
            "ep 2 needs a Mixture-of-Experts model; this one is dense",
        ),
        (ParallelLayout(dp_shard=2, cp=2, ep=8), {"world_size": 4}, "ep 8 must divide dp_shard x cp = 4"),
    ],
)
def test_each_misfit_is_one_line_naming_it(layout: ParallelLayout, kwargs: dict, message: str):
    assert _error(layout, **kwargs).startswith(message)


def test_bad_sizes_are_refused_when_built():
    with pytest.raises(LayoutError, match="tp = 0: every axis needs a size of at least 1"):
        ParallelLayout(tp=0)
    with pytest.raises(LayoutError, match=re.escape('pp_stages_per_rank = 2 needs pp_schedule = "interleaved_1f1b"')):
        ParallelLayout(pp=2, pp_stages_per_rank=2)
    with pytest.raises(LayoutError, match=re.escape('"interleaved_1f1b" needs pp_stages_per_rank >= 2')):
        ParallelLayout(pp=2, pp_schedule="interleaved_1f1b")


def test_moe_shapes_come_from_each_familys_keys():
    base = {"num_hidden_layers": 4, "num_attention_heads": 8, "vocab_size": 1024, "hidden_size": 64}
    mixtral = ModelShape.from_hf_config({**base, "intermediate_size": 128, "num_local_experts": 8})
    qwen3_moe = ModelShape.from_hf_config(
        {**base, "intermediate_size": 256, "moe_intermediate_size": 32, "num_experts": 16, "num_key_value_heads": 2}
    )
    deepseek = ModelShape.from_hf_config({**base, "intermediate_size": 256, "n_routed_experts": 64})
    assert (mixtral.num_experts, mixtral.intermediate_size, mixtral.num_key_value_heads) == (8, 128, 8)
    assert (qwen3_moe.num_experts, qwen3_moe.intermediate_size, qwen3_moe.num_key_value_heads) == (16, 32, 2)
    assert deepseek.num_experts == 64
    ParallelLayout(dp_shard=8, ep=8).check(world_size=8, model=qwen3_moe)
    assert _error(ParallelLayout(dp_shard=6, ep=6), world_size=6, model=qwen3_moe) == (
        "the model's 16 experts are not divisible by ep 6"
    )


def test_an_axis_that_is_not_built_is_refused_in_one_line():
    ParallelLayout(tp=2, cp=2, dp_replicate=2).check_built()  # data, tensor and context parallelism run
    ParallelLayout(pp=2, tp=2).check_built()  # and pipeline parallelism
    ParallelLayout(dp_shard=4, ep=2).check_built()  # expert parallelism over the data ranks runs
    ParallelLayout(dp_shard=2, pp=2, ep=2).check_built()  # and with pipeline and context parallelism
    ParallelLayout(cp=2, ep=2).check_built()
    ParallelLayout(dp_shard=2, tp=2, ep=2).check_built()  # and with tensor parallelism
    with pytest.raises(
        LayoutError, match=r"^expert parallelism \(ep 2\) with both tensor \(tp 2\) and context \(cp 2\)"
    ):
        ParallelLayout(cp=2, tp=2, ep=2).check_built()
    with pytest.raises(LayoutError, match=r"^pipeline and context parallelism together \(pp 2 x cp 2\) are not built"):
        ParallelLayout(pp=2, cp=2).check_built()


def test_features_a_split_does_not_run_are_refused_in_one_line():
    ParallelLayout(dp_shard=4).check_features(lora=True, vision=True, distillation=True)  # FSDP2 alone runs them all
    ParallelLayout(tp=2).check_features(lora=False, vision=False, distillation=True)
    with pytest.raises(LayoutError, match=r"^trainer.lora with tp > 1 and cp > 1 is not supported"):
        ParallelLayout(tp=2, cp=2).check_features(lora=True, vision=False, distillation=False)
    with pytest.raises(LayoutError, match=r"a vision-language model needs tp = cp = pp = 1, not pp > 1$"):
        ParallelLayout(pp=2).check_features(lora=False, vision=True, distillation=False)
    with pytest.raises(LayoutError, match=r"^trainer.distillation with pipeline parallelism"):
        ParallelLayout(pp=2).check_features(lora=False, vision=False, distillation=True)
