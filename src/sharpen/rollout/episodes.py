"""The episode loop: examples -> environments <-> engine turns -> `RolloutGroup`s.

Owns token continuity. The first prompt is rendered once by the chat template; after that every turn only extends
the token list: the engine's tokens as they came, then the environment's observation rendered as a continuation
(`sharpen.data.render_continuation`). Past turns are never re-rendered or re-tokenised, so the trainer sees exactly
the tokens the engine conditioned on; the loss mask is True only on tokens the engine generated.

Each episode is its own asyncio task (``scheduling = "async"``, the default): it asks the engine for a turn
(`RequestBatcher`: the requests waiting together go to the engine as one batch), steps its environment and asks
again, without waiting for the other episodes' turns; at most ``max_concurrent`` episodes run at once. An engine
that batches continuously itself (`AsyncEngine`: vLLM's async engine, an engine server) gets each request on its own
instead. Each group is handed to ``on_group`` (the collector scores it) as soon as its last episode has ended. With
instant environments the batches are exactly those of ``scheduling = "lockstep"``, where each turn every live
episode's request goes to the engine in one batch and then every environment steps; with slow or uneven environments
an episode no longer waits for the slowest one of its turn. Every sample gets its own sampling seed per turn,
derived from (run seed, step, example index, sample index, turn), so on an engine that honours per-request seeds the
rollouts do not depend on the scheduling, the concurrency or the number of replicas; turn 0 uses the single-turn
derivation, so a single-turn environment reproduces single-turn generation exactly. Limits (turns, tokens, the
environment's wall clock, the episode's timeout) are enforced here, not by environments. Rewards are not computed
here (see `sharpen.orchestration.phases.score_groups`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from sharpen.data import render_continuation, render_prompt
from sharpen.environments import (
    EnvironmentFactory,
    EpisodeContext,
    EpisodeLimits,
    SingleTurnEnvironment,
    StepResult,
)
from sharpen.environments.base import Environment
from sharpen.rollout.engines.base import AsyncEngine, EngineError, InferenceEngine, request_level
from sharpen.rollout.engines.batcher import DaemonWorker, RequestBatcher
from sharpen.types import (
    Completion,
    EpisodeRecord,
    Example,
    PolicyVersion,
    Rollout,
    RolloutGroup,
    SamplingParams,
    TurnRecord,
)

logger = logging.getLogger(__name__)


def derive_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from any parts (Python's ``hash`` is salted per process, so it is not used)."""
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _DirectRequests:
    """Requests of episodes straight to an engine that batches them itself (`AsyncEngine`): each awaits its own."""

    def __init__(self, engine: InferenceEngine, requests: AsyncEngine) -> None:
        self.engine = engine
        self._requests = requests

    def episode_started(self) -> None:
        pass

    def episode_ended(self) -> None:
        pass

    async def generate_one(
        self, prompt: list[int], params: SamplingParams, *, key: Sequence[Any] = ()
    ) -> tuple[Completion, PolicyVersion]:
        completion = await self._requests.generate_async(prompt, params)
        if completion.versions is None or len(completion.versions) != len(completion.token_ids):
            raise EngineError(f"{type(self.engine).__name__} returned a completion without per-token versions")
        version = completion.versions[-1] if completion.versions else self.engine.policy_version
        return completion, version


Requests = RequestBatcher | _DirectRequests
"""Where an episode's requests go: grouped into batch calls, or one by one to an engine that batches them."""


@dataclass(kw_only=True)
class _Episode:
    """One episode in flight."""

    example_index: int
    sample_index: int
    environment: Environment
    context: EpisodeContext
    record: EpisodeRecord
    prompt_ids: list[int] = field(default_factory=list[int])
    completion_ids: list[int] = field(default_factory=list[int])
    logprobs: list[float] = field(default_factory=list[float])
    versions: list[int] = field(default_factory=list[int])
    loss_mask: list[bool] = field(default_factory=list[bool])
    last_text: str = ""
    env_seconds: float = 0.0
    deadline: float | None = None
    """``time.monotonic()`` by which the episode must end (``rollout.episode_timeout_s``; None: no limit)."""
    is_done: bool = False
    is_truncated: bool = False

    def end(self, reason: str, *, is_truncated: bool) -> None:
        self.is_done = True
        self.is_truncated = is_truncated
        self.record.stop_reason = reason

    def environment_budget(self) -> tuple[float | None, str]:
        """How long the environment's next call may take, and the stop reason if it takes longer: the rest of its
        wall-clock budget (``wall_clock``) or of the episode's time (``episode_timeout``), whichever ends first."""
        budget = self.context.wall_seconds
        left = None if budget is None else max(budget - self.env_seconds, 0.0)
        episode_left = self.time_left()
        if episode_left is not None and (left is None or episode_left < left):
            return episode_left, "episode_timeout"
        return left, "wall_clock"

    def time_left(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)


@dataclass(frozen=True, kw_only=True)
class EpisodeRunner:
    """Runs episodes against an engine: everything an episode needs besides the engine, the examples and the
    sampling, built once per run (training, periodic evaluation, ReMax baselines and `sharpen eval` share one).

    ``episode_seed`` (the run seed) seeds environments, through ``EpisodeContext.seed = derive_seed(episode_seed,
    task_key, sample_index)``; ``sandbox`` is the pool of environments that run code (None when none needs it)."""

    tokenizer: Any
    make_environment: EnvironmentFactory = SingleTurnEnvironment
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    episode_seed: int | str = 0
    sandbox: Any = None
    scheduling: Literal["async", "lockstep"] = "async"
    """Episodes as independent tasks (async), or every live episode's turn in one batch, then every environment."""
    max_concurrent: int = 0
    """Episodes running at once (async scheduling; 0: all of them)."""
    request_timeout_s: float | None = None
    """Async scheduling: a request the engine has not answered within this many seconds stops the run with an
    `EngineError` naming the engine (None: wait as long as it takes)."""
    episode_timeout_s: float | None = None
    """An episode still running this many seconds after it started (engine and environment time together) is
    ended where it is, as truncated, with stop reason ``episode_timeout``; its tokens so far are kept (None: no
    limit). Under lockstep scheduling it bounds environment calls only (a turn's batch is shared)."""

    def generate_groups(
        self,
        engine: InferenceEngine,
        examples: list[Example],
        *,
        sampling: SamplingParams,
        num_samples: int,
        seed: int | str,
        on_group: Callable[[RolloutGroup], None] | None = None,
    ) -> list[RolloutGroup]:
        """``num_samples`` episodes per example, each token stamped with the engine's policy version when it was
        made. ``seed`` seeds sampling (it differs per step); ``sampling.max_new_tokens`` is the limit of one turn.
        ``on_group`` is called with each group as soon as its last episode ends (to score it while the other
        episodes still run); the groups returned are the same objects, in example order."""
        return asyncio.run(
            self.run(engine, examples, sampling=sampling, num_samples=num_samples, seed=seed, on_group=on_group)
        )

    async def run(
        self,
        engine: InferenceEngine,
        examples: list[Example],
        *,
        sampling: SamplingParams,
        num_samples: int,
        seed: int | str,
        on_group: Callable[[RolloutGroup], None] | None = None,
    ) -> list[RolloutGroup]:
        """`generate_groups` for callers that already run an event loop."""
        episodes = [self._new_episode(examples[i], i, s) for i in range(len(examples)) for s in range(num_samples)]
        groups = _Groups(examples, episodes, on_group)
        if self.scheduling == "lockstep":
            await self._run_lockstep(engine, examples, episodes, groups, sampling=sampling, seed=seed)
        else:
            bound = asyncio.Semaphore(self.max_concurrent) if self.max_concurrent else None
            direct = request_level(engine)
            # a batch engine: one worker thread generates a batch while the loop steps environments
            worker = DaemonWorker() if direct is None else None
            requests = RequestBatcher(engine, executor=worker) if direct is None else _DirectRequests(engine, direct)
            tasks = [
                asyncio.ensure_future(
                    self._run_episode(requests, episode, examples[episode.example_index], sampling, seed, bound, groups)
                )
                for episode in episodes
            ]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                # a hung engine call cannot be interrupted: leave its thread behind instead of waiting for it
                if worker is not None:
                    worker.shutdown(wait=False, cancel_futures=True)
                raise
            if worker is not None:
                worker.shutdown(wait=True)
        return groups.all()

    async def _run_episode(
        self,
        batcher: Requests,
        episode: _Episode,
        example: Example,
        sampling: SamplingParams,
        seed: int | str,
        bound: asyncio.Semaphore | None,
        groups: _Groups,
    ) -> None:
        """One episode from reset to its end, turn by turn, as its own task."""
        async with bound if bound is not None else contextlib.nullcontext():
            batcher.episode_started()
            try:
                await self._run_turns(batcher, episode, example, sampling, seed)
            finally:
                batcher.episode_ended()
        groups.ended(episode)

    async def _run_turns(
        self, batcher: Requests, episode: _Episode, example: Example, sampling: SamplingParams, seed: int | str
    ) -> None:
        if self.episode_timeout_s is not None:
            episode.deadline = time.monotonic() + self.episode_timeout_s
        observation = await _reset(episode, example)
        if observation is not None:
            episode.prompt_ids = render_prompt(self.tokenizer, observation)
        turn = 0
        while not episode.is_done:
            ids, params = _request(episode, sampling, limits=self.limits, seed=seed, turn=turn)
            key = (episode.example_index, episode.sample_index)
            left = episode.time_left()
            is_episode_bound = left is not None and (self.request_timeout_s is None or left < self.request_timeout_s)
            timeout = left if is_episode_bound else self.request_timeout_s
            try:
                request = batcher.generate_one(ids, params, key=key)
                completion, version = await asyncio.wait_for(request, timeout=timeout)
            except TimeoutError:
                if is_episode_bound:  # the request is dropped; the episode ends with the tokens it has
                    episode.end("episode_timeout", is_truncated=True)
                    break
                raise EngineError(
                    f"the engine ({type(batcher.engine).__name__}) did not answer a request within "
                    f"{self.request_timeout_s:g} s (rollout.request_timeout_s)"
                ) from None
            assert completion.versions is not None  # the batcher stamps every completion's tokens
            _append(episode, completion.token_ids, completion.logprobs, versions=completion.versions, is_generated=True)
            episode.last_text = completion.text
            result = await _step(episode, completion.text)
            _advance(episode, completion, result, self.tokenizer, version=version, limits=self.limits, turn=turn)
            turn += 1

    async def _run_lockstep(
        self,
        engine: InferenceEngine,
        examples: list[Example],
        episodes: list[_Episode],
        groups: _Groups,
        *,
        sampling: SamplingParams,
        seed: int | str,
    ) -> None:
        """Every live episode's turn in one engine call, then every environment's step."""
        limits, tokenizer = self.limits, self.tokenizer
        if self.episode_timeout_s is not None:
            for episode in episodes:
                episode.deadline = time.monotonic() + self.episode_timeout_s
        observations = await asyncio.gather(*(_reset(e, examples[e.example_index]) for e in episodes))
        for episode, observation in zip(episodes, observations, strict=True):
            if observation is not None:
                episode.prompt_ids = render_prompt(tokenizer, observation)
        turn = 0
        while live := [e for e in episodes if not e.is_done]:
            for episode in episodes:
                if episode.is_done:
                    groups.ended(episode)
            requests = [_request(e, sampling, limits=limits, seed=seed, turn=turn) for e in live]
            completions = engine.generate([ids for ids, _ in requests], [params for _, params in requests])
            version = engine.policy_version
            for episode, completion in zip(live, completions, strict=True):
                versions = completion.versions or [version] * len(completion.token_ids)
                _append(episode, completion.token_ids, completion.logprobs, versions=versions, is_generated=True)
                episode.last_text = completion.text
            results = await asyncio.gather(*(_step(e, c.text) for e, c in zip(live, completions, strict=True)))
            for episode, completion, result in zip(live, completions, results, strict=True):
                _advance(episode, completion, result, tokenizer, version=version, limits=limits, turn=turn)
            turn += 1
        for episode in episodes:
            groups.ended(episode)

    def _new_episode(self, example: Example, example_index: int, sample_index: int) -> _Episode:
        environment, limits, sandbox = self.make_environment(), self.limits, self.sandbox
        context = EpisodeContext(
            seed=derive_seed(self.episode_seed, example.task_key, sample_index),
            sample_index=sample_index,
            max_turns=limits.max_turns,
            max_tokens=limits.max_tokens,
            wall_seconds=limits.wall_seconds,
            sandbox=sandbox,
        )
        record = EpisodeRecord(
            environment=environment.name,
            environment_version=environment.version,
            seed=context.seed,
            sandbox_backend=None if sandbox is None else str(sandbox.report.backend),
        )
        return _Episode(
            example_index=example_index,
            sample_index=sample_index,
            environment=environment,
            context=context,
            record=record,
        )


async def _reset(episode: _Episode, example: Example) -> list[Any] | None:
    started = time.perf_counter()
    timeout, reason = episode.environment_budget()
    try:
        return await asyncio.wait_for(episode.environment.reset(example, episode.context), timeout=timeout)
    except TimeoutError:
        episode.end(reason, is_truncated=True)
        return None
    except Exception as error:  # an environment bug ends its episode (scored as an infra error), not the run
        logger.warning("environment %s failed in reset", episode.environment.name, exc_info=True)
        episode.record.error = repr(error)
        episode.end("environment_error", is_truncated=True)
        return None
    finally:
        episode.env_seconds += time.perf_counter() - started


async def _step(episode: _Episode, action: str) -> StepResult:
    started = time.perf_counter()
    timeout, reason = episode.environment_budget()
    try:
        return await asyncio.wait_for(episode.environment.step(action), timeout=timeout)
    except TimeoutError:
        return StepResult(truncated=True, info={"stop": reason})
    except Exception as error:  # an environment bug ends its episode (scored as an infra error), not the run
        logger.warning("environment %s failed in step", episode.environment.name, exc_info=True)
        episode.record.error = repr(error)
        return StepResult(truncated=True, info={"stop": "environment_error"})
    finally:
        episode.env_seconds += time.perf_counter() - started


def _request(
    episode: _Episode, sampling: SamplingParams, *, limits: EpisodeLimits, seed: int | str, turn: int
) -> tuple[list[int], SamplingParams]:
    index, sample = episode.example_index, episode.sample_index
    turn_seed = derive_seed(seed, index, sample) if turn == 0 else derive_seed(seed, index, sample, turn)
    budget = min(sampling.max_new_tokens, limits.max_tokens - len(episode.completion_ids))
    return episode.prompt_ids + episode.completion_ids, replace(sampling, max_new_tokens=budget, seed=turn_seed)


def _append(
    episode: _Episode, ids: Sequence[int], logprobs: Sequence[float], *, versions: Sequence[int], is_generated: bool
) -> None:
    episode.completion_ids.extend(ids)
    episode.logprobs.extend(logprobs)
    episode.versions.extend(versions)
    episode.loss_mask.extend([is_generated] * len(ids))


def _advance(
    episode: _Episode,
    completion: Completion,
    result: StepResult,
    tokenizer: Any,
    *,
    version: int,
    limits: EpisodeLimits,
    turn: int,
) -> None:
    """Record the turn and either end the episode or append the observation for the next turn."""
    record = TurnRecord(
        action_text=completion.text,
        num_action_tokens=len(completion.token_ids),
        observation_ids=[],
        reward=result.reward,
        is_terminated=result.terminated,
        is_truncated=result.truncated,
        info=result.info,
    )
    episode.record.turns.append(record)
    if result.terminated:
        episode.end("terminated", is_truncated=completion.finish_reason == "length")
    elif result.truncated:
        episode.end(str(result.info.get("stop", "truncated")), is_truncated=True)
    elif completion.finish_reason == "length":
        is_budget = len(episode.completion_ids) >= limits.max_tokens  # the turn's limit was the episode's budget
        episode.end("max_tokens" if is_budget else "length", is_truncated=True)
    elif turn + 1 >= limits.max_turns:
        episode.end("max_turns", is_truncated=True)
    elif not result.observation:
        raise ValueError(
            f"environment {episode.environment.name!r} ended a turn without an observation and without terminating"
        )
    else:
        end_of_turn_id = tokenizer.eos_token_id  # the token the engine stops a turn on
        ids = render_continuation(tokenizer, result.observation, end_of_turn_id=end_of_turn_id)
        if not completion.token_ids or completion.token_ids[-1] != end_of_turn_id:
            ids = [end_of_turn_id, *ids]  # the turn stopped on another stop token: close it as the template would
        if len(episode.completion_ids) + len(ids) >= limits.max_tokens:
            episode.end("max_tokens", is_truncated=True)
            return
        record.observation_ids = ids
        _append(episode, ids, [0.0] * len(ids), versions=[version] * len(ids), is_generated=False)


class _Groups:
    """The run's groups, each made (and handed to ``on_group``) once all of its episodes have ended."""

    def __init__(
        self, examples: list[Example], episodes: list[_Episode], on_group: Callable[[RolloutGroup], None] | None
    ) -> None:
        self.examples = examples
        self.members: list[list[_Episode]] = [[] for _ in examples]
        for episode in episodes:
            self.members[episode.example_index].append(episode)
        self.on_group = on_group
        self.groups: list[RolloutGroup | None] = [None] * len(examples)
        self._ended: set[int] = set()

    def ended(self, episode: _Episode) -> None:
        if id(episode) in self._ended:
            return
        self._ended.add(id(episode))
        index = episode.example_index
        if all(id(member) in self._ended for member in self.members[index]):
            group = RolloutGroup(
                example=self.examples[index], rollouts=[_rollout(self.examples[index], e) for e in self.members[index]]
            )
            self.groups[index] = group
            if self.on_group is not None:
                self.on_group(group)

    def all(self) -> list[RolloutGroup]:
        missing = [self.examples[i].task_key for i, group in enumerate(self.groups) if group is None]
        assert not missing, f"episodes of {missing} never ended"
        return [group for group in self.groups if group is not None]


def _rollout(example: Example, episode: _Episode) -> Rollout:
    is_multi_turn = not all(episode.loss_mask)
    return Rollout(
        example=example,
        prompt_ids=episode.prompt_ids,
        completion_ids=episode.completion_ids,
        completion_logprobs=episode.logprobs,
        versions=episode.versions,
        completion_text=episode.last_text,
        is_truncated=episode.is_truncated,
        loss_mask=episode.loss_mask if is_multi_turn else None,
        episode=episode.record,
        sample_index=episode.sample_index,
    )
