"""The vllm_server engine against a real `vllm serve` (CPU build, SmolLM2) that the engine starts itself: logprobs
match the trainer's, requests sent one by one and concurrently give the same tokens, weight syncs are verified by
the probe, a sync during generation gives completions whose tokens carry both versions, a second engine connects
by URL (and is refused for the wrong model), and a short async run trains through the server. One server for the
whole module."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_vllm_sync import assert_bounded_in_flight_run, assert_partial_run, corrupt_bucket, join_trainer_weight_group

from sharpen.config.engines import VllmServerEngineConfig
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.rollout.engines import EngineError, request_level
from sharpen.types import SamplingParams

pytestmark = pytest.mark.slow

TOLERANCE = 1e-3  # as tests/integration/test_vllm_sync.py: same weights differ by ~5e-6 nats/token here


@pytest.fixture(scope="module")
def engine(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from sharpen.rollout.engines.vllm_server import VllmServerEngine

    logs = tmp_path_factory.mktemp("engine-logs")
    engine = VllmServerEngine(
        VllmServerEngineConfig(), model_path=smollm2_path, dtype="float32", seed=0, request_timeout_s=300, log_dir=logs
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(smollm2_path: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    messages = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def _mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def test_logprobs_match_the_trainer_and_requests_do_not_depend_on_their_batch(engine, trainer, prompt) -> None:
    assert request_level(engine) is engine
    params = [SamplingParams(max_new_tokens=24, seed=seed) for seed in range(6)]
    batch = engine.generate([prompt] * 6, params)
    for completion in batch:
        assert completion.versions == [engine.policy_version] * len(completion.token_ids)
        recomputed = trainer.compute_logprobs(prompt + completion.token_ids)[len(prompt) - 1 :]
        assert _mean_abs(recomputed, completion.logprobs) < TOLERANCE
    assert len({tuple(c.token_ids) for c in batch}) > 1  # the seeds differ, so do the samples

    async def concurrently() -> list:
        return list(await asyncio.gather(*(engine.generate_async(prompt, p) for p in reversed(params))))

    alone = [engine.generate([prompt], [p])[0] for p in params[:2]]
    assert [c.token_ids for c in alone] == [c.token_ids for c in batch[:2]]
    assert [c.token_ids for c in reversed(asyncio.run(concurrently()))] == [c.token_ids for c in batch]


def test_more_prompt_tokens_than_one_step_takes_do_not_kill_the_engine(engine) -> None:
    """48 seeded prompts of 300 tokens wait together: more than the server's 2048-token step, so with chunked
    prefill a prompt would be split over two steps, which kills vLLM's CPU engine core for seeded requests."""
    prompts = [[1 + (i * 7 + j) % 5000 for j in range(300)] for i in range(48)]
    completions = engine.generate(prompts, [SamplingParams(max_new_tokens=4, seed=i) for i in range(48)])
    assert len(completions) == 48 and all(c.token_ids for c in completions)


def test_a_weight_sync_is_verified_and_takes_effect(engine, trainer, smollm2_path: Path) -> None:
    from transformers import AutoTokenizer

    probe = AutoTokenizer.from_pretrained(smollm2_path).encode("The capital of France is Paris.")
    sync = WeightSync(probe_ids=probe, tolerance=TOLERANCE, verify=True)
    sync(trainer, engine, version=1)
    before = engine.score(probe)
    import torch

    generator = torch.Generator().manual_seed(0)  # seeded: an unseeded 1e-3 draw once moved the probe by 0.0096 only
    with torch.no_grad():
        for parameter in trainer.backend.model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(noise.to(parameter.device) * 5e-3)
    metrics = sync(trainer, engine, version=2)
    after = engine.score(probe)
    assert _mean_abs(before, after) > 10 * TOLERANCE
    assert metrics["sync/probe_mismatch_mean"] < TOLERANCE and metrics["sync/num_buckets"] >= 1
    assert engine.policy_version == 2


def test_a_corrupted_sync_is_refused_and_the_server_refuses_requests_until_a_good_one(
    engine, trainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    corrupt_bucket(monkeypatch)
    version = engine.policy_version
    with pytest.raises(EngineError, match=rf"rejected weights version {version + 1}: worker 0: bucket 1 .* corrupted"):
        engine.load_weights(trainer.named_weights(), version=version + 1)
    assert engine.policy_version == version
    with pytest.raises(EngineError, match=r"refuses requests: weights version .* failed to load"):
        engine.generate([[1, 2, 3]], [SamplingParams(max_new_tokens=2, seed=0)])
    monkeypatch.undo()
    engine.load_weights(trainer.named_weights(), version=version + 2)  # whole again: the server goes on
    assert set(engine.generate([[1, 2, 3]], [SamplingParams(max_new_tokens=2, seed=0)])[0].versions) == {version + 2}


def test_a_sync_during_generation_gives_tokens_of_both_versions(engine, trainer, prompt) -> None:
    """Requests in flight are frozen for the sync and go on with the new weights: the server's weight-version spans
    say which tokens each version sampled."""
    version = engine.policy_version
    params = [SamplingParams(max_new_tokens=160, seed=100 + i) for i in range(6)]
    results: list = []
    runner = threading.Thread(
        target=lambda: results.extend(engine.generate([prompt] * len(params), params)), daemon=True
    )
    runner.start()
    time.sleep(1.5)
    engine.load_weights(trainer.named_weights(), version=version + 1)
    runner.join(timeout=300)
    assert len(results) == len(params)
    for completion in results:
        assert completion.versions == sorted(completion.versions)
        assert set(completion.versions) <= {version, version + 1}
    assert any(set(c.versions) == {version, version + 1} for c in results)
    assert engine.generate([prompt], params[:1])[0].versions[0] == version + 1


def test_a_second_engine_connects_by_url_and_the_wrong_model_is_refused(engine, smollm2_path: Path) -> None:
    from sharpen.rollout.engines.vllm_server import VllmServerEngine

    config = VllmServerEngineConfig(url=engine.url)
    other = VllmServerEngine(config, model_path=smollm2_path, dtype="float32", seed=0, request_timeout_s=60)
    try:
        assert other.server is None  # connected, not started
        assert other.generate([[1, 2, 3]], [SamplingParams(max_new_tokens=4, seed=1)])[0].token_ids
    finally:
        other.close()
    assert engine.generate([[1, 2, 3]], [SamplingParams(max_new_tokens=2, seed=1)])[0].token_ids  # still up
    wrong = VllmServerEngineConfig(url=engine.url, served_model_name="Qwen/Qwen3-8B")
    with pytest.raises(EngineError, match=r"serves \[.*smollm2.*\], not the run's model 'Qwen/Qwen3-8B'"):
        VllmServerEngine(wrong, model_path=smollm2_path, dtype="float32", seed=0, request_timeout_s=60)


def test_an_async_run_with_in_flight_updates_trains_through_the_server(engine, tmp_path: Path) -> None:
    from sharpen.config import load_config
    from sharpen.orchestration.embedded import run_embedded

    config = load_config(
        Path(__file__).parents[2] / "recipes" / "demo.toml",
        [
            f"run.output_dir={json.dumps(str(tmp_path))}",
            'run.name="server"',
            "run.num_steps=3",  # step 2 needs version 1: a load while the producer generates
            "run.export_model=false",
            'rollout.engine.type="vllm_server"',
            "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=16",
            'rollout.mode="async"',
            "rollout.max_staleness=1",
            'rollout.weight_updates="in_flight"',
            "trainer.micro_batch_size=8",
            "trainer.learning_rate=1e-4",
            "monitoring.progress=false",
            'trainer.precision="float32"',  # the engine fixture is float32
        ],
    )
    assert_bounded_in_flight_run(run_embedded(config, engine=engine), num_steps=3)


def test_partial_rollouts_in_async_mode_through_the_server(engine, smollm2_path: Path, tmp_path: Path) -> None:
    """``rollout.partial`` in async mode on the server engine: as on the in-process engine
    (test_vllm_sync.py: `assert_partial_run`), a trained token at most max_staleness + max_steps_spanned - 1 = 2
    versions older than its step."""
    overrides = ['rollout.engine.type="vllm_server"', 'rollout.mode="async"', "rollout.max_staleness=1"]
    assert_partial_run(engine, smollm2_path, tmp_path, *overrides, max_age=2)


def test_the_trainers_broadcast_lands_in_the_server_workers(engine, trainer, smollm2_path: Path) -> None:
    """``weight_sync.transport = "broadcast"`` (the Ray runtime's): the server's worker joins the weight group
    through the RPC route and takes the trainer's broadcast into its model, verified by the probe."""
    import torch
    from transformers import AutoTokenizer

    from sharpen.rollout.engines import WeightGroupEngine
    from sharpen.rollout.weight_sync.broadcast import send_weights

    assert isinstance(engine, WeightGroupEngine) and engine.num_weight_group_members == 1
    group = join_trainer_weight_group(engine)
    probe = AutoTokenizer.from_pretrained(smollm2_path).encode("A broadcast goes straight into the worker.")
    with torch.no_grad():
        for parameter in trainer.backend.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 1e-3)
    assert _mean_abs(engine.score(probe), trainer.compute_logprobs(probe)) > 10 * TOLERANCE
    version = engine.policy_version + 1
    sender = threading.Thread(
        target=lambda: send_weights(group, trainer.named_weights(), version=version, bucket_bytes=32 << 20)
    )
    sender.start()
    metrics = engine.receive_broadcast(version=version)
    sender.join(timeout=120)
    assert engine.policy_version == version and metrics["sync/num_workers"] == 1
    assert _mean_abs(engine.score(probe), trainer.compute_logprobs(probe)) < TOLERANCE
    assert set(engine.generate([probe], [SamplingParams(max_new_tokens=4, seed=0)])[0].versions) == {version}
