"""Placement of the Ray runtime's actors: a bundle per trainer rank and per engine replica, or, colocated, one
bundle per (trainer rank, engine replica) pair holding both actors' resources; with tensor parallelism, one bundle
(one node) per tensor-parallel group."""

from __future__ import annotations

import logging

import pytest

from sharpen.config.runtime import RuntimeConfig

pytest.importorskip("ray")


def test_disaggregated_actors_get_a_bundle_each() -> None:
    from sharpen.orchestration.ray.runtime import plan_placement

    runtime = RuntimeConfig(type="ray", trainer_ranks=2, trainer_gpus=1, engine_gpus=1, engine_cpus=2)
    plan = plan_placement(runtime, num_engines=3)
    assert plan.bundles == [{"CPU": 0.5, "GPU": 1}] * 2 + [{"CPU": 2, "GPU": 1}] * 3
    assert plan.trainer_bundles == [0, 1] and plan.engine_bundles == [2, 3, 4]


def test_colocated_pairs_share_a_bundle_with_both_actors_resources() -> None:
    from sharpen.orchestration.ray.runtime import plan_placement

    runtime = RuntimeConfig(type="ray", trainer_ranks=2, trainer_gpus=0.5, engine_gpus=0.5, colocate=True)
    plan = plan_placement(runtime, num_engines=2)
    assert plan.bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert plan.trainer_bundles == plan.engine_bundles == [0, 1]
    cpu_only = plan_placement(RuntimeConfig(type="ray", colocate=True, trainer_cpus=1, engine_cpus=0.5))
    assert cpu_only.bundles == [{"CPU": 1.5}]
    with pytest.raises(ValueError, match="one engine per trainer rank: 3 for 2"):
        plan_placement(runtime, num_engines=3)


def test_a_tensor_parallel_group_shares_one_bundle() -> None:
    """A bundle is placed on one node: tp 2 over 4 ranks makes 2 bundles of 2 ranks' resources."""
    from sharpen.orchestration.ray.runtime import plan_placement

    runtime = RuntimeConfig(type="ray", trainer_ranks=4, trainer_gpus=1, engine_gpus=1)
    plan = plan_placement(runtime, num_engines=1, node_group=2)
    assert plan.bundles == [{"CPU": 1.0, "GPU": 2}] * 2 + [{"CPU": 0.5, "GPU": 1}]
    assert plan.trainer_bundles == [0, 0, 1, 1] and plan.engine_bundles == [2]
    colocated = RuntimeConfig(type="ray", trainer_ranks=4, trainer_gpus=0.5, engine_gpus=0.5, colocate=True)
    plan = plan_placement(colocated, num_engines=4, node_group=2)
    assert plan.bundles == [{"CPU": 2.0, "GPU": 2.0}] * 2
    assert plan.trainer_bundles == plan.engine_bundles == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="4 trainer ranks do not split into groups of 3"):
        plan_placement(runtime, node_group=3)


def test_the_driver_refuses_a_layout_the_model_cannot_take(tmp_path) -> None:
    """Before Ray starts: a family without a tensor-parallel plan (GPT-2), then a Llama whose heads tp does not
    divide; each one line."""
    from transformers import GPT2Config, LlamaConfig

    from sharpen.config import load_config
    from sharpen.orchestration.trainer_layout import check_trainer_layout
    from sharpen.trainer.layout import LayoutError

    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained(tmp_path / "gpt2")
    LlamaConfig(hidden_size=24, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=2).save_pretrained(
        tmp_path / "llama"
    )

    def config(model: str, tp: int):
        overrides = ['runtime.type="ray"', "runtime.trainer_ranks=2", f"trainer.parallel.tp={tp}"]
        return load_config(None, [*overrides, f'model.path="{tmp_path / model}"'])

    with pytest.raises(LayoutError, match=r"^GPT2Config declares no tensor-parallel plan"):
        check_trainer_layout(config("gpt2", 2))
    with pytest.raises(LayoutError, match=r"attention heads \(3\) are not divisible by tp x cp"):
        check_trainer_layout(config("llama", 2))
    with pytest.raises(LayoutError, match=r"config.json has no num_attention_heads.*a gpt2"):
        check_trainer_layout(config("gpt2", 1))  # data shards alone: the shape check still reads the sizes


def test_the_driver_refuses_what_a_pipeline_does_not_run(tmp_path, caplog) -> None:
    """Before Ray starts: more stages than layers, a pipeline with context parallelism, with LoRA; each one line."""
    from transformers import LlamaConfig

    from sharpen.config import load_config
    from sharpen.orchestration.trainer_layout import check_trainer_layout
    from sharpen.trainer.layout import LayoutError

    LlamaConfig(hidden_size=24, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=2).save_pretrained(
        tmp_path / "llama"
    )

    def config(ranks: int, *overrides: str):
        base = ['runtime.type="ray"', f"runtime.trainer_ranks={ranks}", f'model.path="{tmp_path / "llama"}"']
        return load_config(None, [*base, *overrides])

    check_trainer_layout(config(2, "trainer.parallel.pp=2"))  # one layer a stage; 32 rows, micro-batches of 8: 4
    with caplog.at_level(logging.WARNING, logger="sharpen.orchestration.trainer_layout"):
        check_trainer_layout(config(2, "trainer.parallel.pp=2", "trainer.micro_batch_size=16"))
        assert not caplog.records
        check_trainer_layout(config(2, "trainer.parallel.pp=2", "trainer.micro_batch_size=32"))
    assert [r.getMessage()[:93] for r in caplog.records] == [
        "trainer.parallel: 1 micro-batches per mini-batch and data shard (trainer.micro_batch_size 32)"
    ]
    with pytest.raises(LayoutError, match=r"^4 pipeline stages \(pp 2 x 2 per rank\) for 2 layers"):
        schedule = 'trainer.parallel.pp_schedule="interleaved_1f1b"'
        check_trainer_layout(config(2, "trainer.parallel.pp=2", schedule, "trainer.parallel.pp_stages_per_rank=2"))
    with pytest.raises(LayoutError, match=r"^pipeline and context parallelism together \(pp 2 x cp 2\)"):
        check_trainer_layout(config(4, "trainer.parallel.pp=2", "trainer.parallel.cp=2"))
    with pytest.raises(LayoutError, match=r"^trainer.lora with pp > 1 is not supported"):
        check_trainer_layout(config(2, "trainer.parallel.pp=2", "trainer.lora.enabled=true"))
