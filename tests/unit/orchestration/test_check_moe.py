"""`check_moe`: routing replay that cannot run is one line before anything starts (a dense model, R3 with an
engine that returns no routes, a trainer layout other than data parallelism); what can run passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharpen.config import ConfigError
from sharpen.config.schema import SharpenConfig
from sharpen.orchestration.build import check_moe


def _config(model: Path, replay: str, *, engine: str = "hf", **parallel: int) -> SharpenConfig:
    return SharpenConfig.model_validate(
        {
            "model": {"path": str(model)},
            "rollout": {"engine": {"type": engine}},
            "trainer": {"moe": {"routing_replay": replay}, "parallel": parallel},
            "runtime": {"trainer_ranks": 2 if parallel else 1},
        }
    )


def test_routing_replay_that_cannot_run_is_one_line(tiny_moe_path: Path, tiny_model_path: Path):
    with pytest.raises(ConfigError, match=r'routing_replay = "r2" needs a Mixture-of-Experts model; .* \(llama\)'):
        check_moe(_config(tiny_model_path, "r2"))
    with pytest.raises(ConfigError, match=r'"r3" replays the engine\'s routes, and rollout.engine.type = "vllm"'):
        check_moe(_config(tiny_moe_path, "r3", engine="vllm"))
    with pytest.raises(ConfigError, match=r"data parallelism only yet, not trainer\.parallel tp = 2"):
        check_moe(_config(tiny_moe_path, "r2", tp=2))
    check_moe(_config(tiny_moe_path, "r3"))
    check_moe(_config(tiny_moe_path, "r2", engine="vllm"))
    check_moe(_config(tiny_model_path, "none"))  # a dense model takes the default
