"""Episodes as independent tasks: the same rollouts whatever the concurrency, the number of replicas or the
scheduling (on an engine that seeds each request), lockstep's batches when environments are instant, and no episode
waiting for a slow environment of another."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from sharpen.environments import EpisodeContext, EpisodeLimits, StepResult
from sharpen.rollout.engines.base import EngineError, request_level
from sharpen.rollout.engines.batcher import RequestBatcher
from sharpen.rollout.engines.router import EngineRouter
from sharpen.rollout.engines.scripted import SeededScriptedEngine
from sharpen.rollout.engines.server import RequestLevelEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Completion, Example, Message, RolloutGroup, SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


WORDS = [" w1", " w2 w3", " a b c", " yes", " no no", " the end"]


class SeededEngine(SeededScriptedEngine):
    """A completion that is a function of the request alone (its prompt and seed), as vLLM's per-request seeds
    make it: one of a few short texts (at most 6 tokens) and the end of turn. Records the size of every batch."""

    def __init__(self, tokenizer) -> None:
        encode = partial(tokenizer.encode, add_special_tokens=False)
        super().__init__(WORDS, encode=encode, logprob=-0.1, eos_token_id=tokenizer.eos_token_id)
        self.policy_version = 7
        self.batch_sizes: list[int] = []

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        self.batch_sizes.append(len(prompts))
        return super().generate(prompts, params)


class RequestSeededEngine(RequestLevelEngine):
    """`SeededEngine` taking requests one at a time on its own loop (as an engine server does), each answered after
    a delay that differs per request, so completions come back in another order than they were asked."""

    name = "request-seeded engine"

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.inner = SeededEngine(tokenizer)
        self.num_requests = 0

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def _generate_one(self, prompt: list[int], params: SamplingParams) -> Completion:
        self.num_requests += 1
        await asyncio.sleep(0.001 * ((params.seed or 0) % 5))
        (completion,) = self.inner.generate([prompt], [params])
        return completion

    def score(self, token_ids: list[int]) -> list[float]:
        return self.inner.score(token_ids)

    def load_weights(self, weights, *, version: int) -> dict[str, float]:
        return self.inner.load_weights(weights, version=version)

    def close(self) -> None:
        self._loop.close()


@dataclass
class SlowTool:
    """Three turns; each step takes a heavy-tailed, per-(task, sample, turn) latency, or none (``instant``)."""

    instant: bool = False
    name: str = "slow_tool"
    version: str = "1"

    async def reset(self, example: Example, context: EpisodeContext) -> list[Message]:
        self.key, self.sample, self.turn = example.task_key, context.sample_index, 0
        return list(example.prompt)

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        if not self.instant:
            digest = hashlib.blake2b(f"{self.key}/{self.sample}/{self.turn}".encode(), digest_size=2).digest()
            await asyncio.sleep(0.001 / (1.0 - 0.9 * digest[0] / 256.0) ** 1.5)  # Pareto-like: 1 ms to 30 ms
        if self.turn >= 3:
            return StepResult(terminated=True, reward=1.0)
        return StepResult(observation=[Message(role="user", content=f"result {len(action)}")])


def examples(n: int) -> list[Example]:
    return [Example(task_key=f"t/{i}", prompt=(Message(role="user", content=f"task {i}"),)) for i in range(n)]


def run(engine, tokenizer, *, instant: bool = False, **runner_options) -> list[RolloutGroup]:
    runner = EpisodeRunner(
        tokenizer=tokenizer,
        make_environment=lambda: SlowTool(instant=instant),
        limits=EpisodeLimits(max_turns=3),
        **runner_options,
    )
    return runner.generate_groups(
        engine, examples(6), sampling=SamplingParams(max_new_tokens=16), num_samples=4, seed="0/3"
    )


def tokens(groups: list[RolloutGroup]) -> list[tuple]:
    return [
        (r.example.task_key, r.sample_index, r.prompt_ids, r.completion_ids, r.loss_mask, r.versions)
        for g in groups
        for r in g.rollouts
    ]


def test_rollouts_do_not_depend_on_concurrency_replicas_or_scheduling(tokenizer) -> None:
    reference = tokens(run(SeededEngine(tokenizer), tokenizer, scheduling="lockstep"))
    assert len(reference) == 24 and all(len(t[3]) > 0 for t in reference)
    assert all(not all(t[4]) for t in reference), "three turns: the observations are masked out"
    for concurrency in (1, 5, 64):
        assert tokens(run(SeededEngine(tokenizer), tokenizer, max_concurrent=concurrency)) == reference
    router = EngineRouter([SeededEngine(tokenizer) for _ in range(4)])
    assert tokens(run(router, tokenizer, max_concurrent=64)) == reference
    assert sum(router.num_routed) == 24 * 3 and min(router.num_routed) > 0
    # an engine that takes requests one by one (a server): the same rollouts, every request sent on its own
    direct = RequestSeededEngine(tokenizer)
    assert request_level(direct) is direct
    assert tokens(run(direct, tokenizer, max_concurrent=64)) == reference
    assert direct.num_requests == 24 * 3 and direct.inner.batch_sizes == [1] * (24 * 3)
    servers = EngineRouter([RequestSeededEngine(tokenizer) for _ in range(4)])
    assert request_level(servers) is servers
    assert tokens(run(servers, tokenizer, max_concurrent=5)) == reference
    assert sum(servers.num_routed) == 24 * 3 and min(servers.num_routed) > 0
    mixed = EngineRouter([RequestSeededEngine(tokenizer), SeededEngine(tokenizer)])
    assert request_level(mixed) is None  # a batch replica: requests are grouped into batches for all of them
    assert tokens(run(mixed, tokenizer)) == reference
    for engine in (direct, *servers.replicas, mixed.replicas[0]):
        engine.close()


def test_with_instant_environments_async_makes_lockstep_batches(tokenizer) -> None:
    lockstep, independent = SeededEngine(tokenizer), SeededEngine(tokenizer)
    run(lockstep, tokenizer, instant=True, scheduling="lockstep")
    run(independent, tokenizer, instant=True)
    assert lockstep.batch_sizes == [24, 24, 24]
    assert independent.batch_sizes == lockstep.batch_sizes


def test_a_slow_environment_does_not_hold_back_the_other_episodes(tokenizer) -> None:
    events: list[str] = []

    class OneSlow(SlowTool):
        async def step(self, action: str) -> StepResult:
            self.turn += 1
            if self.key == "t/0":
                await asyncio.sleep(0.3)
                events.append(f"slow step {self.turn}")
            if self.turn >= 3:
                events.append(f"{self.key} done")
                return StepResult(terminated=True)
            return StepResult(observation=[Message(role="user", content="go on")])

    def order(scheduling: str) -> list[str]:
        events.clear()
        runner = EpisodeRunner(
            tokenizer=tokenizer, make_environment=OneSlow, limits=EpisodeLimits(max_turns=3), scheduling=scheduling
        )
        runner.generate_groups(
            SeededEngine(tokenizer), examples(4), sampling=SamplingParams(max_new_tokens=8), num_samples=1, seed=0
        )
        return list(events)

    independent = order("async")  # the fast episodes run all their turns while the slow one's first step runs
    assert independent.index("slow step 1") > max(independent.index(f"t/{i} done") for i in (1, 2, 3))
    lockstep = order("lockstep")  # every turn waits for the slow environment
    assert lockstep.index("slow step 2") < min(lockstep.index(f"t/{i} done") for i in (1, 2, 3))


def test_an_engine_error_reaches_every_waiting_episode() -> None:
    class Broken:
        policy_version = 0

        def generate(self, prompts, params):
            raise RuntimeError("engine died")

    async def main() -> list[BaseException | object]:
        batcher = RequestBatcher(Broken())  # type: ignore[arg-type]
        calls = [batcher.generate_one([1, 2], SamplingParams(max_new_tokens=2), key=(i,)) for i in range(3)]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(main())
    assert [str(r) for r in results] == ["engine died"] * 3


def test_an_engine_that_stops_answering_is_one_clear_error_not_a_hang(tokenizer) -> None:
    release = threading.Event()

    class Hung(SeededEngine):
        def generate(self, prompts, params):
            release.wait(30)  # a stuck engine call: nothing can interrupt it
            return super().generate(prompts, params)

    runner = EpisodeRunner(tokenizer=tokenizer, request_timeout_s=0.2)
    try:
        with pytest.raises(EngineError, match=r"the engine \(Hung\) did not answer a request within 0.2 s"):
            runner.generate_groups(
                Hung(tokenizer), examples(2), sampling=SamplingParams(max_new_tokens=4), num_samples=2, seed=0
            )
    finally:
        release.set()


HUNG_RUN = """
import time
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Example, Message, SamplingParams

class Tokenizer:
    eos_token_id = 0
    def apply_chat_template(self, conversation, *, add_generation_prompt, tokenize):
        return [1, 2, 3]

class Hung:
    policy_version = 0
    def generate(self, prompts, params):
        time.sleep(3600)

runner = EpisodeRunner(tokenizer=Tokenizer(), request_timeout_s=0.2)
example = Example(task_key="t/0", prompt=(Message(role="user", content="hi"),))
runner.generate_groups(Hung(), [example], sampling=SamplingParams(max_new_tokens=4), num_samples=1, seed=0)
"""


def test_a_hung_engine_call_does_not_keep_the_process_from_exiting() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", HUNG_RUN], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "did not answer a request within 0.2 s" in done.stderr.splitlines()[-1]


def test_each_group_is_handed_over_as_soon_as_its_episodes_have_ended(tokenizer) -> None:
    handed: list[str] = []

    class SlowFirstTask(SlowTool):
        async def step(self, action: str) -> StepResult:
            if self.key == "t/0":
                await asyncio.sleep(0.2)
            return await super().step(action)

    def on_group(group: RolloutGroup) -> None:
        assert len(group.rollouts) == 4 and all(r.episode.stop_reason for r in group.rollouts)
        handed.append(group.example.task_key)

    for scheduling in ("async", "lockstep"):
        handed.clear()
        runner = EpisodeRunner(
            tokenizer=tokenizer,
            make_environment=lambda: SlowFirstTask(instant=True),
            limits=EpisodeLimits(max_turns=3),
            scheduling=scheduling,  # type: ignore[arg-type]
        )
        groups = runner.generate_groups(
            SeededEngine(tokenizer),
            examples(3),
            sampling=SamplingParams(max_new_tokens=8),
            num_samples=4,
            seed=0,
            on_group=on_group,
        )
        assert sorted(handed) == ["t/0", "t/1", "t/2"] and [g.example.task_key for g in groups] == ["t/0", "t/1", "t/2"]
        if scheduling == "async":
            assert handed[-1] == "t/0"  # the slow task's group comes last, the others did not wait for it


def test_an_episode_past_its_timeout_ends_truncated_and_the_others_go_on(tokenizer) -> None:
    class StuckTool(SlowTool):
        async def step(self, action: str) -> StepResult:
            if self.key == "t/1" and self.sample == 2:
                await asyncio.sleep(30)  # a tool that never answers
            return await super().step(action)

    runner = EpisodeRunner(
        tokenizer=tokenizer,
        make_environment=lambda: StuckTool(instant=True),
        limits=EpisodeLimits(max_turns=3),
        episode_timeout_s=0.5,
    )
    started = time.monotonic()
    groups = runner.generate_groups(
        SeededEngine(tokenizer), examples(3), sampling=SamplingParams(max_new_tokens=8), num_samples=4, seed=0
    )
    assert time.monotonic() - started < 10
    rollouts = {(r.example.task_key, r.sample_index): r for g in groups for r in g.rollouts}
    stuck = rollouts.pop(("t/1", 2))
    assert stuck.episode.stop_reason == "episode_timeout" and stuck.is_truncated
    assert stuck.completion_ids and len(stuck.episode.turns) == 1  # the first turn's tokens are kept
    assert all(r.episode.stop_reason == "terminated" and len(r.episode.turns) == 3 for r in rollouts.values())


def test_a_request_past_the_episode_timeout_ends_the_episode_not_the_run(tokenizer) -> None:
    class SlowForOne(RequestSeededEngine):
        async def _generate_one(self, prompt: list[int], params: SamplingParams) -> Completion:
            if prompt[-1] == self.slow_token:
                await asyncio.sleep(30)
            return await super()._generate_one(prompt, params)

    engine = SlowForOne(tokenizer)
    engine.slow_token = -1
    runner = EpisodeRunner(tokenizer=tokenizer, episode_timeout_s=0.5, request_timeout_s=60)
    prompts = examples(2)
    engine.slow_token = (
        runner.generate_groups(engine, prompts[:1], sampling=SamplingParams(max_new_tokens=8), num_samples=1, seed=0)[0]
        .rollouts[0]
        .prompt_ids[-1]
    )
    slow = [Example(task_key="t/slow", prompt=prompts[0].prompt)]  # its prompt ends with the slow token
    (group,) = runner.generate_groups(engine, slow, sampling=SamplingParams(max_new_tokens=8), num_samples=2, seed=0)
    assert [r.episode.stop_reason for r in group.rollouts] == ["episode_timeout"] * 2
    assert all(r.completion_ids == [] and r.is_truncated for r in group.rollouts)
    engine.close()
