"""vLLM's async engine in process (`VllmAsyncEngine`) on the CPU with SmolLM2: its requests give the batch
`VllmEngine`'s tokens and logprobs, concurrent requests from foreign event loops all finish and match one-at-a-time
ones, weight syncs take effect (the probe matches the trainer), a sync while requests are in flight gives them
tokens of both versions, and failures are `EngineError`s. One async engine for the whole module."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_vllm_sync import corrupt_bucket, join_trainer_weight_group

from sharpen.config.engines import VllmEngineConfig
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.rollout.engines import AsyncEngine, EngineError, WeightGroupEngine, build_engine, request_level
from sharpen.rollout.engines.base import EngineInputError
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.types import Completion, SamplingParams

pytestmark = pytest.mark.slow

# As in test_vllm_sync.py: engine and trainer logprobs of the same weights differ by ~5e-6 nats/token (max ~2e-5)
# in float32; a perturbation of 1e-3 per parameter moves the probe far beyond this.
TOLERANCE = 1e-3

QUESTIONS = ["What is 3 + 4?", "Name a colour.", "Write a short poem about the sea.", "What is the capital of Peru?"]


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Iterator:
    from sharpen.rollout.engines.vllm_async import VllmAsyncEngine

    engine = build_engine(VllmEngineConfig(async_engine=True), model_path=smollm2_path, dtype="float32", seed=0)
    assert isinstance(engine, VllmAsyncEngine)
    print(f"async engine started in {engine.startup_seconds:.1f}s")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for question in QUESTIONS
    ]


def _mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / max(len(a), 1)


def _perturb(trainer: Trainer, scale: float = 1e-3) -> None:
    import torch

    backend = trainer.backend
    assert isinstance(backend, SingleDeviceBackend)
    with torch.no_grad():  # weights the engine does not hold yet
        for parameter in backend.model.parameters():
            parameter.add_(torch.randn_like(parameter) * scale)


def _assert_same(a: list[Completion], b: list[Completion], *, max_divergent: int = 0) -> None:
    """Same tokens and logprobs (to the tolerance); ``max_divergent`` completions may part ways at a near-tie, and
    agree up to there."""
    divergent = 0
    for x, y in zip(a, b, strict=True):
        if x.token_ids != y.token_ids:
            divergent += 1
            common = next(
                i for i, (s, t) in enumerate(zip([*x.token_ids, -1], [*y.token_ids, -2], strict=False)) if s != t
            )
            assert _mean_abs(x.logprobs[:common], y.logprobs[:common]) < TOLERANCE
            continue
        assert _mean_abs(x.logprobs, y.logprobs) < TOLERANCE
        assert x.finish_reason == y.finish_reason and x.text == y.text
    assert divergent <= max_divergent


def test_it_is_a_request_level_engine_and_refuses_sleep_mode_on_the_cpu(engine, smollm2_path: Path) -> None:
    from vllm.platforms import current_platform

    from sharpen.rollout.engines.vllm_async import VllmAsyncEngine

    assert request_level(engine) is engine
    assert isinstance(engine, AsyncEngine)
    assert isinstance(engine, WeightGroupEngine) and engine.num_weight_group_members == 1
    if current_platform.is_sleep_mode_available():
        return
    with pytest.raises(EngineError, match=r"runtime\.colocate needs vLLM's sleep mode, which vLLM does not offer"):
        VllmAsyncEngine(VllmEngineConfig(), model_path=smollm2_path, dtype="float32", seed=0, sleep_mode=True)


def test_requests_give_the_batch_engines_tokens_and_logprobs(engine, prompts, shared_vllm_engine) -> None:
    """16 requests of up to 32 tokens through both engines (the same initial weights, the same per-request seeds),
    and their timings side by side (concurrent requests against one batch call). The batch engine is the session's
    (test_vllm_sync's), with SmolLM2's own weights loaded again."""
    batch_prompts = [prompt for prompt in prompts for _ in range(4)]
    params = [SamplingParams(max_new_tokens=32, seed=seed) for seed in range(len(batch_prompts))]

    async def concurrently() -> list[Completion]:
        return list(
            await asyncio.gather(*(engine.generate_async(p, q) for p, q in zip(batch_prompts, params, strict=True)))
        )

    engine.generate(batch_prompts[:2], params[:2])  # warm-up (the first requests of an engine are slower)
    started = time.perf_counter()
    requests = asyncio.run(concurrently())
    async_seconds = time.perf_counter() - started
    batch_engine = shared_vllm_engine.with_smollm2_weights()
    batch_engine.generate(batch_prompts[:2], params[:2])  # warm-up
    started = time.perf_counter()
    batch = batch_engine.generate(batch_prompts, params)
    batch_seconds = time.perf_counter() - started
    _assert_same(requests, batch, max_divergent=1)
    assert all(c.versions == [0] * len(c.token_ids) for c in requests)
    num_tokens = sum(len(c.token_ids) for c in requests)
    print(
        f"{len(requests)} requests, {num_tokens} tokens: concurrent generate_async {async_seconds:.1f}s "
        f"({num_tokens / async_seconds:.0f} tok/s), VllmEngine.generate {batch_seconds:.1f}s "
        f"({sum(len(c.token_ids) for c in batch) / batch_seconds:.0f} tok/s)"
    )


def test_concurrent_requests_from_foreign_loops_match_one_at_a_time(engine, prompts) -> None:
    params = [SamplingParams(max_new_tokens=16, seed=100 + seed) for seed in range(24)]
    work = [(prompts[i % len(prompts)], p) for i, p in enumerate(params)]

    async def one_at_a_time() -> list[Completion]:
        return [await engine.generate_async(prompt, p) for prompt, p in work[:4]]

    async def concurrently(part: list[tuple[list[int], SamplingParams]]) -> list[Completion]:
        return list(await asyncio.gather(*(engine.generate_async(prompt, p) for prompt, p in part)))

    alone = asyncio.run(one_at_a_time())
    with ThreadPoolExecutor(2) as pool:  # two more event loops, in two threads, at the same time
        halves = list(pool.map(lambda part: asyncio.run(concurrently(part)), [work[:12], work[12:]]))
    together = halves[0] + halves[1]
    assert len(together) == len(work) and all(c.token_ids for c in together)
    _assert_same(alone, together[:4])
    batch = engine.generate([prompt for prompt, _ in work], params)  # the batch path: the same requests at once
    _assert_same(together, batch)
    assert all(c.versions == [engine.policy_version] * len(c.token_ids) for c in together)


def test_a_request_vllm_refuses_is_an_engine_input_error_naming_the_engine(engine) -> None:
    too_long = [1] * 2000  # max_model_len is 1024: the request's own input, not a failing engine
    with pytest.raises(EngineInputError, match=r"vLLM async engine: request sharpen-\d+ refused: .*1024"):
        asyncio.run(engine.generate_async(too_long, SamplingParams(max_new_tokens=4)))
    with pytest.raises(EngineInputError, match=r"vLLM async engine: request sharpen-\d+ refused"):
        engine.score(too_long)
    assert engine.generate([[1, 2, 3]], [SamplingParams(max_new_tokens=2, seed=0)])[0].token_ids  # still serving


def test_a_sync_takes_effect_and_the_probe_matches_the_trainer(engine, trainer, tokenizer, prompts) -> None:
    probe_ids = tokenizer.encode("The capital of France is Paris.")
    sync = WeightSync(probe_ids=probe_ids, tolerance=TOLERANCE, verify=True)
    sync(trainer, engine, version=0)  # the trainer's own weights (the model file's)
    before = engine.score(probe_ids)
    _perturb(trainer)
    metrics = sync(trainer, engine, version=1)
    after = engine.score(probe_ids)
    assert _mean_abs(before, after) > 10 * TOLERANCE  # the engine's logprobs changed...
    assert _mean_abs(after, trainer.compute_logprobs(probe_ids)) < TOLERANCE  # ...to the trainer's
    assert metrics["sync/probe_mismatch_mean"] < TOLERANCE and metrics["sync/num_buckets"] >= 1
    assert engine.policy_version == 1
    completions = engine.generate(prompts, [SamplingParams(max_new_tokens=16, seed=s) for s in range(len(prompts))])
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.versions == [1] * len(completion.token_ids)
        recomputed = trainer.compute_logprobs(prompt + completion.token_ids)[len(prompt) - 1 :]
        assert _mean_abs(recomputed, completion.logprobs) < TOLERANCE


def _in_flight(engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[threading.Thread, list]:
    """Requests awaited on a foreign loop in a thread; returns once vLLM has sampled tokens for every one of them.
    The list gets the completions (or the exception) when the thread ends."""
    results: list = []

    async def run() -> None:
        outcomes = await asyncio.gather(
            *(engine.generate_async(p, q) for p, q in zip(prompts, params, strict=True)), return_exceptions=True
        )
        results.extend(outcomes)

    thread = threading.Thread(target=lambda: asyncio.run(run()))
    thread.start()
    states = engine.llm.output_processor.request_states  # vLLM's per-request state, read only to wait
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while True:
        running = list(states.items())  # finished requests leave it
        seen.update(request_id for request_id, _ in running)
        if len(seen) >= len(prompts) and all(state.detokenizer.num_output_tokens() >= 4 for _, state in running):
            return thread, results
        assert thread.is_alive() and time.monotonic() < deadline, "the requests never got going"
        time.sleep(0.02)


def test_an_update_while_requests_are_in_flight_gives_them_tokens_of_both_versions(
    engine, trainer, tokenizer, prompts
) -> None:
    """Generation pauses with vLLM's ``keep`` mode: the requests continue after the sync, their context recomputed
    with the new weights, so their new-version tokens have the new policy's logprobs."""
    version = engine.policy_version
    requests = [prompt for prompt in prompts for _ in range(2)]
    params = [SamplingParams(max_new_tokens=64, seed=200 + s) for s in range(len(requests))]
    _perturb(trainer)
    thread, completions = _in_flight(engine, requests, params)
    sync = WeightSync(probe_ids=tokenizer.encode("Mid-flight."), tolerance=TOLERANCE, verify=True)
    metrics = sync(trainer, engine, version=version + 1)
    thread.join(timeout=120)
    assert metrics["sync/probe_mismatch_mean"] < TOLERANCE
    assert all(isinstance(c, Completion) for c in completions), completions
    spanning = 0
    for prompt, completion in zip(requests, completions, strict=True):
        versions = completion.versions
        assert versions is not None and len(versions) == len(completion.token_ids) == len(completion.logprobs)
        assert versions == sorted(versions) and set(versions) <= {version, version + 1}
        assert versions[:4] == [version] * min(4, len(versions))  # sampled before the sync
        if version + 1 in versions:
            spanning += 1
            first_new = versions.index(version + 1)
            recomputed = trainer.compute_logprobs(prompt + completion.token_ids)[len(prompt) - 1 :]
            assert _mean_abs(recomputed[first_new:], completion.logprobs[first_new:]) < TOLERANCE
    assert spanning >= 1
    print(f"{spanning} of {len(completions)} requests span the update; paused {metrics['sync/paused_seconds']:.2f}s")


def test_a_corrupted_sync_aborts_the_requests_in_flight_and_refuses_more_until_a_good_one(
    engine, trainer, tokenizer, prompts, monkeypatch: pytest.MonkeyPatch
) -> None:
    version = engine.policy_version
    thread, outcomes = _in_flight(engine, prompts, [SamplingParams(max_new_tokens=64, seed=s) for s in range(4)])
    corrupt_bucket(monkeypatch)
    with pytest.raises(EngineError, match=r"rejected weights version 90: worker 0: bucket 1 .* is corrupted"):
        engine.load_weights(trainer.named_weights(), version=90)
    monkeypatch.undo()
    thread.join(timeout=60)
    assert engine.policy_version == version  # the engine does not claim the new version
    assert outcomes and all(isinstance(o, EngineError) and "failed to load" in str(o) for o in outcomes), outcomes
    with pytest.raises(EngineError, match=r"generate\(\) refused: weights version 90 failed to load"):
        engine.generate([prompts[0]], [SamplingParams(max_new_tokens=4)])
    with pytest.raises(EngineError, match=r"score\(\) refused"):
        engine.score(prompts[0])
    sync = WeightSync(probe_ids=tokenizer.encode("Back to normal."), tolerance=TOLERANCE, verify=True)
    metrics = sync(trainer, engine, version=91)  # the next sync is whole again, and the probe check proves it
    assert metrics["sync/num_buckets"] >= 2 and metrics["sync/probe_mismatch_mean"] < TOLERANCE
    [completion] = engine.generate([prompts[0]], [SamplingParams(max_new_tokens=4, seed=0)])
    assert completion.versions == [91] * len(completion.token_ids)


def test_the_trainers_broadcast_lands_in_the_vllm_worker(engine, trainer, tokenizer) -> None:
    from sharpen.rollout.weight_sync.broadcast import send_weights

    group = join_trainer_weight_group(engine)
    probe_ids = tokenizer.encode("A broadcast goes straight into the worker.")
    _perturb(trainer)
    assert _mean_abs(engine.score(probe_ids), trainer.compute_logprobs(probe_ids)) > 10 * TOLERANCE
    sent: dict[str, object] = {}
    sender = threading.Thread(
        target=lambda: sent.update(
            metrics=send_weights(group, trainer.named_weights(), version=95, bucket_bytes=32 << 20)
        )
    )
    sender.start()
    metrics = engine.receive_broadcast(version=95)
    sender.join(timeout=120)
    assert engine.policy_version == 95 and metrics["sync/num_tensors"] > 100 and metrics["sync/num_workers"] == 1
    assert _mean_abs(engine.score(probe_ids), trainer.compute_logprobs(probe_ids)) < TOLERANCE


def test_a_demo_run_through_the_async_engine(engine, tmp_path: Path) -> None:
    """Two steps of the demo recipe with ``rollout.engine.async_engine = true`` on this engine: every sync is
    verified by the probe."""
    from sharpen.config import load_config
    from sharpen.monitoring import read_jsonl
    from sharpen.orchestration.embedded import run_embedded

    config = load_config(
        Path(__file__).parents[2] / "recipes" / "demo.toml",
        [
            f"run.output_dir={json.dumps(str(tmp_path))}",
            'run.name="async-engine"',
            "run.num_steps=2",
            "run.export_model=false",
            "rollout.prompts_per_step=2",
            "rollout.num_samples_per_prompt=2",
            "rollout.max_new_tokens=16",
            "rollout.engine.async_engine=true",
            "trainer.micro_batch_size=4",
            "monitoring.progress=false",
            'trainer.precision="float32"',  # the engine fixture is float32
        ],
    )
    rows = read_jsonl(run_embedded(config, engine=engine) / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    probes = [row["sync/probe_mismatch_mean"] for row in rows if "sync/probe_mismatch_mean" in row]
    assert probes and max(probes) < TOLERANCE
    assert all(row["train/num_loss_tokens"] > 0 for row in rows)
