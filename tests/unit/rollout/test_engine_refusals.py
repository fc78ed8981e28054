"""A request the engine refuses for its own input (a prompt past its context) ends that episode, not the run: in
both schedulings, with a batch engine (which refuses the whole batch, as vLLM's in-process engine does) and a
request-level one. SmolLM2's real tokenizer and chat template, the calculator environment."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from sharpen.environments import EpisodeLimits
from sharpen.environments.calculator import CalculatorEnvironment
from sharpen.rollout.engines.base import EngineInputError
from sharpen.rollout.engines.scripted import ScriptedEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Completion, Example, Message, Rollout, SamplingParams

TOOL_CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "12 + 7"}}</tool_call>'
ANSWER = "<answer>19</answer>"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


class ContextEngine(ScriptedEngine):
    """Calls the calculator on its first turn and answers once the prompt holds a tool call; refuses a batch that
    holds a prompt longer than ``context`` tokens as a whole (vLLM checks every request before it runs any)."""

    def __init__(self, tokenizer, context: int) -> None:
        super().__init__([ANSWER], encode=lambda t: tokenizer.encode(t, add_special_tokens=False))
        self.eos_token_id = tokenizer.eos_token_id
        self.tokenizer = tokenizer
        self.context = context
        self.prompt_lengths: list[int] = []
        """Of every prompt the engine generated for (not of those it refused)."""

    def _complete(self, prompt: list[int], params: SamplingParams) -> Completion:
        self.prompt_lengths.append(len(prompt))
        text = ANSWER if TOOL_CALL in self.tokenizer.decode(prompt) else TOOL_CALL
        ids = [*self.encode(text), self.eos_token_id]
        return Completion(token_ids=ids, logprobs=[-1.0] * len(ids), text=text, finish_reason="stop")

    def _check(self, prompt: list[int]) -> None:
        if len(prompt) > self.context:
            raise EngineInputError(f"a prompt of {len(prompt)} tokens is past the context of {self.context}")

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        for prompt in prompts:
            self._check(prompt)
        return [self._complete(prompt, p) for prompt, p in zip(prompts, params, strict=True)]


class AsyncContextEngine(ContextEngine):
    """The same, taking requests one at a time (an `AsyncEngine`, as vLLM's async engine and engine servers)."""

    async def generate_async(self, prompt: list[int], params: SamplingParams) -> Completion:
        self._check(prompt)
        completion = self._complete(prompt, params)
        return replace(completion, versions=[self.policy_version] * len(completion.token_ids))


def _example(name: str, words: int) -> Example:
    question = "12+7?" + " please" * words
    return Example(
        task_key=name,
        prompt=(Message(role="system", content="Answer in <answer></answer>."), Message(role="user", content=question)),
        answer="19",
    )


EXAMPLES = [_example("short", 0), _example("medium", 60), _example("long", 400)]


def _run(engine: ContextEngine, tokenizer, scheduling: str) -> dict[str, list[Rollout]]:
    runner = EpisodeRunner(
        tokenizer=tokenizer,
        make_environment=CalculatorEnvironment,
        limits=EpisodeLimits(max_turns=4),
        scheduling=scheduling,  # type: ignore[arg-type]
    )
    groups = runner.generate_groups(engine, EXAMPLES, sampling=SamplingParams(max_new_tokens=64), num_samples=2, seed=0)
    return {group.example.task_key: group.rollouts for group in groups}


@pytest.fixture(scope="module")
def lengths(tokenizer) -> dict[str, list[int]]:
    """The prompt lengths of each example's turns with no context limit."""
    out = {}
    for example in EXAMPLES:
        engine = ContextEngine(tokenizer, context=1 << 20)
        EpisodeRunner(
            tokenizer=tokenizer, make_environment=CalculatorEnvironment, limits=EpisodeLimits(max_turns=4)
        ).generate_groups(engine, [example], sampling=SamplingParams(max_new_tokens=64), num_samples=1, seed=0)
        out[example.task_key] = engine.prompt_lengths
    return out


@pytest.mark.parametrize(
    ("engine_class", "scheduling"),
    [(ContextEngine, "async"), (ContextEngine, "lockstep"), (AsyncContextEngine, "async")],
)
def test_a_prompt_past_the_context_ends_its_episode_and_the_others_go_on(
    tokenizer, lengths, engine_class, scheduling
) -> None:
    # the context fits the short episode's two turns and the medium one's first turn, not its second, nor the long
    # episode's first prompt
    context = lengths["medium"][0] + 1
    assert lengths["short"] == sorted(lengths["short"]) and lengths["short"][1] <= context
    assert lengths["medium"][1] > context and lengths["long"][0] > context
    engine = engine_class(tokenizer, context=context)
    rollouts = _run(engine, tokenizer, scheduling)

    for rollout in rollouts["short"]:  # untouched by the others' refusals
        assert rollout.episode is not None and rollout.episode.stop_reason == "terminated"
        assert len(rollout.episode.turns) == 2 and not rollout.episode.error
    for rollout in rollouts["medium"]:  # refused on its second turn: ends truncated with its first turn's tokens
        assert rollout.episode is not None and rollout.episode.stop_reason == "engine_refused"
        assert len(rollout.episode.turns) == 1 and rollout.num_loss_tokens > 0
        assert f"past the context of {context}" in (rollout.episode.error or "")
    for rollout in rollouts["long"]:  # refused at once: no tokens to train on
        assert rollout.episode is not None and rollout.episode.stop_reason == "engine_refused"
        assert rollout.episode.turns == [] and rollout.completion_ids == []
    # every prompt the engine generated for fit its context; short's two turns and medium's first, twice each
    assert all(n <= context for n in engine.prompt_lengths) and len(engine.prompt_lengths) == 6
