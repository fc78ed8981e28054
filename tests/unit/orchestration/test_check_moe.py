"""`check_moe`: routing replay or load balancing that cannot run is one line before anything starts (a dense
model, R3 with an engine that returns no routes (vLLM's CPU build, SGLang), an expert bias the routers lack,
context and pipeline parallelism together); what can run passes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sharpen.config import ConfigError
from sharpen.config.schema import SharpenConfig
from sharpen.orchestration.build import check_moe


def _config(
    model: Path,
    replay: str,
    *,
    engine: str | dict = "hf",
    runtime: dict | None = None,
    moe: dict | None = None,
    lora: bool = False,
    **parallel: int,
) -> SharpenConfig:
    return SharpenConfig.model_validate(
        {
            "model": {"path": str(model)},
            "rollout": {"engine": {"type": engine} if isinstance(engine, str) else engine},
            "trainer": {
                "moe": {"routing_replay": replay, **(moe or {})},
                "parallel": parallel,
                "lora": {"enabled": lora},
            },
            "runtime": {"trainer_ranks": math.prod(parallel.values()) if parallel else 1, **(runtime or {})},
        }
    )


def test_routing_replay_that_cannot_run_is_one_line(tiny_moe_path: Path, tiny_model_path: Path):
    with pytest.raises(ConfigError, match=r'routing_replay = "r2" needs a Mixture-of-Experts model; .* \(llama\)'):
        check_moe(_config(tiny_model_path, "r2"))
    if not torch.cuda.is_available():  # vLLM's CPU build cannot return routes; on a GPU it can
        with pytest.raises(ConfigError, match=r'"r3" replays .* "vllm" would run on vLLM\'s CPU build, which cannot'):
            check_moe(_config(tiny_moe_path, "r3", engine="vllm"))
        with pytest.raises(ConfigError, match=r'"vllm_server" would run on vLLM\'s CPU build'):
            check_moe(_config(tiny_moe_path, "r3", engine="vllm_server"))
    check_moe(_config(tiny_moe_path, "r3", engine="vllm", runtime={"type": "ray", "engine_gpus": 1}))
    check_moe(_config(tiny_moe_path, "r3", engine={"type": "vllm_server", "url": "http://10.0.0.5:8000"}))
    with pytest.raises(
        ConfigError, match=r'"r3" replays the engine\'s routes, and rollout.engine.type = "sglang" returns'
    ):
        check_moe(_config(tiny_moe_path, "r3", engine="sglang"))
    check_moe(_config(tiny_moe_path, "r2", tp=2))  # tensor parallelism replays too
    check_moe(_config(tiny_moe_path, "r3"))
    check_moe(_config(tiny_moe_path, "r2", engine="vllm"))
    check_moe(_config(tiny_moe_path, "r3", cp=2))  # context parallelism replays too, and a pipeline
    check_moe(_config(tiny_moe_path, "r3", pp=2))
    with pytest.raises(ConfigError, match=r"with context or pipeline parallelism, not both yet \(.* cp = 2, pp = 2\)"):
        check_moe(_config(tiny_moe_path, "r3", cp=2, pp=2))
    check_moe(_config(tiny_model_path, "none"))  # a dense model takes the default


def test_load_balancing_that_cannot_run_is_one_line(tiny_moe_path: Path, tiny_model_path: Path, tmp_path: Path):
    from support.tiny_moe import tiny_moe

    deepseek = tmp_path / "deepseek"
    tiny_moe("deepseek_v3").config.save_pretrained(deepseek)  # check_moe reads config.json alone
    with pytest.raises(ConfigError, match=r"aux_loss_coef = 0.01 needs a Mixture-of-Experts model; .* \(llama\)"):
        check_moe(_config(tiny_model_path, "none", moe={"aux_loss_coef": 0.01}))
    with pytest.raises(ConfigError, match=r"expert_bias_update_rate moves DeepSeek-V3's expert bias; mixtral routers"):
        check_moe(_config(tiny_moe_path, "none", moe={"expert_bias_update_rate": 0.001}))
    with pytest.raises(ConfigError, match=r"expert_bias_update_rate with trainer.lora: the bias is not an adapter"):
        check_moe(_config(deepseek, "none", moe={"expert_bias_update_rate": 0.001}, lora=True))
    check_moe(_config(tiny_moe_path, "none", moe={"aux_loss_coef": 0.01}, pp=2))  # each stage adds its layers'
    check_moe(_config(tiny_moe_path, "none", moe={"aux_loss_coef": 0.01}))
    check_moe(_config(deepseek, "r2", moe={"expert_bias_update_rate": 0.001}))
