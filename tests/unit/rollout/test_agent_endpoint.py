"""The agent endpoint with the real `openai` client and SmolLM2's tokenizer and chat template: agents drive episodes,
the training tokens are exactly the engine's, a rewritten history becomes separate segments, and bad requests get
one clear HTTP error."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sharpen.environments import AgentClient, AgentResult, EpisodeContext, EpisodeLimits
from sharpen.rollout.agent_endpoint import AgentEndpoint
from sharpen.rollout.agent_session import AgentSession
from sharpen.rollout.engines.base import EngineError
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Completion, Example, Message, SamplingParams, with_segments
from support.recording_engine import RecordingEngine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def _example() -> Example:
    return Example(task_key="add/0", prompt=(Message(role="user", content="What is 2 + 3?"),), answer="5")


def _client(client: AgentClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)


def _run(tokenizer, engine, agent_class, *, max_turns: int = 4, num_samples: int = 1, **options) -> Any:
    runner = EpisodeRunner(
        tokenizer=tokenizer, make_environment=agent_class, limits=EpisodeLimits(max_turns=max_turns), **options
    )
    sampling = SamplingParams(max_new_tokens=64)
    return runner.generate_groups(engine, [_example()], sampling=sampling, num_samples=num_samples, seed=0)


class ToolAgent:
    """Asks, runs the tool the model called, and asks again with the tool's result (the OpenAI tool loop)."""

    name = "tool_agent"
    version = "1"

    async def run_agent(self, example: Example, ctx: EpisodeContext, client: AgentClient) -> AgentResult:
        api = _client(client)
        messages: list[dict[str, Any]] = [{"role": m.role, "content": m.content} for m in example.prompt]
        while True:
            response = await api.chat.completions.create(model=client.model, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return AgentResult(reward=float("5" in (message.content or "")), info={"num_messages": len(messages)})
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])}
                )


def test_a_tool_episode_through_the_openai_client_trains_on_exactly_the_engines_tokens(tokenizer):
    engine = RecordingEngine(tokenizer, [TOOL_CALL, "The answer is 5."])
    [group] = _run(tokenizer, engine, ToolAgent)
    [rollout] = group.rollouts
    (first_prompt, first), (second_prompt, second) = engine.served
    observation = second_prompt[len(first_prompt) + len(first.token_ids) :]
    assert rollout.prompt_ids == first_prompt
    assert second_prompt[: len(first_prompt) + len(first.token_ids)] == first_prompt + first.token_ids
    assert rollout.completion_ids == first.token_ids + observation + second.token_ids
    assert rollout.loss_mask == [True] * len(first.token_ids) + [False] * len(observation) + [True] * len(
        second.token_ids
    )
    assert rollout.completion_logprobs == first.logprobs + [0.0] * len(observation) + second.logprobs
    assert rollout.segments == []
    # the tool's answer reached the model as the chat template renders a tool message, after the model's own tokens
    assert tokenizer.decode(observation) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert rollout.episode.stop_reason == "terminated"
    assert rollout.episode.env_reward == 1.0
    assert [t.num_action_tokens for t in rollout.episode.turns] == [len(first.token_ids), len(second.token_ids)]
    assert rollout.episode.turns[0].observation_ids == observation
    assert rollout.completion_text == "The answer is 5."


def test_the_docs_agent_runs_all_its_calls_with_a_custom_environment_default_limits(tokenizer):
    """The tool agent of docs/agents.md makes two calls; a custom environment's default turn limit lets it (a limit of
    one refused its second call and truncated every episode, silently)."""
    from sharpen.config.environments import CustomEnvironmentConfig
    from sharpen.environments.registry import episode_limits

    limits = episode_limits(CustomEnvironmentConfig(factory="agents.py:ToolAgent"))
    engine = RecordingEngine(tokenizer, [TOOL_CALL, "The answer is 5."])
    runner = EpisodeRunner(tokenizer=tokenizer, make_environment=ToolAgent, limits=limits)
    sampling = SamplingParams(max_new_tokens=64)
    [rollout] = runner.generate_groups(engine, [_example()], sampling=sampling, num_samples=1, seed=0)[0].rollouts
    assert len(engine.served) == 2 and not rollout.is_truncated
    assert rollout.episode.stop_reason == "terminated"


class RewritingAgent:
    """Asks, then asks again with a summary instead of the earlier exchange (a context-managing agent)."""

    name = "rewriting_agent"
    version = "1"

    async def run_agent(self, example: Example, ctx: EpisodeContext, client: AgentClient) -> AgentResult:
        api = _client(client)
        first = await api.chat.completions.create(
            model=client.model, messages=[{"role": "user", "content": "Plan: what is 2 + 3?"}]
        )
        plan = first.choices[0].message.content
        await api.chat.completions.create(
            model=client.model, messages=[{"role": "user", "content": f"Earlier you planned: {plan}. Answer now."}]
        )
        return AgentResult(reward=1.0)


def test_an_agent_that_rewrites_its_history_yields_separate_segments_not_drift(tokenizer):
    engine = RecordingEngine(tokenizer, ["Add them.", "5"])
    [group] = _run(tokenizer, engine, RewritingAgent)
    [rollout] = group.rollouts
    (first_prompt, first), (second_prompt, second) = engine.served
    assert second_prompt[: len(first_prompt)] != first_prompt  # the second call does not continue the first
    [earlier] = rollout.segments
    assert (earlier.prompt_ids, earlier.completion_ids) == (first_prompt, first.token_ids)
    assert (rollout.prompt_ids, rollout.completion_ids) == (second_prompt, second.token_ids)
    assert earlier.completion_logprobs == first.logprobs and earlier.reward is None
    rollout.advantage = 0.5
    trained = with_segments([rollout])
    assert trained == [earlier, rollout] and earlier.advantage == 0.5
    assert [t.info["segment"] for t in rollout.episode.turns] == [0, 1]


class RoutingEngine(RecordingEngine):
    """A Mixture-of-Experts engine's routes (R3) on every completion: its whole context and what it generated, each
    token marked by the call's number, the last sampled token unknown."""

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        import torch

        from sharpen.expert_routes import UNROUTED, expert_routes

        call = len(self.served)
        completions = super().generate(prompts, params)
        for prompt, completion in zip(prompts, completions, strict=True):
            marks = torch.full((len(prompt) + len(completion.token_ids), 1, 2), call, dtype=torch.long)
            marks[-1] = UNROUTED
            completion.routes = expert_routes(marks, num_experts=8)
        return completions


def test_an_agent_episode_keeps_each_token_route_from_the_first_call_that_ran_it(tokenizer):
    from sharpen.expert_routes import UNROUTED, routes_tensor

    engine = RoutingEngine(tokenizer, [TOOL_CALL, "The answer is 5."])
    [rollout] = _run(tokenizer, engine, ToolAgent)[0].rollouts
    (first_prompt, first), _ = engine.served
    assert rollout.routes is not None
    marks = routes_tensor(rollout.routes)[:, 0, 0].tolist()
    ran_first = len(first_prompt) + len(first.token_ids) - 1  # the first call's context and tokens but its last
    assert marks == [0] * ran_first + [1] * (rollout.num_tokens - ran_first - 1) + [UNROUTED]
    # an agent that rewrote its history: each segment has its own call's routes
    engine = RoutingEngine(tokenizer, ["Add them.", "5"])
    [rollout] = _run(tokenizer, engine, RewritingAgent)[0].rollouts
    [earlier] = rollout.segments
    for segment, call in ((earlier, 0), (rollout, 1)):
        assert segment.routes is not None
        assert routes_tensor(segment.routes)[:, 0, 0].tolist() == [call] * (segment.num_tokens - 1) + [UNROUTED]


class CompletionsAgent:
    """The legacy completions API: the second prompt is the first prompt, the completion and more text."""

    name = "completions_agent"
    version = "1"

    async def run_agent(self, example: Example, ctx: EpisodeContext, client: AgentClient) -> AgentResult:
        api = _client(client)
        prompt = "Q: 2 + 3 = "
        first = await api.completions.create(model=client.model, prompt=prompt, logprobs=1)
        assert first.choices[0].logprobs is not None and first.choices[0].logprobs.token_logprobs
        prompt += first.choices[0].text + "\nQ: and 3 + 4 = "
        await api.completions.create(model=client.model, prompt=prompt)
        return AgentResult()


def test_the_completions_api_continues_the_previous_calls_tokens(tokenizer):
    engine = RecordingEngine(tokenizer, [" 5", " 7"])
    [group] = _run(tokenizer, engine, CompletionsAgent)
    [rollout] = group.rollouts
    (first_prompt, first), (second_prompt, second) = engine.served
    added = second_prompt[len(first_prompt) + len(first.token_ids) :]
    assert second_prompt == first_prompt + first.token_ids + added  # the model's tokens kept, not re-tokenised
    assert rollout.completion_ids == first.token_ids + added + second.token_ids
    assert tokenizer.decode(added) == "\nQ: and 3 + 4 = "
    assert rollout.segments == []
    assert rollout.episode.env_reward is None  # the run's reward function scores it


class StreamingAgent:
    """Agent frameworks that always stream (verifiers): the whole answer arrives as an OpenAI event stream."""

    name = "streaming_agent"
    version = "1"

    async def run_agent(self, example: Example, ctx: EpisodeContext, client: AgentClient) -> AgentResult:
        api = client.openai_client()
        messages: list[dict[str, Any]] = [{"role": m.role, "content": m.content} for m in example.prompt]
        stream = await api.chat.completions.create(
            model=client.model,
            messages=messages,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},  # type: ignore[arg-type]
        )
        chunks = [chunk async for chunk in stream]
        calls = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or []]
        finish = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
        usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
        return AgentResult(
            info={
                "calls": [c.function.name for c in calls],
                "finish": finish,  # type: ignore[union-attr]
                "completion_tokens": usage[0].completion_tokens,
            }
        )


def test_a_streamed_call_gets_the_whole_answer_as_an_openai_event_stream(tokenizer):
    engine = RecordingEngine(tokenizer, [TOOL_CALL])
    [group] = _run(tokenizer, engine, StreamingAgent)
    info = group.rollouts[0].episode.turns[-1].info
    [(_, completion)] = engine.served
    assert info["calls"] == ["add"] and info["finish"] == ["tool_calls"]
    assert info["completion_tokens"] == len(completion.token_ids)


class LoopingAgent:
    """Calls the model until the endpoint refuses (the episode's turn limit)."""

    name = "looping_agent"
    version = "1"

    async def run_agent(self, example: Example, ctx: EpisodeContext, client: AgentClient) -> AgentResult:
        api = _client(client)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Count."}]
        while True:
            response = await api.chat.completions.create(model=client.model, messages=messages)  # type: ignore[arg-type]
            messages += [response.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "+1"}]


def test_the_turn_limit_ends_an_agent_episode_as_truncated(tokenizer):
    engine = RecordingEngine(tokenizer, ["1"])
    [group] = _run(tokenizer, engine, LoopingAgent, max_turns=3)
    [rollout] = group.rollouts
    assert len(engine.served) == 3 and len(rollout.episode.turns) == 3
    assert rollout.episode.stop_reason == "max_turns" and rollout.is_truncated
    assert rollout.segments == []  # one conversation, continued each time


class FailingAgent:
    name = "failing_agent"
    version = "1"

    async def run_agent(self, example: Example, ctx: EpisodeContext, client: AgentClient) -> AgentResult:
        raise RuntimeError("the agent's own bug")


def test_an_agent_that_raises_ends_its_episode_as_an_environment_error(tokenizer):
    [group] = _run(tokenizer, RecordingEngine(tokenizer, ["x"]), FailingAgent)
    [rollout] = group.rollouts
    assert rollout.episode.stop_reason == "environment_error" and "the agent's own bug" in rollout.episode.error
    assert rollout.completion_ids == []


class BrokenEngine(RecordingEngine):
    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        raise EngineError("engine replica 0 is gone")


def test_an_engine_failure_during_an_agent_call_is_the_runs_error(tokenizer):
    with pytest.raises(EngineError, match="engine replica 0 is gone"):
        _run(tokenizer, BrokenEngine(tokenizer, ["x"]), ToolAgent)


class SlowAgent:
    name = "slow_agent"
    version = "1"

    async def run_agent(self, example: Example, ctx: EpisodeContext, client: AgentClient) -> AgentResult:
        await asyncio.sleep(30)
        return AgentResult(reward=1.0)


def test_an_agent_past_the_episode_timeout_is_ended_where_it_is(tokenizer):
    [group] = _run(tokenizer, RecordingEngine(tokenizer, ["x"]), SlowAgent, episode_timeout_s=0.2)
    assert group.rollouts[0].episode.stop_reason == "episode_timeout" and group.rollouts[0].is_truncated


def test_agent_episodes_need_async_scheduling(tokenizer):
    with pytest.raises(ValueError, match="episode_scheduling = 'async'"):
        _run(tokenizer, RecordingEngine(tokenizer, ["x"]), ToolAgent, scheduling="lockstep")


def test_bad_requests_get_one_clear_http_error(tokenizer):
    async def scenario() -> list[tuple[int, str]]:
        engine = RecordingEngine(tokenizer, ["hi"])

        async def generate(ids: list[int], params: SamplingParams):
            (completion,) = engine.generate([ids], [params])
            return completion, 0

        session = AgentSession(
            episode_id="0-0",
            tokenizer=tokenizer,
            generate=generate,
            sampling=SamplingParams(max_new_tokens=8),
            seed_of=lambda call: call,
            max_calls=4,
            max_tokens=64,
        )
        async with AgentEndpoint() as endpoint, httpx.AsyncClient(base_url=endpoint.base_url) as http:
            key = endpoint.open(session)
            auth = {"authorization": f"Bearer {key}"}
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            answers = [
                await http.post("/chat/completions", json=chat),
                await http.post("/chat/completions", json=chat, headers={"authorization": "Bearer sk-nope"}),
                await http.post("/chat/completions", content=b"{not json", headers=auth),
                await http.post("/chat/completions", json={**chat, "n": 2}, headers=auth),
                await http.post("/chat/completions", json={"model": "m", "messages": [{"role": "x"}]}, headers=auth),
                await http.post("/chat/completions", json={**chat, "stop": ["\n"]}, headers=auth),
                await http.post("/embeddings", json=chat, headers=auth),
                await http.post("/chat/completions", json=chat, headers=auth),
            ]
            endpoint.close(key)
            answers.append(await http.post("/chat/completions", json=chat, headers=auth))
        out = []
        for answer in answers:
            assert answer.headers["content-type"] == "application/json"
            out.append((answer.status_code, answer.json()["error"]["message"] if answer.status_code != 200 else ""))
        return out

    results = asyncio.run(scenario())
    assert [status for status, _ in results] == [401, 401, 400, 400, 400, 400, 404, 200, 410]
    messages = [message for _, message in results]
    assert "no API key" in messages[0] and "unknown API key" in messages[1]
    assert "not JSON" in messages[2] and "n = 1" in messages[3] and "messages[0]" in messages[4]
    assert "'stop' strings" in messages[5] and "no route POST /v1/embeddings" in messages[6]
    assert "has ended" in messages[8]
