"""The Ray runtime runs the same loop as the embedded one: same metrics at a fixed seed, verified weight sync
between actors, and one clear error when an actor hangs or dies."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_tiny_loop import stable, tiny_config, vowel_reward

from sharpen.config.runtime import RuntimeConfig
from sharpen.monitoring import read_jsonl
from sharpen.orchestration.runtime import run
from sharpen.types import Completion, SamplingParams

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RAY_RUNTIME = RuntimeConfig(type="ray", trainer_cpus=0.5, engine_cpus=0.5, call_timeout_s=120)


@pytest.fixture(scope="module", autouse=True)
def ray_instance() -> Iterator[None]:
    """One local Ray instance for the module, two CPUs; the actors take half a CPU each so nothing starves."""
    saved = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "PYTHONPATH")}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Ray workers do not inherit pytest's sys.path; the fake engine below must be importable in its actor.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), saved["PYTHONPATH"]) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


class SleepyEngine:
    """An engine actor that never finishes a generate: the stand-in for a hung vLLM."""

    def get_policy_version(self) -> int:
        return 0

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        time.sleep(60)
        return []


def wait_for_free_cpus(expected: float) -> float:
    """Ray frees a killed actor's CPUs asynchronously."""
    deadline = time.monotonic() + 10
    while (free := ray.available_resources().get("CPU", 0.0)) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


def test_ray_runtime_gives_the_local_metrics_and_verifies_every_sync(tiny_model_path: Path, tmp_path: Path) -> None:
    # One torch thread in both runs: the actors get OMP_NUM_THREADS=1 from Ray, and a different thread count in the
    # driver would change float summation order (differences of ~1e-8 seen in the loss).
    threads = {"trainer.num_threads": "1"}
    previous_threads = torch.get_num_threads()
    try:
        local = run(
            tiny_config(tiny_model_path, tmp_path, name="local", num_steps=3, **threads), reward_fn=vowel_reward
        )
    finally:
        torch.set_num_threads(previous_threads)  # the local run set it for this whole process
    remote = run(
        tiny_config(tiny_model_path, tmp_path, name="ray", num_steps=3, **threads),
        runtime=RAY_RUNTIME,
        reward_fn=vowel_reward,
    )

    local_rows, ray_rows = read_jsonl(local / "metrics.jsonl"), read_jsonl(remote / "metrics.jsonl")
    assert [row["step"] for row in ray_rows] == [0, 1, 2]
    # Same seed, same builders, same arithmetic (one thread everywhere): bit-identical outside timings.
    assert stable(ray_rows) == stable(local_rows)
    for row in ray_rows:
        assert row["sync/probe_mismatch_mean"] < 1e-4  # the engine actor holds the trainer actor's weights
        assert row["sync/put_seconds"] >= 0.0  # the weights went through the object store
    assert ray_rows[-1]["sync/probe_trainer_delta"] > 1e-4  # the weights moved and the engine followed
    assert (remote / "config.toml").is_file()
    assert (remote / "checkpoints").is_dir()
    assert wait_for_free_cpus(2.0) == 2.0  # both actors are gone; Ray itself belongs to the fixture


def test_a_hung_or_dead_actor_stops_the_run_with_one_clear_error() -> None:
    from sharpen.orchestration.ray.proxies import ActorCallError, EngineProxy

    actor = ray.remote(SleepyEngine).options(num_cpus=0.25).remote()
    engine = EngineProxy(actor, name="engine", timeout_s=1, start_timeout_s=60)
    prompt, params = [[1, 2, 3]], [SamplingParams(max_new_tokens=4)]

    started = time.monotonic()
    with pytest.raises(ActorCallError, match=r"ray actor 'engine' did not answer generate\(\) within 1 s"):
        engine.generate(prompt, params)
    assert time.monotonic() - started < 10

    engine.kill()
    with pytest.raises(ActorCallError, match=r"ray actor 'engine' died during generate\(\): "):
        engine.generate(prompt, params)
    assert wait_for_free_cpus(2.0) == 2.0
