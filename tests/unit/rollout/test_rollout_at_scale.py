"""Episodes at scale, step by step as `benchmarks/million_episodes.py` runs a million: thousands of multi-turn tool
episodes, scored by the rubric, make the same episode digest at any concurrency, scheduling or kind of engine (and
another one when a single token differs), and memory does not grow from step to step."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import pytest

from sharpen.config.rewards import RewardConfig
from sharpen.environments import EpisodeLimits
from sharpen.environments.calculator import CalculatorEnvironment
from sharpen.monitoring import EpisodeDigest
from sharpen.orchestration.phases import score_groups
from sharpen.rewards import Rubric
from sharpen.rewards.verifiers import ExactMatchVerifier
from sharpen.rollout.engines.scripted import AsyncSeededScriptedEngine, SeededScriptedEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.testing import ByteChatTokenizer
from sharpen.types import Example, Message, RolloutGroup, SamplingParams

TURNS = [
    '<tool_call>{"name": "calculate", "arguments": {"expression": "6 * 7"}}</tool_call>',
    '<tool_call>{"name": "calculate", "arguments": {"expression": "1 / 0"}}</tool_call>',
    "Let me check once more.",
    "The product is <answer>42</answer>",
    "<answer>41</answer>",
]
TOKENIZER = ByteChatTokenizer()


def tasks(step: int, num: int) -> list[Example]:
    return [
        Example(
            task_key=f"calc/{step}/{i}",
            prompt=(Message(role="user", content=f"What is {6 + i % 3} * 7?"),),
            answer=str((6 + i % 3) * 7),
            metadata={"source": "exact_match"},
        )
        for i in range(num)
    ]


def run_steps(
    *,
    num_steps: int,
    num_groups: int,
    num_samples: int = 8,
    scheduling: str = "async",
    max_concurrent: int = 0,
    request_level: bool = False,
    turns: list[str] = TURNS,
    after_step: Callable[[int], None] = lambda step: None,
    on_group: Callable[[RolloutGroup], None] = lambda group: None,
) -> tuple[str, int]:
    """The digest of ``num_steps`` steps of ``num_groups`` x ``num_samples`` calculator episodes, and the turns."""
    if request_level:  # each request on its own, answered after up to 1 ms: out of order
        engine = AsyncSeededScriptedEngine(
            turns, encode=TOKENIZER.encode, eos_token_id=TOKENIZER.eos_token_id, max_delay_s=0.001
        )
    else:
        engine = SeededScriptedEngine(turns, encode=TOKENIZER.encode, eos_token_id=TOKENIZER.eos_token_id)
    runner = EpisodeRunner(
        tokenizer=TOKENIZER,
        make_environment=CalculatorEnvironment,
        limits=EpisodeLimits(max_turns=4, max_tokens=1024),
        scheduling=scheduling,  # type: ignore[arg-type]
        max_concurrent=max_concurrent,
    )
    rubric = Rubric(RewardConfig(), verifiers={"exact_match": ExactMatchVerifier()})

    def score(group: RolloutGroup) -> None:
        score_groups(rubric, [group])
        on_group(group)

    digest, num_turns = EpisodeDigest(), 0
    for step in range(num_steps):
        groups = runner.generate_groups(
            engine,
            tasks(step, num_groups),
            sampling=SamplingParams(max_new_tokens=128),
            num_samples=num_samples,
            seed=f"0/{step}",
            on_group=score,
        )
        rollouts = [r for g in groups for r in g.rollouts]
        digest.add_step(step, rollouts)
        num_turns += sum(len(r.episode.turns) for r in rollouts if r.episode is not None)
        del groups, rollouts
        after_step(step)
    assert digest.num_rollouts == num_steps * num_groups * num_samples
    return digest.hexdigest, num_turns


def test_thousands_of_episodes_make_one_digest_at_any_concurrency_scheduling_or_engine() -> None:
    size = {"num_steps": 5, "num_groups": 50}  # 2,000 episodes
    reference, num_turns = run_steps(**size, scheduling="lockstep")
    assert num_turns > 1.5 * 2_000, "many episodes are multi-turn"
    assert run_steps(**size, max_concurrent=8)[0] == reference
    assert run_steps(**size, max_concurrent=0)[0] == reference
    assert run_steps(**size, max_concurrent=64, request_level=True)[0] == reference
    one_token = [TURNS[0].replace("6 * 7", "6 * 8"), *TURNS[1:]]  # one byte: one token of the byte tokenizer
    assert run_steps(**size, max_concurrent=64, turns=one_token)[0] != reference


def traced_growth(**options) -> tuple[int, int]:
    """Growth of traced Python memory (bytes) and of live gc-tracked objects from step 3 to step 23 of a run."""
    marks: dict[int, tuple[int, int]] = {}

    def measure(step: int) -> None:
        if step in (3, 23):
            gc.collect()
            marks[step] = (tracemalloc.get_traced_memory()[0], len(gc.get_objects()))

    tracemalloc.start()
    try:
        run_steps(num_steps=24, num_groups=8, num_samples=4, after_step=measure, **options)
    finally:
        tracemalloc.stop()
    return marks[23][0] - marks[3][0], marks[23][1] - marks[3][1]


MAX_GROWTH_BYTES = 64 << 10
"""Allowed from step 3 to step 23 (640 episodes): interpreter caches that settle. Keeping one token list per group
(about 1-2 KB each) would add some 300 KB, one small object per episode some 30 KB and 640 objects."""


@pytest.mark.parametrize(
    "options",
    [{"max_concurrent": 8}, {"max_concurrent": 0, "request_level": True}, {"scheduling": "lockstep"}],
    ids=["async-batch", "async-request", "lockstep"],
)
def test_memory_does_not_grow_from_step_to_step(options: dict) -> None:
    num_bytes, num_objects = traced_growth(**options)
    assert num_bytes < MAX_GROWTH_BYTES and num_objects < 64, (num_bytes, num_objects)


def test_the_memory_check_sees_a_leak_of_one_token_list_per_group() -> None:
    kept: list[list[int]] = []
    num_bytes, num_objects = traced_growth(
        max_concurrent=8, on_group=lambda g: kept.append(g.rollouts[0].completion_ids)
    )
    # 160 kept lists (8 groups x 20 steps), less what other objects may net over the same steps: the count that the
    # leak-free runs above stay under (a clean-clone run saw 159: one interpreter object freed between the marks)
    assert num_bytes > MAX_GROWTH_BYTES and num_objects > 8 * 20 - 64, (num_bytes, num_objects)
