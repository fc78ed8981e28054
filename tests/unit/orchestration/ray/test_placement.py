"""Placement of the Ray runtime's actors: a bundle per trainer rank and per engine replica, or, colocated, one
bundle per (trainer rank, engine replica) pair holding both actors' resources; with tensor parallelism, one bundle
(one node) per tensor-parallel group."""

from __future__ import annotations

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
