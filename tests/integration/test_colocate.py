"""Colocated training and inference (runtime.colocate): the engine sleeps while the trainer steps and wakes for the
weight sync, the run trains exactly as without it, in one process and with the trainer and engine actors sharing
one Ray placement bundle."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tiny_loop import run_in_this_process, stable, tiny_config, vowel_reward

from sharpen.monitoring import read_jsonl, read_timeline
from sharpen.orchestration.runtime import run

pytestmark = pytest.mark.slow

# Evaluation and the parity probe every other step: both use the engine after the wake and sync of that step.
OPTIONS = {
    "trainer.num_threads": "1",
    "evaluation.every_steps": "2",
    "evaluation.num_tasks": "2",
    "evaluation.num_samples": "2",
    "evaluation.ks": "[1, 2]",
    "monitoring.parity_probe_every": "2",
}


def without_colocation(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("colocate/")} for row in stable(rows)]


def tiny_parameter_bytes(path: Path) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_colocated_run_sleeps_through_every_step_and_trains_like_a_plain_one(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    plain = run_in_this_process(tiny_config(tiny_model_path, tmp_path, name="plain", num_steps=3, **OPTIONS))
    colocated = run_in_this_process(
        tiny_config(tiny_model_path, tmp_path, name="colocated", num_steps=3, **OPTIONS, **{"runtime.colocate": "true"})
    )
    plain_rows, rows = read_jsonl(plain / "metrics.jsonl"), read_jsonl(colocated / "metrics.jsonl")
    assert without_colocation(rows) == without_colocation(plain_rows)
    freed = tiny_parameter_bytes(tiny_model_path)
    for row in rows:
        assert row["colocate/freed_bytes"] == freed  # every parameter of the engine's copy, every step
        assert row["sync/probe_mismatch_mean"] < 1e-4  # woken, reloaded in full and verified
        assert row["time/sleep"] >= 0.0 and row["time/wake"] >= 0.0
    assert "eval/num_abstained" in rows[1] and rows[1]["parity/num_tokens"] > 0  # after the wake of step 1
    assert rows[1]["parity/max_abs_diff"] < 1e-4
    assert_asleep_while_training(colocated / "timeline.json", num_steps=3)


def assert_asleep_while_training(path: Path, *, num_steps: int) -> None:
    """Each step: sleep ends before train starts, and the wake lies inside the sync after train."""
    spans = sorted((e for e in read_timeline(path) if e.get("ph") == "X" and e.get("cat") == "phase"), key=_start)
    names = [e["name"] for e in spans if e["name"] in {"sleep", "train", "wake", "sync"}]
    assert names.count("sleep") == names.count("train") == names.count("wake") == num_steps
    by_name = {name: [e for e in spans if e["name"] == name] for name in ("sleep", "train", "wake", "sync")}
    syncs = by_name["sync"][-num_steps:]  # the first sync is the start-up one, before step 0
    for sleep, train, wake, sync in zip(by_name["sleep"], by_name["train"], by_name["wake"], syncs, strict=True):
        assert sleep["ts"] + sleep["dur"] <= train["ts"]
        assert train["ts"] + train["dur"] <= wake["ts"]
        assert sync["ts"] <= wake["ts"] and wake["ts"] + wake["dur"] <= sync["ts"] + sync["dur"]


def _start(event: dict) -> float:
    return event["ts"]


@pytest.mark.ray
@pytest.mark.usefixtures("ray_instance")
def test_colocated_ray_actors_share_a_bundle_and_train_like_the_embedded_runtime(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    pytest.importorskip("ray")
    from test_ray_runtime import RAY_RUNTIME, wait_for_free_cpus

    colocate = {**OPTIONS, "runtime.colocate": "true"}
    local = run_in_this_process(tiny_config(tiny_model_path, tmp_path, name="local", num_steps=3, **colocate))
    remote = run(
        tiny_config(tiny_model_path, tmp_path, name="ray", num_steps=3, **colocate),
        runtime=RAY_RUNTIME.model_copy(update={"colocate": True}),
        reward_fn=vowel_reward,
    )
    local_rows, ray_rows = read_jsonl(local / "metrics.jsonl"), read_jsonl(remote / "metrics.jsonl")

    def comparable(rows: list[dict]) -> list[dict]:  # the object store adds its own sync metrics
        return [{k: v for k, v in row.items() if k != "sync/put_seconds"} for row in stable(rows)]

    assert comparable(ray_rows) == comparable(local_rows)
    assert all(row["colocate/freed_bytes"] == tiny_parameter_bytes(tiny_model_path) for row in ray_rows)
    assert wait_for_free_cpus(2.0) == 2.0
