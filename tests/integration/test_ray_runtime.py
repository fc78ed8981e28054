"""The Ray runtime runs the same loop as the embedded one: same metrics at a fixed seed, verified weight sync
between actors, the actors' own spans on the run's timeline, and one clear error when an actor hangs or dies."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from test_async import comparable
from test_tiny_loop import run_in_this_process, stable, tiny_config, vowel_reward

from sharpen.config.runtime import RuntimeConfig
from sharpen.monitoring import read_jsonl, read_timeline
from sharpen.orchestration.runtime import run
from sharpen.types import Completion, SamplingParams

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_instance")]

RAY_RUNTIME = RuntimeConfig(type="ray", trainer_cpus=0.5, engine_cpus=0.5, call_timeout_s=120)


class SleepyEngine:
    """An engine actor that never finishes a generate: the stand-in for a hung vLLM."""

    def invoke(self, method: str, *args: object) -> tuple[object, list]:
        """How the proxies call an actor (`SpanRecordingActor.invoke`), without spans."""
        return getattr(self, method)(*args), []

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


# One torch thread in every run: the actors get OMP_NUM_THREADS=1 from Ray, and a different thread count in the
# driver would change float summation order (differences of ~1e-8 seen in the loss).
ONE_THREAD = {"trainer.num_threads": "1"}
EXPORT = {"run.export_model": "true"}


@pytest.fixture(scope="module")
def one_device(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference of this module's 3-step runs: the same run in this process on one device, its model exported
    (an export changes no metric)."""
    config = tiny_config(
        tiny_model_path, tmp_path_factory.mktemp("one"), name="one", num_steps=3, **ONE_THREAD, **EXPORT
    )
    return run_in_this_process(config)


def test_ray_runtime_gives_the_local_metrics_and_verifies_every_sync(
    tiny_model_path: Path, tmp_path: Path, one_device: Path
) -> None:
    threads, local = ONE_THREAD, one_device
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
    assert_actor_spans_on_the_timeline(remote / "timeline.json")
    assert wait_for_free_cpus(2.0) == 2.0  # both actors are gone; Ray itself belongs to the fixture

    # Resume in the Ray runtime: 2 steps, new actors, --resume to 3; the third step repeats the uninterrupted run.
    split = tiny_config(tiny_model_path, tmp_path, name="split", num_steps=2, **threads)
    run(split, runtime=RAY_RUNTIME, reward_fn=vowel_reward)
    resumed = run(
        split.model_copy(update={"run": split.run.model_copy(update={"num_steps": 3})}),
        runtime=RAY_RUNTIME,
        resume=True,
        reward_fn=vowel_reward,
    )
    resumed_rows = read_jsonl(resumed / "metrics.jsonl")
    assert [row["step"] for row in resumed_rows] == [0, 1, 2]
    assert stable(resumed_rows)[2] == stable(ray_rows)[2]


def test_async_mode_on_ray_actors_trains_like_async_mode_locally(tiny_model_path: Path, tmp_path: Path) -> None:
    # pinned weight updates make an async run reproducible, so the two runtimes must agree exactly
    options = {"trainer.num_threads": "1", "rollout.mode": '"async"', "rollout.max_staleness": "1"}
    local = run_in_this_process(tiny_config(tiny_model_path, tmp_path, name="local", num_steps=3, **options))
    remote = run(
        tiny_config(tiny_model_path, tmp_path, name="ray", num_steps=3, **options),
        runtime=RAY_RUNTIME,
        reward_fn=vowel_reward,
    )
    local_rows, ray_rows = read_jsonl(local / "metrics.jsonl"), read_jsonl(remote / "metrics.jsonl")
    assert comparable(ray_rows) == comparable(local_rows)
    assert [row["async/staleness_max"] for row in ray_rows] == [0.0, 1.0, 1.0]
    loads = [row["sync/probe_mismatch_mean"] for row in ray_rows if "sync/probe_mismatch_mean" in row]
    assert loads and max(loads) < 1e-4  # versions loaded actor to actor by the producer, and checked
    assert wait_for_free_cpus(2.0) == 2.0


BROADCAST = {"weight_sync.transport": '"broadcast"'}  # rank 0's gathered tensors -> the engine over gloo
PIECES = {"weight_sync.assemble": '"receiver"'}  # each rank's pieces -> the object store -> the engine assembles
TWO_RANKS = RAY_RUNTIME.model_copy(update={"trainer_ranks": 2})


def test_two_tensor_parallel_trainer_ranks_on_ray_match_one_device(
    tiny_model_path: Path, tmp_path: Path, one_device: Path
) -> None:
    """2 trainer rank actors (gloo) + 1 engine actor vs the single-device backend in this process, 3 steps at one
    seed: one shard split by tensor parallelism (DTensor parameters), synced by pieces that the engine actor
    assembles (`assert_two_ranks_match_one_device`). FSDP2's data shards synced by broadcast are compared the same
    way in `test_two_fsdp2_trainer_ranks_on_ray_match_one_device_and_resume_exactly`."""
    ranks = {"runtime.type": '"ray"', "runtime.trainer_ranks": "2", "trainer.parallel.tp": "2", **PIECES}
    two = run(
        tiny_config(tiny_model_path, tmp_path, name="two", num_steps=3, **ONE_THREAD, **EXPORT, **ranks),
        runtime=TWO_RANKS,
        reward_fn=vowel_reward,
    )
    assert_two_ranks_match_one_device(two, one_device, tiny_model_path, is_broadcast=False)
    assert wait_for_free_cpus(2.0) == 2.0


def assert_two_ranks_match_one_device(two: Path, one: Path, tiny_model_path: Path, *, is_broadcast: bool) -> None:
    """A 2-rank run against the single-device one. The ranks reduce in another order, so losses and weights agree
    to float32 rounding (tolerances below), and the engine, synced with weights that close, samples the same tokens:
    rewards are identical. Tensor parallelism also computes each gradient element with other kernels (column slices,
    the vocabulary-split softmax), and AdamW moves an element whose gradient is near 0 by about lr whatever its size,
    so its weights are compared by norm (measured: one element 3e-4 of its tensor's largest away after 3 steps at lr
    1e-3); the gradients themselves are compared element by element in
    tests/unit/trainer/backends/test_parallel_trainer.py."""
    from safetensors.torch import load_file

    one_rows, two_rows = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [row["reward/mean"] for row in two_rows] == [row["reward/mean"] for row in one_rows]
    assert [row["train/num_loss_tokens"] for row in two_rows] == [row["train/num_loss_tokens"] for row in one_rows]
    for got, expected in zip(two_rows, one_rows, strict=True):
        assert got["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-4, abs=1e-6)
        assert got["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-4)
        assert got["sync/probe_mismatch_mean"] < 1e-4  # the full weights reached the engine actor
        if is_broadcast:
            assert got["sync/num_receivers"] == 1.0 and got["sync/num_buckets"] >= 1
        else:  # 2 tp pieces of each projection, the embedding and the head; 1 of each replicated norm
            assert got["sync/num_pieces"] > len(load_file(tiny_model_path / "model.safetensors"))
    weights_one, weights_two = (
        load_file(one / "model" / "model.safetensors"),
        load_file(two / "model" / "model.safetensors"),
    )
    assert weights_one.keys() == weights_two.keys()
    relative = max(float((weights_two[k] - weights_one[k]).norm() / weights_one[k].norm()) for k in weights_one)
    assert relative < 5e-5, relative
    if is_broadcast:  # data shards only differ in the order gradients are summed: every element is that close
        worst = max(
            float((weights_two[k] - weights_one[k]).abs().max() / weights_one[k].abs().max().clamp_min(1e-12))
            for k in weights_one
        )
        assert worst < 1e-4
    moved = load_file(tiny_model_path / "model.safetensors")
    assert max(float((weights_one[k] - moved[k]).abs().max()) for k in weights_one if k in moved) > 1e-4


def test_engine_replicas_behind_a_router_locally_and_as_ray_actors(tiny_model_path: Path, tmp_path: Path) -> None:
    """Two engine replicas: each request batch is split between them, every sync reaches and is verified on both,
    and the Ray runtime (two engine actors, weights broadcast to both over gloo) trains exactly like the embedded one
    (two engines in this process)."""
    broadcast = {"runtime.type": '"ray"', "weight_sync.transport": '"broadcast"'}
    options = {"trainer.num_threads": "1", "rollout.num_engines": "2"}
    local = run_in_this_process(tiny_config(tiny_model_path, tmp_path, name="local", num_steps=2, **options))
    remote = run(
        tiny_config(tiny_model_path, tmp_path, name="ray", num_steps=2, **options, **broadcast),
        runtime=RAY_RUNTIME,
        reward_fn=vowel_reward,
    )
    local_rows, ray_rows = read_jsonl(local / "metrics.jsonl"), read_jsonl(remote / "metrics.jsonl")

    def without_sync(rows: list[dict]) -> list[dict]:  # the two transports report different sync metrics
        return [{k: v for k, v in row.items() if not k.startswith("sync/")} for row in stable(rows)]

    assert without_sync(ray_rows) == without_sync(local_rows)
    for row in local_rows:
        assert row["sync/num_replicas"] == 2.0 and row["sync/probe_mismatch_max"] < 1e-4
    for row in ray_rows:  # one broadcast from the trainer actor reaches both engine actors
        assert row["sync/num_receivers"] == 2.0 and row["sync/probe_mismatch_max"] < 1e-4
    names = {e["args"]["name"] for e in read_timeline(remote / "timeline.json") if e["name"] == "process_name"}
    assert {"engine replica 0", "engine replica 1"} <= names
    assert wait_for_free_cpus(2.0) == 2.0


def test_a_vision_model_trains_on_ray_actors_like_it_does_locally(tiny_vlm_path: Path, tmp_path: Path) -> None:
    """Image prompts through the Ray runtime: the images travel to two engine replicas (router) and the trainer
    actor with the rollouts, the parity probe scores image prompts on both sides, and the run is the embedded one's
    (two engines in this process)."""
    # imported here: Ray workers import this module (for SleepyEngine) without the tests folder on their path
    from support.vision_runs import image_run_config, write_image_tasks
    from support.vision_runs import vowel_reward as image_reward

    data = write_image_tasks(tmp_path)
    config = image_run_config(tiny_vlm_path, data, tmp_path / "local")
    options = {"trainer": config.trainer.model_copy(update={"num_threads": 1})}
    options["rollout"] = config.rollout.model_copy(update={"num_engines": 2})
    local = run(config.model_copy(update=options), reward_fn=image_reward)
    remote_config = image_run_config(tiny_vlm_path, data, tmp_path / "ray").model_copy(update=options)
    remote = run(remote_config, runtime=RAY_RUNTIME, reward_fn=image_reward)
    local_rows, ray_rows = read_jsonl(local / "metrics.jsonl"), read_jsonl(remote / "metrics.jsonl")
    assert [row["step"] for row in ray_rows] == [0, 1]
    assert stable(ray_rows) == stable(local_rows)
    for row in ray_rows:
        assert row["sync/probe_mismatch_max"] < 1e-4
        assert row["parity/num_tokens"] > 0 and row["parity/max_abs_diff"] < 1e-4
    assert wait_for_free_cpus(2.0) == 2.0


def assert_actor_spans_on_the_timeline(path: Path) -> None:
    """Each actor's work is on the driver's timeline under the actor's own pid and process name, on the same clock
    as the driver's phases."""
    events = read_timeline(path)
    pids = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    driver, trainer, engine = pids["orchestrator"], pids["trainer actor"], pids["engine actor"]
    assert driver == os.getpid() and len({driver, trainer, engine}) == 3
    spans = [e for e in events if e["ph"] == "X"]
    names = {pid: {e["name"] for e in spans if e["pid"] == pid} for pid in (trainer, engine)}
    assert {"start", "step", "probe", "put_weights"} <= names[trainer]  # probe: the weight-sync check
    assert {"start", "generate", "probe", "load_weights"} <= names[engine]  # probe: the weight-sync check
    # Clocks line up across processes: every trainer step lies inside one of the driver's train phases.
    trains = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["pid"] == driver and e["name"] == "train"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["pid"] == trainer and e["name"] == "step"]
    slack = 50e3  # microseconds: the two processes anchored their clocks to the wall clock separately
    assert len(steps) == len(trains) == 3
    for (start, end), (train_start, train_end) in zip(steps, trains, strict=True):
        assert train_start - slack <= start and end <= train_end + slack


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


def test_two_fsdp2_trainer_ranks_on_ray_match_one_device_and_resume_exactly(
    tiny_model_path: Path, tmp_path: Path, one_device: Path
) -> None:
    """2 FSDP2 rank actors (data shards, synced by broadcast) train 3 steps like one device
    (`assert_two_ranks_match_one_device`). Sharded checkpoints: 2 rank actors train 2 steps and stop; new actors
    resume from the sharded checkpoint (every rank reads its shards and optimizer state) and the third step repeats
    the uninterrupted run's."""
    ranks = {"runtime.type": '"ray"', "runtime.trainer_ranks": "2", **BROADCAST}
    options = {**ONE_THREAD, "run.checkpoint_every": "1", **ranks}
    two_ranks = TWO_RANKS
    full = run(
        tiny_config(tiny_model_path, tmp_path, name="full", num_steps=3, **options, **EXPORT),
        runtime=two_ranks,
        reward_fn=vowel_reward,
    )
    assert_two_ranks_match_one_device(full, one_device, tiny_model_path, is_broadcast=True)
    split = tiny_config(tiny_model_path, tmp_path, name="split", num_steps=2, **options)
    stopped = run(split, runtime=two_ranks, reward_fn=vowel_reward)
    shards = sorted(path.name for path in (stopped / "checkpoints" / "step_000002").glob("*.distcp"))
    assert len(shards) == 2, f"one shard file per rank, got {shards}"
    manifest = json.loads((stopped / "checkpoints" / "step_000002" / "manifest.json").read_text())
    assert set(shards) <= set(manifest["files"])  # every rank's shard, in the manifest written last
    resumed = run(
        split.model_copy(update={"run": split.run.model_copy(update={"num_steps": 3})}),
        runtime=two_ranks,
        resume="auto",
        reward_fn=vowel_reward,
    )
    full_rows, resumed_rows = read_jsonl(full / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [row["step"] for row in resumed_rows] == [0, 1, 2]
    assert stable(resumed_rows)[2] == stable(full_rows)[2]
    assert resumed_rows[2]["train/num_loss_tokens"] > 0
    assert wait_for_free_cpus(2.0) == 2.0


def test_an_moe_engine_actor_replays_the_trainer_routes_in_the_weight_sync_probe(
    tiny_moe_path: Path, tmp_path: Path
) -> None:
    """The weight-sync probe of an MoE policy replays the trainer actor's routes in the engine actor (the `hf`
    engine can), as it does in one process: the check compares weights, not a route one side's rounding flipped."""
    moe = {"trainer.moe.routing_replay": '"r3"', "trainer.num_threads": "1"}
    config = tiny_config(tiny_moe_path, tmp_path, name="moe", num_steps=1, **moe)
    rows = read_jsonl(run(config, runtime=RAY_RUNTIME, reward_fn=vowel_reward) / "metrics.jsonl")
    assert len(rows) == 1
    assert rows[0]["sync/probe_replayed"] == 1.0
    assert rows[0]["sync/probe_mismatch_max"] < 1e-4
