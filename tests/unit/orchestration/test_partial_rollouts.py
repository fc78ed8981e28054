"""Partial rollouts (`orchestration/batches/partial.py`) with an engine whose completion lengths are set per prompt:
which groups close a batch and which are carried, each token's version, that carried tokens are never generated
twice, the bound on steps spanned, a checkpoint round trip, and the config's refusals. The expected batches are
worked out by hand in each test's comments (4 tokens per round)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from sharpen.config import ConfigError, load_config
from sharpen.environments.base import EpisodeContext, EpisodeLimits, StepResult
from sharpen.monitoring import PhaseTimer
from sharpen.orchestration.batches import GroupCollector, PartialCollector, load_pending, save_pending
from sharpen.orchestration.batches.base import ProducedBatch, with_carried
from sharpen.orchestration.batches.partial import CarriedGroup
from sharpen.orchestration.batches.weights import PartialCompletion
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.testing import ByteChatTokenizer
from sharpen.types import Completion, Example, Message, RewardResult, RewardStatus, SamplingParams

TOKENIZER = ByteChatTokenizer()
FILL = TOKENIZER.encode("x")[0]
LENGTHS = [2, 12, 3, 16, 5, 6, 7, 8, 9, 10]
"""Completion length of example i (its prompt says ``len=<n>``)."""


class LengthEngine:
    """Answers a request with ``x`` tokens until the completion has the length its prompt names (then "stop"); it
    knows nothing of earlier calls, so a resumed request must bring its tokens so far. Logs what it generated."""

    def __init__(self) -> None:
        self.policy_version = 0
        self.generated: dict[int, int] = {}  # target length -> tokens generated for it, over all requests

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        out = []
        for prompt, param in zip(prompts, params, strict=True):
            done = 0
            while prompt[len(prompt) - 1 - done] == FILL:
                done += 1
            match = re.search(r"len=(\d+)", TOKENIZER.decode(prompt[: len(prompt) - done]))
            assert match is not None
            target = int(match.group(1))
            num = min(param.max_new_tokens, target - done)
            self.generated[target] = self.generated.get(target, 0) + num
            out.append(
                Completion(
                    token_ids=[FILL] * num,
                    logprobs=[-0.5] * num,
                    text="x" * num,
                    finish_reason="stop" if done + num == target else "length",
                )
            )
        return out

    def score(self, token_ids: list[int]) -> list[float]:
        return [-0.5] * (len(token_ids) - 1)

    def load_weights(self, weights: Any, *, version: int) -> dict[str, float]:
        self.policy_version = version
        return {}

    def close(self) -> None:
        pass


class InOrderSampler:
    """The examples in their order, round and round (the checks below follow which example comes when)."""

    def __init__(self, examples: list[Example]) -> None:
        self.examples = examples
        self.position = 0

    def next_batch(self, num: int) -> list[Example]:
        batch = [self.examples[(self.position + i) % len(self.examples)] for i in range(num)]
        self.position += num
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}


def score_length(example: Example, completion: str) -> RewardResult:
    return RewardResult(score=float(len(completion)), status=RewardStatus.OK, components={}, verifier="test")


EXAMPLES = [
    Example(task_key=f"t/{i}", prompt=(Message(role="user", content=f"len={n}"),)) for i, n in enumerate(LENGTHS)
]


def partial_config(*overrides: str) -> Any:
    return load_config(
        None,
        [
            'rollout.engine.type="hf"',
            "rollout.prompts_per_step=2",
            "rollout.num_samples_per_prompt=2",
            "rollout.max_new_tokens=16",
            "trainer.micro_batch_size=2",
            "rollout.partial.enabled=true",
            "rollout.partial.extra_prompts=2",
            "rollout.partial.chunk_tokens=4",
            *overrides,
        ],
    )


class TwoTurnsEnvironment:
    """Two turns an episode: the first answered with "again", the second ends it; the reward (step rewards, so the
    rubric is not asked) is the number of characters of the two answers. Its state is plain data, as
    rollout.partial needs: the turns taken and the answers so far."""

    name = "two_turns"
    version = "1"

    def __init__(self) -> None:
        self.answers: list[str] = []

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        self.answers = []
        return list(example.prompt)

    async def step(self, action: str) -> StepResult:
        self.answers.append(action)
        if len(self.answers) == 2:
            return StepResult(reward=float(sum(map(len, self.answers))), terminated=True)
        return StepResult(observation=[Message(role="user", content="again")], reward=0.0)


TWO_TURNS = EpisodeRunner(
    tokenizer=TOKENIZER, make_environment=TwoTurnsEnvironment, limits=EpisodeLimits(max_turns=2, max_tokens=256)
)


def collector(
    config: Any,
    *,
    position: int = 0,
    pending: list[ProducedBatch] | None = None,
    runner: EpisodeRunner | None = None,
) -> PartialCollector:
    sampler = InOrderSampler(EXAMPLES)
    sampler.position = position
    inner = GroupCollector(
        config,
        runner=runner or EpisodeRunner(tokenizer=TOKENIZER),
        rubric=score_length,  # pyright: ignore[reportArgumentType]
        sampler=sampler,  # pyright: ignore[reportArgumentType]
    )
    return PartialCollector(inner, pending=pending or [])


def run_steps(maker: PartialCollector, engine: LengthEngine, steps: range) -> list[ProducedBatch]:
    batches = []
    for step in steps:
        engine.policy_version = step  # sync mode: the engine holds the weights of the step
        batches.append(maker.collect(engine, step=step, timer=PhaseTimer()))
    return batches


def lengths(batch: ProducedBatch) -> list[int]:
    return [int(g.example.prompt[0].content.removeprefix("len=")) for g in batch.groups]  # pyright: ignore


def test_the_batch_closes_when_full_and_unfinished_groups_go_on_from_their_tokens() -> None:
    engine = LengthEngine()
    maker = collector(partial_config("rollout.partial.max_steps_spanned=3"))
    first, second, third = run_steps(maker, engine, range(3))
    # step 0: lengths 2, 12, 3, 16 in flight; after one round (4 tokens) 2 and 3 are complete: the batch is full;
    # 12 and 16 are carried with 4 tokens of version 0
    assert lengths(first) == [2, 3]
    assert first.metrics["partial/num_rounds"] == 1
    assert first.metrics["partial/num_carried_groups"] == 2
    assert first.metrics["partial/num_carried_tokens"] == 2 * (4 + 4)
    # step 1: 12, 16 carried, 5, 6 drawn; round 1: 8/12, 8/16, 4/5, 4/6; round 2: 12 done, 12/16, 5 and 6 done;
    # oldest complete first: 12 (drawn at step 0), then 5; 16 (unfinished) and 6 (complete) are carried
    assert lengths(second) == [12, 5]
    assert second.metrics["partial/num_rounds"] == 2
    assert second.metrics["partial/num_resumed_groups"] == 1
    resumed = second.groups[0].rollouts[0]
    assert resumed.completion_ids == [FILL] * 12 and resumed.versions == [0] * 4 + [1] * 8
    assert resumed.completion_text == "x" * 12 and not resumed.is_truncated
    assert second.groups[0].scores == [12.0, 12.0]
    # generated tokens of the batch: 2 x (12 + 5), of which 2 x 4 by version 0
    assert second.metrics["partial/older_policy_token_share"] == pytest.approx(8 / 34)
    # step 2: 16 (4 tokens v0, 8 v1) and 6 (complete, v1) carried, 7 and 8 drawn; one round finishes 16
    assert lengths(third) == [16, 6]
    assert third.groups[0].rollouts[1].versions == [0] * 4 + [1] * 8 + [2] * 4
    assert third.groups[1].rollouts[0].versions == [1] * 6
    assert third.metrics["partial/older_policy_token_share"] == pytest.approx((12 + 6) / (16 + 6))
    assert third.metrics["partial/max_steps_spanned"] == 3
    # every episode's tokens were generated exactly once, carried or not (7 and 8 are in flight with 4 each)
    assert engine.generated == {n: 2 * n for n in [2, 3, 12, 16, 5, 6]} | {7: 2 * 4, 8: 2 * 4}


def test_a_group_at_its_last_allowed_step_holds_the_batch_open() -> None:
    engine = LengthEngine()
    maker = collector(partial_config("rollout.partial.max_steps_spanned=2"))
    first, second = run_steps(maker, engine, range(2))
    assert lengths(first) == [2, 3]
    # step 1: 12 and 16 (drawn at step 0) must be in this batch; after round 2 (12, 5, 6 complete) the batch waits
    # one more round for 16; the complete 5 and 6 are carried
    assert lengths(second) == [12, 16]
    assert second.metrics["partial/num_rounds"] == 3
    assert second.metrics["partial/max_steps_spanned"] == 2
    assert second.metrics["partial/num_carried_groups"] == 2 and second.metrics["partial/num_carried_tokens"] == 22


def test_carried_groups_survive_a_checkpoint_and_the_resumed_steps_repeat(tmp_path: Path) -> None:
    config = partial_config("rollout.partial.max_steps_spanned=3")
    full = run_steps(collector(config), LengthEngine(), range(4))
    first = run_steps(collector(config), LengthEngine(), range(2))[-1]
    save_pending(tmp_path, with_carried([], first))  # what the loop's checkpoint after step 1 keeps
    kept = load_pending(tmp_path)
    assert [batch.step for batch in kept] == [1] and not kept[0].groups
    resumed = run_steps(collector(config, position=6, pending=kept), LengthEngine(), range(2, 4))

    def view(batch: ProducedBatch) -> list[Any]:
        return [
            (g.scores, [(r.example.task_key, r.completion_ids, r.versions) for r in g.rollouts]) for g in batch.groups
        ]

    assert [view(b) for b in resumed] == [view(b) for b in full[2:]]
    assert [b.metrics for b in resumed] == [b.metrics for b in full[2:]]


def generated_versions(rollout: Any) -> list[int]:
    return [v for v, trained in zip(rollout.versions, rollout.loss_mask, strict=True) if trained]


def test_multi_turn_episodes_are_carried_between_turns_and_within_them() -> None:
    engine = LengthEngine()
    maker = collector(partial_config("rollout.partial.max_steps_spanned=3"), runner=TWO_TURNS)
    first, second = run_steps(maker, engine, range(2))
    # every turn of example n is n tokens. Step 0: 2, 12, 3, 16 in flight; round 1 ends the first turns of 2 and 3
    # (their environments step and answer "again"); round 2 ends their second turns: 2 and 3 are complete, and 12
    # and 16 are carried inside their first turn with 8 tokens of version 0 each
    assert lengths(first) == [2, 3]
    assert first.metrics["partial/num_rounds"] == 2
    assert first.metrics["partial/num_carried_tokens"] == 2 * (8 + 8)
    rollout = first.groups[0].rollouts[0]
    again = TOKENIZER.decode(rollout.completion_ids[2:-2])
    assert "again" in again and rollout.completion_ids[:2] == rollout.completion_ids[-2:] == [FILL] * 2
    assert rollout.episode is not None and [turn.reward for turn in rollout.episode.turns] == [0.0, 4.0]
    # step 1 (version 1): 12, 16, 5, 6. Round 1: 12 ends its first turn (12 tokens), 16 at 12, 5 and 6 at 4;
    # round 2: 12's second turn at 4, 16's first ends, 5's and 6's first end; round 3: 12 at 8, 16 at 4, 5 and 6
    # end their second turns; round 4: 12 ends: 12, 5, 6 complete; the batch takes 12 (drawn at step 0) and 5
    assert lengths(second) == [12, 5]
    assert second.metrics["partial/num_rounds"] == 4
    resumed = second.groups[0].rollouts[1]
    # 12's first turn: 8 tokens of version 0 and 4 of version 1; its second turn all version 1
    assert generated_versions(resumed) == [0] * 8 + [1] * 4 + [1] * 12
    assert resumed.episode is not None and [turn.action_text for turn in resumed.episode.turns] == ["x" * 12] * 2
    assert second.groups[0].scores == [24.0, 24.0]
    assert second.metrics["partial/older_policy_token_share"] == pytest.approx(2 * 8 / (2 * (24 + 10)))
    # 16 is carried with its first turn done (16 tokens) and 8 of its second (rounds 3 and 4); 6 complete
    assert second.metrics["partial/num_carried_tokens"] == 2 * (16 + 8) + 2 * 12
    # every turn's tokens were generated once, carried or not
    assert engine.generated == {2: 2 * 4, 3: 2 * 6, 12: 2 * 24, 5: 2 * 10, 16: 2 * 24, 6: 2 * 12}


def test_carried_multi_turn_episodes_survive_a_checkpoint_with_their_environments(tmp_path: Path) -> None:
    config = partial_config("rollout.partial.max_steps_spanned=3")
    full = run_steps(collector(config, runner=TWO_TURNS), LengthEngine(), range(4))
    first = run_steps(collector(config, runner=TWO_TURNS), LengthEngine(), range(2))[-1]
    save_pending(tmp_path, with_carried([], first))
    kept = load_pending(tmp_path)
    resumed = run_steps(collector(config, position=6, pending=kept, runner=TWO_TURNS), LengthEngine(), range(2, 4))

    def view(batch: ProducedBatch) -> list[Any]:
        return [
            (g.scores, [(r.completion_ids, r.versions, r.episode and r.episode.turns) for r in g.rollouts])
            for g in batch.groups
        ]

    assert [view(b) for b in resumed] == [view(b) for b in full[2:]]
    assert [b.metrics for b in resumed] == [b.metrics for b in full[2:]]


def test_a_checkpoint_from_before_multi_turn_carrying_goes_on() -> None:
    """Such a checkpoint's carried groups have no turn numbers, and a group complete beyond the batch had its ended
    turns left to record with the batch: they are recorded when the collector starts, and the group is taken."""
    runner = EpisodeRunner(tokenizer=TOKENIZER)
    example = EXAMPLES[0]  # len=2
    episodes = asyncio.run(runner.open_episodes(example, 0, 2))
    old = CarriedGroup(
        example=example,
        first_step=0,
        index=0,
        seed="0/0",
        episodes=episodes,
        params=[runner.request_of(e, SamplingParams(max_new_tokens=16), seed="0/0") for e in episodes],
        turns=[
            PartialCompletion(token_ids=[FILL] * 2, logprobs=[-0.5] * 2, versions=[0, 0], texts=["xx"], is_done=True)
            for _ in episodes
        ],
    )
    del old.turn_numbers  # as pickled before the field existed
    old.turns[0].finish_reason = old.turns[1].finish_reason = "stop"
    pending = [ProducedBatch(step=0, groups=[], carried=[old])]
    maker = collector(partial_config(), position=4, pending=pending)
    assert all(e.is_done for e in maker.carried[0].episodes) and maker.carried[0].turn_numbers == [0, 0]
    batch = run_steps(maker, LengthEngine(), range(1, 2))[0]
    assert batch.groups[0].example.task_key == "t/0"
    assert [r.completion_ids for r in batch.groups[0].rollouts] == [[FILL] * 2] * 2
    assert batch.groups[0].scores == [2.0, 2.0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (['rollout.engine.type="scripted"'], "needs an engine that can resume a request from its tokens"),
        (["rollout.partial.extra_prompts=3"], "extra_prompts = 3 must be at most rollout.prompts_per_step = 2"),
        (['rollout.mode="async"', 'rollout.weight_updates="in_flight"'], 'needs rollout.weight_updates = "between'),
        (['environment.type="calculator"'], "whose environment state is plain data"),
        (
            ['environment.type="guess_number"', 'data.type="environment"', 'environment.remote.urls=["http://a:1"]'],
            "the environments live on their replicas",
        ),
    ],
)
def test_unsupported_combinations_are_refused_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        partial_config(*overrides)
    assert message in str(error.value)
