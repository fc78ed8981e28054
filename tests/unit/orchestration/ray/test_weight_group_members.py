"""Ranks of the broadcast weight group: rank 0 is the trainer's sender; an engine whose workers join the group
themselves (vLLM) takes one rank per worker, any other engine's actor one rank. (The join itself, over gloo between
real actors and into a real vLLM worker, is tested in tests/integration/test_ray_runtime.py and test_vllm_sync.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("ray")


def test_each_engine_starts_after_the_ranks_of_the_engines_before_it() -> None:
    from sharpen.orchestration.ray.proxies import weight_group_ranks

    assert weight_group_ranks([2, 1, 2]) == (6, [1, 3, 4])  # vLLM with 2 workers, an hf engine, vLLM again
    assert weight_group_ranks([1]) == (2, [1])
    assert weight_group_ranks([4, 4]) == (9, [1, 5])
