"""Placement of the Ray runtime's actors: a bundle per trainer rank and per engine replica, or, colocated, one
bundle per (trainer rank, engine replica) pair holding both actors' resources."""

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
