"""The multi-turn episode loop with SmolLM2's real tokenizer and chat template: exact token continuity, loss masks,
limits, environment failures, and the environment's reward reaching the `RewardResult`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from sharpen.config.schema import RewardConfig
from sharpen.environments import EpisodeContext, EpisodeLimits, StepResult
from sharpen.environments.calculator import CalculatorEnvironment
from sharpen.environments.guess_number import GuessNumberEnvironment
from sharpen.orchestration.phases import score_groups
from sharpen.rewards import Rubric
from sharpen.rollout.engines.scripted import ScriptedEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Completion, Example, Message, RewardStatus, SamplingParams

TOOL_CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "12 + 7"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def _engine(tokenizer, texts: list[str]) -> ScriptedEngine:
    engine = ScriptedEngine(
        texts, encode=lambda t: tokenizer.encode(t, add_special_tokens=False), eos_token_id=tokenizer.eos_token_id
    )
    requests: list[list[int]] = []
    generate = engine.generate

    def recording_generate(prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        requests.extend(prompts)
        return generate(prompts, params)

    engine.generate = recording_generate  # type: ignore[method-assign]
    engine.requests = requests  # type: ignore[attr-defined]
    return engine


def _example() -> Example:
    return Example(
        task_key="sum/0",
        prompt=(Message(role="system", content="Answer in <answer></answer>."), Message(role="user", content="12+7?")),
        answer="19",
        metadata={"source": "jsonl"},
    )


def test_tool_episode_training_tokens_are_exactly_what_the_engine_saw_and_made(tokenizer):
    engine = _engine(tokenizer, [TOOL_CALL, "<answer>19</answer>"])
    engine.policy_version = 5
    [group] = EpisodeRunner(
        tokenizer=tokenizer, make_environment=CalculatorEnvironment, limits=EpisodeLimits(max_turns=4)
    ).generate_groups(engine, [_example()], sampling=SamplingParams(max_new_tokens=64), num_samples=1, seed=0)
    [rollout] = group.rollouts
    tokens = rollout.prompt_ids + rollout.completion_ids
    first, second = engine.requests  # type: ignore[attr-defined]
    assert first == rollout.prompt_ids
    assert tokens[: len(second)] == second  # the second turn's context is a prefix of the training tokens
    generated_0 = [*tokenizer.encode(TOOL_CALL, add_special_tokens=False), tokenizer.eos_token_id]
    generated_1 = [*tokenizer.encode("<answer>19</answer>", add_special_tokens=False), tokenizer.eos_token_id]
    observation = rollout.episode.turns[0].observation_ids
    # training tokens == prompt + engine turn 0 + environment tokens + engine turn 1, token for token
    assert rollout.completion_ids == generated_0 + observation + generated_1
    assert second == first + generated_0 + observation
    assert rollout.loss_mask == [True] * len(generated_0) + [False] * len(observation) + [True] * len(generated_1)
    assert rollout.num_loss_tokens == len(generated_0) + len(generated_1)
    assert rollout.completion_logprobs[len(generated_0) : len(generated_0) + len(observation)] == [0.0] * len(
        observation
    )
    assert rollout.versions == [5] * len(rollout.completion_ids)
    # and nothing drifted: the tokens decode to the chat template's rendering of the whole conversation
    conversation = [
        {"role": "system", "content": CalculatorEnvironment().system_prompt(_example())},
        {"role": "user", "content": "12+7?"},
        {"role": "assistant", "content": TOOL_CALL},
        {"role": "tool", "content": "19"},
        {"role": "assistant", "content": "<answer>19</answer>"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(tokens) == rendered.removesuffix("\n")
    assert rollout.completion_text == "<answer>19</answer>"
    assert rollout.episode.stop_reason == "terminated" and not rollout.is_truncated
    assert next(t.info for t in rollout.episode.turns) == {
        "tool_calls": [{"name": "calculate", "arguments": {"expression": "12 + 7"}}]
    }
    score_groups(Rubric(RewardConfig()), [group])
    assert rollout.reward is not None and rollout.reward.score == 1.0  # the rubric scores the final answer


def test_single_turn_environment_reproduces_single_turn_rollouts(tokenizer):
    engine = _engine(tokenizer, ["<answer>19</answer>"])
    [group] = EpisodeRunner(tokenizer=tokenizer).generate_groups(
        engine, [_example()], sampling=SamplingParams(max_new_tokens=64), num_samples=2, seed=0
    )
    for rollout in group.rollouts:
        assert rollout.loss_mask is None
        assert rollout.num_loss_tokens == len(rollout.completion_ids)
        assert rollout.episode is not None and rollout.episode.environment == "single_turn"


def _run(tokenizer, texts, make_environment, limits, *, max_new_tokens=64, num_samples=1, example=None):
    [group] = EpisodeRunner(tokenizer=tokenizer, make_environment=make_environment, limits=limits).generate_groups(
        _engine(tokenizer, texts),
        [example or _example()],
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
        num_samples=num_samples,
        seed=0,
    )
    return group


@pytest.mark.parametrize(
    ("limits", "max_new_tokens", "reason"),
    [
        (EpisodeLimits(max_turns=2), 64, "max_turns"),
        (EpisodeLimits(max_turns=9, max_tokens=60), 64, "max_tokens"),
        (EpisodeLimits(max_turns=9), 5, "length"),
    ],
)
def test_limits_end_the_episode_as_truncated(tokenizer, limits, max_new_tokens, reason):
    group = _run(tokenizer, [TOOL_CALL], CalculatorEnvironment, limits, max_new_tokens=max_new_tokens)
    [rollout] = group.rollouts
    assert rollout.episode.stop_reason == reason and rollout.is_truncated
    assert len(rollout.completion_ids) <= limits.max_tokens
    if reason == "max_turns":
        assert len(rollout.episode.turns) == 2


def test_the_tool_call_cap_truncates(tokenizer):
    make = lambda: CalculatorEnvironment(max_tool_calls=2)  # noqa: E731
    [rollout] = _run(tokenizer, [TOOL_CALL], make, EpisodeLimits(max_turns=9)).rollouts
    assert rollout.episode.stop_reason == "max_tool_calls"
    assert len(rollout.episode.turns) == 3


class _Broken:
    name = "broken"
    version = "0"

    def __init__(self, *, fail_in: str, delay: float = 0.0) -> None:
        self.fail_in, self.delay = fail_in, delay

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        if self.fail_in == "reset":
            raise RuntimeError("boom in reset")
        return list(example.prompt)

    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(self.delay)
        if self.fail_in == "step":
            raise RuntimeError("boom in step")
        return StepResult(observation=[Message(role="user", content="again")])


@pytest.mark.parametrize(
    ("fail_in", "delay", "reason", "status"),
    [
        ("reset", 0.0, "environment_error", RewardStatus.INFRA_ERROR),
        ("step", 0.0, "environment_error", RewardStatus.INFRA_ERROR),
        ("never", 0.3, "wall_clock", RewardStatus.TIMEOUT),
    ],
)
def test_a_broken_or_slow_environment_ends_its_episode_and_abstains(tokenizer, fail_in, delay, reason, status):
    limits = EpisodeLimits(max_turns=9, wall_seconds=0.5)
    group = _run(tokenizer, ["<answer>19</answer>"], lambda: _Broken(fail_in=fail_in, delay=delay), limits)
    [rollout] = group.rollouts
    assert rollout.episode.stop_reason == reason
    score_groups(Rubric(RewardConfig()), [group])
    assert rollout.reward is not None and rollout.reward.score is None and rollout.reward.status == status
    if fail_in != "never":
        assert "boom" in rollout.episode.error


def test_environment_rewards_score_the_episode_and_a_group_plays_one_game(tokenizer):
    [example] = GuessNumberEnvironment.make_tasks(1, seed=3, low=1, high=16)
    secret = int(example.answer or 0)
    guesses = [str(g) for g in range(1, 17)]  # each sample guesses upwards from 1
    group = _run(tokenizer, guesses, GuessNumberEnvironment, EpisodeLimits(max_turns=16), example=example)
    [rollout] = group.rollouts
    assert [t.action_text for t in rollout.episode.turns] == guesses[:secret]
    assert "higher" in tokenizer.decode(rollout.episode.turns[0].observation_ids) or secret == 1
    score_groups(Rubric(RewardConfig()), [group])
    assert rollout.reward is not None and rollout.reward.score == 1.0
    assert rollout.reward.verifier == "environment:guess_number"
    short = _run(tokenizer, ["1"], GuessNumberEnvironment, EpisodeLimits(max_turns=1), example=example)
    score_groups(Rubric(RewardConfig()), [short])
    assert short.rollouts[0].reward.score == (1.0 if secret == 1 else 0.0)  # type: ignore[union-attr]


def test_episode_seeds_depend_on_task_and_sample_not_on_batching(tokenizer):
    group = _run(tokenizer, ["<answer>1</answer>"], CalculatorEnvironment, EpisodeLimits(max_turns=2), num_samples=3)
    seeds = [r.episode.seed for r in group.rollouts]
    assert len(set(seeds)) == 3
    again = _run(tokenizer, ["<answer>1</answer>"], CalculatorEnvironment, EpisodeLimits(max_turns=2), num_samples=3)
    assert [r.episode.seed for r in again.rollouts] == seeds
    json.dumps([t.info for r in group.rollouts for t in r.episode.turns])  # records are JSON-serialisable


def test_an_episode_keeps_each_token_route_from_the_first_call_that_ran_it(tokenizer):
    """A Mixture-of-Experts engine's routes (R3) through a two-turn episode: each call returns routes for its whole
    context and what it generated (its last token unknown); the rollout keeps each token's from the first call that
    ran it, here marked by the call's number."""
    import torch

    from sharpen.expert_routes import UNROUTED, expert_routes, routes_tensor

    engine = _engine(tokenizer, [TOOL_CALL, "<answer>19</answer>"])
    generate = engine.generate
    calls = []

    def with_routes(prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        completions = generate(prompts, params)
        for prompt, completion in zip(prompts, completions, strict=True):
            marks = torch.full((len(prompt) + len(completion.token_ids), 1, 2), len(calls), dtype=torch.long)
            marks[-1] = UNROUTED  # the last sampled token never ran
            completion.routes = expert_routes(marks, num_experts=8)
        calls.append(prompts)
        return completions

    engine.generate = with_routes  # type: ignore[method-assign]
    [group] = EpisodeRunner(
        tokenizer=tokenizer, make_environment=CalculatorEnvironment, limits=EpisodeLimits(max_turns=4)
    ).generate_groups(engine, [_example()], sampling=SamplingParams(max_new_tokens=64), num_samples=1, seed=0)
    [rollout] = group.rollouts
    assert rollout.routes is not None and len(calls) == 2
    marks = routes_tensor(rollout.routes)[:, 0, 0].tolist()
    first_call = len(calls[0][0]) + rollout.loss_mask.index(False) - 1  # the prompt and turn 0 but its last token
    assert len(marks) == rollout.num_tokens
    assert marks == [0] * first_call + [1] * (rollout.num_tokens - first_call - 1) + [UNROUTED]
