"""Partial rollouts across steps (``rollout.partial``): `PartialCollector` makes a step's batch like
`GroupCollector`, but keeps more groups in flight than the step trains on and closes the batch as soon as enough of
them are complete; the unfinished groups are carried into the next step.

How, in one paragraph. ``prompts_per_step + extra_prompts`` groups are in flight: the groups carried from earlier
steps first, then new examples drawn to fill up. Their episodes' turns are generated in rounds of at most
``chunk_tokens`` tokens per request (`weights.chunk_request`: the episode so far and the turn's tokens so far, a
seed per position); a turn that ends steps its environment at once, as `EpisodeRunner.run` does, and the episode's
next turn goes on in the next round. After each round the batch closes once ``prompts_per_step`` groups are complete
(every episode ended) and every group at its last allowed step (``max_steps_spanned``) is complete too. The complete
groups, oldest first, make the batch; the rest (unfinished, or complete beyond the batch) are carried. A carried
request goes on from its exact tokens with the weights of the next step; each token keeps the version that sampled
it (`Rollout.versions`), which the off-policy correction reads through the engine's logprobs. Which groups close a
batch depends on token counts, not on timing, so a run is reproducible on an engine that honours per-request seeds;
the carried groups, their environments' state with them, travel with each batch (`ProducedBatch.carried`) into the
checkpoint, so a resumed run goes on with exactly them. That is why only environments whose state is plain data may
be carried (config/cross_checks.py).

Not here: environments with outside state (sandboxes, browsers, services), agents, dynamic sampling, in-flight weight
updates.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sharpen.orchestration.batches.base import ProducedBatch
from sharpen.orchestration.batches.weights import PartialCompletion, chunk_request
from sharpen.orchestration.phases import score_groups
from sharpen.rollout.episode_state import rollout_of
from sharpen.types import RolloutGroup, SamplingParams

if TYPE_CHECKING:
    from sharpen.monitoring import PhaseTimer
    from sharpen.orchestration.batches.collect import GroupCollector
    from sharpen.rollout.engines import InferenceEngine
    from sharpen.rollout.episode_state import EpisodeState
    from sharpen.types import Example


@dataclass(kw_only=True)
class CarriedGroup:
    """One group in flight: its episodes (reset, prompt rendered) and each one's turn so far."""

    example: Example
    first_step: int
    """The step that drew it."""
    index: int
    """Its place among the examples that step drew (its episodes' example index, which seeds their sampling)."""
    seed: str
    """The sampling seed of the step that drew it (each request's own seed derives from it)."""
    episodes: list[EpisodeState]
    params: list[SamplingParams]
    """Each episode's sampling of its current turn."""
    turns: list[PartialCompletion] = field(default_factory=list[PartialCompletion])
    """Each episode's current turn so far."""
    turn_numbers: list[int] = field(default_factory=list[int])
    """Each episode's current turn's number, from 0."""

    @property
    def is_complete(self) -> bool:
        return all(episode.is_done for episode in self.episodes)

    @property
    def order(self) -> tuple[int, int]:
        """Oldest first: the batch takes complete groups in this order, so the groups near their bound go first."""
        return self.first_step, self.index


class PartialCollector:
    """`GroupCollector`'s batches with partial rollouts (the module docstring says how); ``pending``: a checkpoint's
    kept batches, whose last one holds the groups to carry on with."""

    def __init__(self, collector: GroupCollector, *, pending: Sequence[ProducedBatch] = ()) -> None:
        self.collector = collector
        self.partial = collector.config.rollout.partial
        kept = [batch for batch in pending if batch.carried is not None]
        last = max(kept, key=lambda batch: batch.step, default=None)
        self.carried: list[CarriedGroup] = [] if last is None else _copy(last.carried or [])
        asyncio.run(self._close_turns(_from_single_turn_checkpoint(self.carried)))

    def collect(self, engine: InferenceEngine, *, step: int, timer: PhaseTimer) -> ProducedBatch:
        config = self.collector.config
        num_groups = config.rollout.prompts_per_step
        with timer.phase("generate"):
            flight = self.carried + self._draw(step, num_groups + self.partial.extra_prompts - len(self.carried))
            num_rounds = self._generate(engine, flight, step=step)
        complete = sorted((g for g in flight if g.is_complete), key=lambda g: g.order)
        taken = complete[:num_groups]
        taken_ids = {id(g) for g in taken}
        self.carried = sorted((g for g in flight if id(g) not in taken_ids), key=lambda g: g.order)
        groups = asyncio.run(self._close(taken))
        with timer.phase("score"):
            score_groups(
                self.collector.rubric, groups, config=config.reward, max_new_tokens=config.rollout.max_new_tokens
            )
        if config.trainer.algorithm.advantage.needs_greedy_baseline:
            self.collector.add_greedy_baselines(engine, groups, timer=timer)
        metrics = partial_metrics(taken, self.carried, step=step, version=engine.policy_version)
        metrics["partial/num_rounds"] = float(num_rounds)
        return ProducedBatch(
            step=step,
            groups=groups,
            metrics=metrics,
            sampler_state=self.collector.sampler.state_dict(),
            carried=_copy(self.carried),
        )

    def _draw(self, step: int, count: int) -> list[CarriedGroup]:
        """``count`` new groups of ``step``, their episodes opened (reset, first prompt rendered)."""
        if count <= 0:
            return []
        collector = self.collector
        examples = collector.sampler.next_batch(count)
        seed = f"{collector.config.run.seed}/{step}"
        num_samples = collector.config.rollout.num_samples_per_prompt

        async def open_all() -> list[list[EpisodeState]]:
            return [await collector.runner.open_episodes(e, i, num_samples) for i, e in enumerate(examples)]

        groups = []
        for index, (example, episodes) in enumerate(zip(examples, asyncio.run(open_all()), strict=True)):
            params = [collector.runner.request_of(e, collector.sampling, seed=seed) for e in episodes]
            turns = [PartialCompletion(is_done=e.is_done) for e in episodes]  # a failed reset has no turn
            groups.append(
                CarriedGroup(
                    example=example,
                    first_step=step,
                    index=index,
                    seed=seed,
                    episodes=episodes,
                    params=params,
                    turns=turns,
                    turn_numbers=[0] * len(episodes),
                )
            )
        return groups

    def _is_closed(self, flight: list[CarriedGroup], *, step: int) -> bool:
        """Enough groups are complete for the batch, and no group at its last allowed step is unfinished."""
        last_start = step - self.partial.max_steps_spanned + 1
        if any(g.first_step <= last_start and not g.is_complete for g in flight):
            return False
        num_complete = sum(g.is_complete for g in flight)
        return num_complete >= self.collector.config.rollout.prompts_per_step or num_complete == len(flight)

    def _generate(self, engine: InferenceEngine, flight: list[CarriedGroup], *, step: int) -> int:
        """Rounds of ``chunk_tokens`` per unfinished request until the batch closes; returns the number of rounds."""
        num_rounds = 0
        while not self._is_closed(flight, step=step):
            live = [(g, i) for g in flight for i, episode in enumerate(g.episodes) if not episode.is_done]
            requests = [
                chunk_request(
                    g.episodes[i].prompt_ids + g.episodes[i].completion_ids,
                    g.params[i],
                    g.turns[i],
                    self.partial.chunk_tokens,
                )
                for g, i in live
            ]
            outputs = engine.generate([ids for ids, _ in requests], [params for _, params in requests])
            version = engine.policy_version
            for (group, i), output in zip(live, outputs, strict=True):
                group.turns[i].extend(output, version=version, limit=group.params[i].max_new_tokens)
            asyncio.run(self._close_turns([(g, i) for g, i in live if g.turns[i].is_done]))
            num_rounds += 1
        return num_rounds

    async def _close_turns(self, ended: list[tuple[CarriedGroup, int]]) -> None:
        """Each ended turn recorded and its environment stepped, as the runner does; an episode that goes on gets
        its next turn's sampling and an empty turn."""
        runner, sampling = self.collector.runner, self.collector.sampling
        for group, i in ended:
            episode, number = group.episodes[i], group.turn_numbers[i]
            await runner.close_turn(episode, group.turns[i].completion(self._decode), turn=number)
            if not episode.is_done:
                group.turn_numbers[i] = number + 1
                group.params[i] = runner.request_of(episode, sampling, seed=group.seed, turn=number + 1)
                group.turns[i] = PartialCompletion()

    async def _close(self, taken: list[CarriedGroup]) -> list[RolloutGroup]:
        """The groups of the batch, their episodes ended (every turn recorded, every environment stepped)."""
        groups = []
        for group in taken:
            rollouts = [rollout_of(group.example, episode) for episode in group.episodes]
            groups.append(RolloutGroup(example=group.example, rollouts=rollouts))
        return groups

    def _decode(self, ids: list[int]) -> str:
        return self.collector.runner.tokenizer.decode(ids, skip_special_tokens=True)


def partial_metrics(
    taken: list[CarriedGroup], carried: list[CarriedGroup], *, step: int, version: int
) -> dict[str, float]:
    """What partial rollouts did in a step: groups carried on and resumed (with the tokens they generated so far), and
    the share of the batch's generated tokens sampled by a policy older than ``version`` (the one the batch closed
    with)."""
    versions = [v for g in taken for e in g.episodes for v, m in zip(e.versions, e.loss_mask, strict=True) if m]
    return {
        "partial/num_carried_groups": float(len(carried)),
        "partial/num_carried_tokens": float(
            sum(
                sum(e.loss_mask) + (0 if e.is_done else len(turn.token_ids))
                for g in carried
                for e, turn in zip(g.episodes, g.turns, strict=True)
            )
        ),
        "partial/num_resumed_groups": float(sum(g.first_step < step for g in taken)),
        "partial/older_policy_token_share": sum(v < version for v in versions) / len(versions) if versions else 0.0,
        "partial/max_steps_spanned": float(max((step - g.first_step + 1 for g in taken), default=0)),
    }


def _from_single_turn_checkpoint(groups: list[CarriedGroup]) -> list[tuple[CarriedGroup, int]]:
    """Carried groups of a checkpoint written before multi-turn episodes could be carried have no turn numbers, and
    their ended turns were not yet recorded (that waited for the batch): number them, and return the ended turns,
    which the caller closes."""
    ended = []
    for group in groups:
        if "turn_numbers" not in vars(group):
            group.turn_numbers = [0] * len(group.episodes)
            ended += [
                (group, i) for i, turn in enumerate(group.turns) if turn.is_done and not group.episodes[i].is_done
            ]
    return ended


def _copy(groups: list[CarriedGroup]) -> list[CarriedGroup]:
    """A deep copy (what a batch hands to a checkpoint must not change while the next steps go on with them)."""
    return pickle.loads(pickle.dumps(groups))
