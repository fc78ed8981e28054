"""Small scenarios for the simulator's tests, as plain dicts (what a TOML file parses into)."""

from __future__ import annotations

from typing import Any


def base_scenario(**changes: Any) -> dict[str, Any]:
    """One 1B model on H100s, 4 engines + 4 trainer GPUs, 8 x 4 episodes of 100 tokens, sync; `response`,
    `costs`, `rollout`, `cluster` update those parts."""
    data: dict[str, Any] = {
        "model": {"num_params": 1e9, "kv_bytes_per_token": 0.0},
        "cluster": {"gpu": "H100", "num_engine_gpus": 4, "num_trainer_gpus": 4},
        "workload": {
            "prompts_per_step": 8,
            "samples_per_prompt": 4,
            "prompt_tokens": {"median": 50},
            "response_tokens": {"median": 100},
        },
        "rollout": {"mode": "sync"},
        "costs": {},
        "simulation": {"num_steps": 10, "warmup_steps": 2, "seed": 0},
    }
    if "response" in changes:
        data["workload"]["response_tokens"] = changes.pop("response")
    for section, values in changes.items():
        data.setdefault(section, {}).update(values)
    return data
