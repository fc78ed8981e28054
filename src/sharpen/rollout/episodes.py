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
from typing import Any, Literal, cast

from sharpen.config import ConfigError
from sharpen.data import render_continuation
from sharpen.data.vision import VisionProcessor
from sharpen.environments import (
    EnvironmentFactory,
    EpisodeContext,
    EpisodeLimits,
    SingleTurnEnvironment,
    StepResult,
)
from sharpen.environments.base import AgentEnvironment, Environment, environment_shape_error
from sharpen.rollout.agent_endpoint import AgentEndpoint
from sharpen.rollout.agent_episodes import run_agent_episode
from sharpen.rollout.engines.base import (
    AsyncEngine,
    AsyncImageEngine,
    EngineError,
    EngineInputError,
    InferenceEngine,
    generate_each,
    request_level,
    takes_no_images,
)
from sharpen.rollout.engines.batcher import DaemonWorker, RequestBatcher
from sharpen.rollout.episode_state import EpisodeState, Groups, PromptCache
from sharpen.types import (
    Completion,
    EpisodeRecord,
    Example,
    ImagePart,
    PolicyVersion,
    RolloutGroup,
    SamplingParams,
    TurnRecord,
    prompt_images,
)

logger = logging.getLogger(__name__)


AGENT_SETTLE_SECONDS = 0.02
"""How long a batch of a run with agent episodes waits for one more request (see `RequestBatcher`)."""


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
        self, prompt: list[int], params: SamplingParams, *, key: Sequence[Any] = (), images: tuple[ImagePart, ...] = ()
    ) -> tuple[Completion, PolicyVersion]:
        if not images:
            completion = await self._requests.generate_async(prompt, params)
        elif isinstance(self._requests, AsyncImageEngine):
            completion = await self._requests.generate_async_with_images(prompt, images, params)
        else:
            raise takes_no_images(self.engine)
        if completion.versions is None or len(completion.versions) != len(completion.token_ids):
            raise EngineError(f"{type(self.engine).__name__} returned a completion without per-token versions")
        version = completion.versions[-1] if completion.versions else self.engine.policy_version
        return completion, version


Requests = RequestBatcher | _DirectRequests
"""Where an episode's requests go: grouped into batch calls, or one by one to an engine that batches them."""


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
    vision: VisionProcessor | None = None
    """A vision-language model's `data.vision.VisionProcessor`: prompts and observations with images are rendered
    by it and the episode's images go to the engine with its tokens. None: text only (images are an error)."""

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
        groups: list[RolloutGroup] = []

        async def main() -> None:
            # returns None: asyncio.run, restoring the SIGINT handler, formats the old one (a partial holding the
            # main task), and a task's repr includes its result: the first groups' reprs, ~20 ms a step of 2,000
            groups.extend(
                await self.run(
                    engine, examples, sampling=sampling, num_samples=num_samples, seed=seed, on_group=on_group
                )
            )

        asyncio.run(main())
        return groups

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
        groups = Groups(examples, episodes, on_group)
        prompts = PromptCache(self.tokenizer, vision=self.vision)
        kinds = {type(e.environment): e.environment for e in episodes}  # a protocol check costs ~15 us: one per class
        has_agents = any(isinstance(environment, AgentEnvironment) for environment in kinds.values())
        if has_agents and self.scheduling == "lockstep":
            raise ValueError("agent environments drive their own turns: they need rollout.episode_scheduling = 'async'")
        if self.scheduling == "lockstep":
            await self._run_lockstep(engine, examples, episodes, groups, prompts, sampling=sampling, seed=seed)
        else:
            bound = asyncio.Semaphore(self.max_concurrent) if self.max_concurrent else None
            direct = request_level(engine)
            # a batch engine: one worker thread generates a batch while the loop steps environments
            worker = DaemonWorker() if direct is None else None
            # agents' requests come over HTTP, a few loop turns apart: let a turn's batch gather for a few ms
            settle_seconds = AGENT_SETTLE_SECONDS if has_agents else 0.0
            requests = (
                RequestBatcher(engine, executor=worker, settle_seconds=settle_seconds)
                if direct is None
                else _DirectRequests(engine, direct)
            )
            endpoint = AgentEndpoint() if has_agents else None
            tasks = []
            try:
                async with endpoint if endpoint is not None else contextlib.nullcontext():
                    for episode in episodes:
                        example = examples[episode.example_index]
                        run = self._run_episode(
                            requests, episode, example, sampling, seed, bound, groups, prompts, endpoint
                        )
                        tasks.append(asyncio.ensure_future(run))
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
        episode: EpisodeState,
        example: Example,
        sampling: SamplingParams,
        seed: int | str,
        bound: asyncio.Semaphore | None,
        groups: Groups,
        prompts: PromptCache,
        endpoint: AgentEndpoint | None = None,
    ) -> None:
        """One episode from reset to its end, turn by turn (or its agent's calls), as its own task."""
        async with bound if bound is not None else contextlib.nullcontext():
            batcher.episode_started()
            try:
                if endpoint is not None and isinstance(episode.environment, AgentEnvironment):
                    await self._run_agent(batcher, episode, example, sampling, seed, endpoint)
                else:
                    await self._run_turns(batcher, episode, example, sampling, seed, prompts)
            finally:
                batcher.episode_ended()
        groups.ended(episode)

    async def _run_agent(
        self,
        batcher: Requests,
        episode: EpisodeState,
        example: Example,
        sampling: SamplingParams,
        seed: int | str,
        endpoint: AgentEndpoint,
    ) -> None:
        if self.episode_timeout_s is not None:
            episode.deadline = time.monotonic() + self.episode_timeout_s
        key = (episode.example_index, episode.sample_index)

        async def generate(ids: list[int], params: SamplingParams) -> tuple[Completion, PolicyVersion]:
            try:
                return await asyncio.wait_for(batcher.generate_one(ids, params, key=key), self.request_timeout_s)
            except TimeoutError:
                raise self._timeout_error(batcher) from None

        await run_agent_episode(
            episode,
            example,
            endpoint=endpoint,
            generate=generate,
            tokenizer=self.tokenizer,
            sampling=sampling,
            limits=self.limits,
            seed_of=lambda call: turn_seed(seed, episode.example_index, episode.sample_index, call),
        )

    def _timeout_error(self, batcher: Requests) -> EngineError:
        return EngineError(
            f"the engine ({type(batcher.engine).__name__}) did not answer a request within "
            f"{self.request_timeout_s:g} s (rollout.request_timeout_s)"
        )

    async def _run_turns(
        self,
        batcher: Requests,
        episode: EpisodeState,
        example: Example,
        sampling: SamplingParams,
        seed: int | str,
        prompts: PromptCache,
    ) -> None:
        if self.episode_timeout_s is not None:
            episode.deadline = time.monotonic() + self.episode_timeout_s
        observation = await _reset(episode, example)
        if observation is not None:
            episode.prompt_ids = prompts.render(observation)
            episode.images = prompts.images_of(observation)
        turn = 0
        while not episode.is_done:
            ids, params = _request(episode, sampling, limits=self.limits, seed=seed, turn=turn)
            key = (episode.example_index, episode.sample_index)
            left = episode.time_left()
            is_episode_bound = left is not None and (self.request_timeout_s is None or left < self.request_timeout_s)
            timeout = left if is_episode_bound else self.request_timeout_s
            try:
                request = batcher.generate_one(ids, params, key=key, images=episode.images)
                completion, version = await asyncio.wait_for(request, timeout=timeout)
            except TimeoutError:
                if is_episode_bound:  # the request is dropped; the episode ends with the tokens it has
                    episode.end("episode_timeout", is_truncated=True)
                    break
                raise self._timeout_error(batcher) from None
            except EngineInputError as error:  # a prompt past the engine's context: this episode ends, the run goes on
                _refused(episode, error)
                break
            assert completion.versions is not None  # the batcher stamps every completion's tokens
            _append(episode, completion.token_ids, completion.logprobs, versions=completion.versions, is_generated=True)
            episode.add_routes(completion.routes)
            episode.last_text = completion.text
            result = await _step(episode, completion.text)
            renderers = {"tokenizer": self.tokenizer, "vision": self.vision}
            _advance(episode, completion, result, version=version, limits=self.limits, turn=turn, **renderers)
            turn += 1

    async def _run_lockstep(
        self,
        engine: InferenceEngine,
        examples: list[Example],
        episodes: list[EpisodeState],
        groups: Groups,
        prompts: PromptCache,
        *,
        sampling: SamplingParams,
        seed: int | str,
    ) -> None:
        """Every live episode's turn in one engine call, then every environment's step."""
        limits, renderers = self.limits, {"tokenizer": self.tokenizer, "vision": self.vision}
        if self.episode_timeout_s is not None:
            for episode in episodes:
                episode.deadline = time.monotonic() + self.episode_timeout_s
        observations = await asyncio.gather(*(_reset(e, examples[e.example_index]) for e in episodes))
        for episode, observation in zip(episodes, observations, strict=True):
            if observation is not None:
                episode.prompt_ids = prompts.render(observation)
                episode.images = prompts.images_of(observation)
        turn = 0
        while live := [e for e in episodes if not e.is_done]:
            for episode in episodes:
                if episode.is_done:
                    groups.ended(episode)
            requests = [_request(e, sampling, limits=limits, seed=seed, turn=turn) for e in live]
            prompts_now, params_now = [ids for ids, _ in requests], [params for _, params in requests]
            answers = generate_each(engine, prompts_now, [e.images for e in live], params_now)
            version = engine.policy_version
            for episode, answer in zip(live, answers, strict=True):
                if isinstance(answer, EngineInputError):
                    _refused(episode, answer)
            live = [e for e in live if not e.is_done]
            completions = [a for a in answers if not isinstance(a, EngineInputError)]
            for episode, completion in zip(live, completions, strict=True):
                versions = completion.versions or [version] * len(completion.token_ids)
                _append(episode, completion.token_ids, completion.logprobs, versions=versions, is_generated=True)
                episode.add_routes(completion.routes)
                episode.last_text = completion.text
            results = await asyncio.gather(*(_step(e, c.text) for e, c in zip(live, completions, strict=True)))
            for episode, completion, result in zip(live, completions, results, strict=True):
                _advance(episode, completion, result, version=version, limits=limits, turn=turn, **renderers)
            turn += 1
        for episode in episodes:
            groups.ended(episode)

    async def open_episodes(self, example: Example, example_index: int, num_samples: int) -> list[EpisodeState]:
        """``num_samples`` episodes of ``example``, reset and with their first prompt rendered, whose turn is generated
        elsewhere (partial rollouts: chunk by chunk, across steps); `request_of` and `close_turn` go on with them."""
        prompts = PromptCache(self.tokenizer, vision=self.vision)
        episodes = [self._new_episode(example, example_index, s) for s in range(num_samples)]
        for episode in episodes:
            observation = await _reset(episode, example)
            if observation is not None:
                episode.prompt_ids = prompts.render(observation)
                episode.images = prompts.images_of(observation)
        return episodes

    def request_of(
        self, episode: EpisodeState, sampling: SamplingParams, *, seed: int | str, turn: int = 0
    ) -> SamplingParams:
        """The sampling of an opened episode's turn ``turn``: its token budget and seed, as `run` gives them."""
        return _request(episode, sampling, limits=self.limits, seed=seed, turn=turn)[1]

    async def close_turn(self, episode: EpisodeState, completion: Completion, *, turn: int = 0) -> None:
        """An opened episode's turn ``turn`` is ``completion`` (per-token versions set): record it, step the
        environment with it and end the episode or append the observation for the next turn, as `run` does."""
        assert completion.versions is not None
        _append(episode, completion.token_ids, completion.logprobs, versions=completion.versions, is_generated=True)
        episode.add_routes(completion.routes)
        episode.last_text = completion.text
        result = await _step(episode, completion.text)
        version = completion.versions[-1] if completion.versions else 0
        renderers = {"tokenizer": self.tokenizer, "vision": self.vision}
        _advance(episode, completion, result, version=version, limits=self.limits, turn=turn, **renderers)

    def _new_episode(self, example: Example, example_index: int, sample_index: int) -> EpisodeState:
        environment, limits, sandbox = self.make_environment(), self.limits, self.sandbox
        error = environment_shape_error(environment, source="the environment factory")
        if error is not None:  # the run's error, once: not one failed episode after another
            raise ConfigError(error)
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
        return EpisodeState(
            example_index=example_index,
            sample_index=sample_index,
            environment=environment,
            context=context,
            record=record,
        )


def _turns(episode: EpisodeState) -> Environment:
    """The episode's environment as one the loop steps turn by turn (agent episodes never get here)."""
    return cast(Environment, episode.environment)


async def _reset(episode: EpisodeState, example: Example) -> list[Any] | None:
    started = time.perf_counter()
    timeout, reason = episode.environment_budget()
    try:
        return await asyncio.wait_for(_turns(episode).reset(example, episode.context), timeout=timeout)
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


async def _step(episode: EpisodeState, action: str) -> StepResult:
    started = time.perf_counter()
    timeout, reason = episode.environment_budget()
    try:
        return await asyncio.wait_for(_turns(episode).step(action), timeout=timeout)
    except TimeoutError:
        return StepResult(truncated=True, info={"stop": reason})
    except Exception as error:  # an environment bug ends its episode (scored as an infra error), not the run
        logger.warning("environment %s failed in step", episode.environment.name, exc_info=True)
        episode.record.error = repr(error)
        return StepResult(truncated=True, info={"stop": "environment_error"})
    finally:
        episode.env_seconds += time.perf_counter() - started


def _refused(episode: EpisodeState, error: EngineInputError) -> None:
    """The engine refused the episode's next request for its own input (the prompt and the turns so far past the
    engine's context): the episode ends, truncated, with the tokens it has (stop reason ``engine_refused``)."""
    logger.warning("episode (example %d, sample %d): %s", episode.example_index, episode.sample_index, error)
    episode.record.error = str(error)
    episode.end("engine_refused", is_truncated=True)


def _request(
    episode: EpisodeState, sampling: SamplingParams, *, limits: EpisodeLimits, seed: int | str, turn: int
) -> tuple[list[int], SamplingParams]:
    budget = min(sampling.max_new_tokens, limits.max_tokens - len(episode.completion_ids))
    params = replace(
        sampling, max_new_tokens=budget, seed=turn_seed(seed, episode.example_index, episode.sample_index, turn)
    )
    return episode.prompt_ids + episode.completion_ids, params


def turn_seed(seed: int | str, example_index: int, sample_index: int, turn: int) -> int:
    """The sampling seed of one turn (or an agent's model call); turn 0's is the single-turn generation's."""
    if turn == 0:
        return derive_seed(seed, example_index, sample_index)
    return derive_seed(seed, example_index, sample_index, turn)


def _append(
    episode: EpisodeState, ids: Sequence[int], logprobs: Sequence[float], *, versions: Sequence[int], is_generated: bool
) -> None:
    episode.completion_ids.extend(ids)
    episode.logprobs.extend(logprobs)
    episode.versions.extend(versions)
    episode.loss_mask.extend([is_generated] * len(ids))


def _advance(
    episode: EpisodeState,
    completion: Completion,
    result: StepResult,
    *,
    tokenizer: Any,
    version: int,
    limits: EpisodeLimits,
    turn: int,
    vision: VisionProcessor | None = None,
) -> None:
    """Record the turn and either end the episode or append the observation for the next turn (with ``vision``, an
    observation's images too)."""
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
        images = prompt_images(result.observation)
        if images and vision is not None:
            ids = vision.render_continuation(result.observation, end_of_turn_id=end_of_turn_id)
        else:  # a text observation (images without a vision processor are an error there)
            ids = render_continuation(tokenizer, result.observation, end_of_turn_id=end_of_turn_id)
        if not completion.token_ids or completion.token_ids[-1] != end_of_turn_id:
            ids = [end_of_turn_id, *ids]  # the turn stopped on another stop token: close it as the template would
        if len(episode.completion_ids) + len(ids) >= limits.max_tokens:
            episode.end("max_tokens", is_truncated=True)
            return
        record.observation_ids = ids
        _append(episode, ids, [0.0] * len(ids), versions=[version] * len(ids), is_generated=False)
        episode.images += images
