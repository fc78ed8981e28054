"""Agent episodes: an `AgentEnvironment` runs its own agent code against the agent endpoint, and its recorded calls
become the episode's rollout.

Owns the episode side of agents: opening the episode's session on the endpoint, the limits (model calls count as
turns, completion tokens per segment, the environment's wall clock without the time spent in model calls, the
episode's timeout), and turning the session's segments into the episode's tokens: the segment holding the last call
is the rollout, earlier segments (a rewritten history) ride along in ``Rollout.segments``. An engine failure met by a
call is the run's error, raised once the agent returns, not the episode's; an agent that raises otherwise ends its
episode as an environment error, as an `Environment` that raises does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sharpen.data import render_prompt
from sharpen.environments.base import AgentClient, AgentEnvironment, AgentResult, EpisodeLimits
from sharpen.rollout.agent_endpoint import AgentEndpoint
from sharpen.rollout.agent_session import AgentSession, Generate, Segment
from sharpen.types import Example, SamplingParams, TurnRecord

if TYPE_CHECKING:
    from sharpen.rollout.episode_state import EpisodeState

logger = logging.getLogger(__name__)


async def run_agent_episode(
    episode: EpisodeState,
    example: Example,
    *,
    endpoint: AgentEndpoint,
    generate: Generate,
    tokenizer: Any,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    seed_of: Callable[[int], int],
) -> None:
    """Run ``episode`` (whose environment is an `AgentEnvironment`) to its end and fill in its tokens and record."""
    environment = episode.environment
    assert isinstance(environment, AgentEnvironment)
    session = AgentSession(
        episode_id=f"{episode.example_index}-{episode.sample_index}",
        tokenizer=tokenizer,
        generate=generate,
        sampling=sampling,
        seed_of=seed_of,
        max_calls=limits.max_turns,
        max_tokens=limits.max_tokens,
    )
    key = endpoint.open(session)
    http = endpoint.http_client()
    client = AgentClient(base_url=endpoint.base_url, api_key=key, model=endpoint.model_name, http_client=http)
    started = time.monotonic()
    task = asyncio.ensure_future(environment.run_agent(example, episode.context, client))
    stop = ""
    try:
        stop = await _wait(task, episode, session, started=started)
    finally:
        endpoint.close(key)
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await http.aclose()
        episode.env_seconds += max(time.monotonic() - started - session.model_seconds, 0.0)
    if session.engine_error is not None:
        raise session.engine_error
    result = _result(task, episode, session, stop=stop)
    _fill(episode, example, session, result, tokenizer)


async def _wait(
    task: asyncio.Future[AgentResult], episode: EpisodeState, session: AgentSession, *, started: float
) -> str:
    """Wait for the agent; the stop reason if a time limit ended it first (empty if it returned)."""
    wall = episode.context.wall_seconds
    while not task.done():
        episode_left = episode.time_left()
        env_left = None if wall is None else wall - _environment_seconds(session, started)
        if env_left is not None and env_left <= 0:
            return "wall_clock"
        if episode_left is not None and episode_left <= 0:
            return "episode_timeout"
        timeouts = [t for t in (env_left, episode_left) if t is not None]
        await asyncio.wait({task}, timeout=min(timeouts) if timeouts else None)
    return ""


def _environment_seconds(session: AgentSession, started: float) -> float:
    """The agent's own time so far: elapsed minus model calls (a call in flight stops the clock)."""
    now = time.monotonic()
    in_flight = now - session.in_flight_since if session.in_flight_since is not None else 0.0
    return now - started - session.model_seconds - in_flight


def _result(
    task: asyncio.Future[AgentResult], episode: EpisodeState, session: AgentSession, *, stop: str
) -> AgentResult:
    if stop:
        return AgentResult(is_truncated=True, stop_reason=stop)
    error = task.exception()
    if error is None:
        result = task.result()
        if not isinstance(result, AgentResult):
            error = TypeError(f"run_agent returned {type(result).__name__}, not an AgentResult")
        else:
            return result
    if session.limit_reached:  # the agent's client raised on the refused call: the episode hit its limit
        return AgentResult(is_truncated=True, stop_reason=session.limit_reached)
    logger.warning("agent environment %s failed", episode.environment.name, exc_info=error)
    episode.record.error = repr(error)
    return AgentResult(is_truncated=True, stop_reason="environment_error")


def _fill(episode: EpisodeState, example: Example, session: AgentSession, result: AgentResult, tokenizer: Any) -> None:
    segments = session.segments()
    last_call = session.calls[-1] if session.calls else None
    main: Segment | None = next((s for s in segments if any(c is last_call for c in s.calls)), None)
    if main is None:  # no model call: an empty completion after the task's prompt
        episode.prompt_ids = render_prompt(tokenizer, example.prompt) if example.prompt else []
    else:
        episode.prompt_ids = main.prompt_ids
        episode.completion_ids, episode.logprobs = main.completion_ids, main.logprobs
        episode.versions, episode.loss_mask = main.versions, main.loss_mask
        episode.routes = main.routes()  # each call's tokens, from the first call that ran them
        episode.routes_lost = episode.routes is None
        episode.last_text = main.calls[-1].text
        episode.segments = [s for s in segments if s is not main]
    turns = _turn_records(session, segments)
    if not turns and result.reward is not None:
        turns.append(TurnRecord(action_text="", num_action_tokens=0, observation_ids=[]))
    if turns:
        turns[-1].reward = result.reward
        turns[-1].is_terminated = not result.is_truncated
        turns[-1].is_truncated = result.is_truncated
        turns[-1].info = {**turns[-1].info, **result.info}
    episode.record.turns.extend(turns)
    episode.end(result.stop_reason, is_truncated=result.is_truncated)


def _turn_records(session: AgentSession, segments: list[Segment]) -> list[TurnRecord]:
    """One record per model call, in call order; ``observation_ids`` are the tokens the agent added after the call
    within its segment (what the next call of the segment was conditioned on beyond it)."""
    added: dict[int, list[int]] = {}
    where: dict[int, int] = {}
    for index, segment in enumerate(segments):
        for call, following in zip(segment.calls, segment.calls[1:], strict=False):
            end = len(call.prompt_ids) + len(call.completion.token_ids)
            added[id(call)] = following.prompt_ids[end:]
        for call in segment.calls:
            where[id(call)] = index
    return [
        TurnRecord(
            action_text=call.text,
            num_action_tokens=len(call.completion.token_ids),
            observation_ids=added.get(id(call), []),
            info={"segment": where.get(id(call), 0)},
        )
        for call in session.calls
    ]
