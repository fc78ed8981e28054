"""The simulated RL loop on a simulated cluster: engines generate episodes, the environment and reward fleets
serve them, the trainer trains each complete batch in order and syncs its weights to every engine.

It owns the schedule, in one place, with sharpen's rules: batch s is admitted to generation once version
s - max_staleness is published (sync mode: max_staleness 0), batches are trained strictly in order and only when
every episode of the batch is scored, a weight sync pauses the engines, colocated engines sleep while the trainer
steps, a failed engine loses its running turns and restarts, stragglers run slower. It does not price work
(costs.py) or summarise runs for people (report.py).
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field

from sharpen.simulation.costs import CostModel
from sharpen.simulation.engines import EngineReplica
from sharpen.simulation.events import EventQueue
from sharpen.simulation.fleet import Fleet
from sharpen.simulation.scenario import Scenario


@dataclass(kw_only=True, slots=True)
class Episode:
    batch: int
    prompt_tokens: float
    turn_tokens: list[int]
    turn: int = 0
    decoded_tokens: float = 0.0  # in finished turns
    admitted_context: float = 0.0
    engine: int = -1


@dataclass(kw_only=True, slots=True)
class Batch:
    version: int
    admitted_at: float
    num_remaining: int
    num_tokens: float
    scored_at: float | None = None


@dataclass(kw_only=True, slots=True)
class SimulationResult:
    name: str
    mode: str
    max_staleness: int
    placement: str
    num_engines: int
    num_engine_gpus: int
    num_trainer_gpus: int
    step_seconds: float  # steady state: mean over steps after the warm-up
    generation_seconds: float  # mean time from a batch's admission to its last scored episode
    train_seconds: float  # mean trainer seconds per step (overhead, sleep/wake and training, not the sync)
    sync_seconds: float
    engine_busy_fraction: float  # time an engine had a sequence running, over all engines and the whole run
    engine_occupancy: float | None  # running sequences / capacity, time-averaged (None: capacity unbounded)
    trainer_busy_fraction: float  # training + weight sync, over the whole run
    staleness_mean: float
    tokens_per_second: float  # trained tokens over the whole run
    total_seconds: float
    num_engine_failures: int
    wasted_tokens: float
    step_times: list[float] = field(default_factory=list)


class ClusterSimulation:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.costs = CostModel(scenario=scenario)
        self.rng = random.Random(scenario.simulation.seed)
        self.events = EventQueue()
        cluster, failures = scenario.cluster, scenario.failures
        num_engines = cluster.num_engine_gpus // cluster.gpus_per_engine
        workload = scenario.workload
        mean_context = workload.prompt_tokens.median + workload.response_tokens.median
        capacity = self.costs.max_sequences_per_engine(mean_context)
        slow = set(self.rng.sample(range(num_engines), round(failures.straggler_fraction * num_engines)))
        self.engines = [
            EngineReplica(index=i, capacity=capacity, slowdown=failures.straggler_slowdown if i in slow else 1.0)
            for i in range(num_engines)
        ]
        slow_ranks = round(failures.straggler_fraction * cluster.num_trainer_gpus)
        self.trainer_slowdown = failures.straggler_slowdown if slow_ranks else 1.0
        self.environment = Fleet(name="environment", section=scenario.environment, rng=self.rng)
        self.reward = Fleet(name="reward", section=scenario.reward, rng=self.rng)
        self.episodes: list[Episode] = []
        self.batches: list[Batch] = []
        self.pending: deque[int] = deque()
        self.down_until = [0.0] * num_engines
        self.published_version = 0
        self.published_at = [0.0]
        self.is_trainer_busy = False
        self.trainer_seconds: list[float] = []
        self.trainer_busy_seconds = 0.0
        self.num_failures = 0
        self.wasted_tokens = 0.0

    def _round_seconds(self, num_sequences: int, context: float) -> float:
        return self.costs.decode_round_seconds(num_sequences, context)

    def run(self) -> SimulationResult:
        mtbf = self.scenario.failures.engine_mtbf_hours
        if mtbf is not None:
            for engine in self.engines:
                self.events.push(self.rng.expovariate(1.0 / (mtbf * 3600.0)), "fail", engine.index)
        self._admit()
        num_steps = self.scenario.simulation.num_steps
        while self.published_version < num_steps:
            if not self.events:
                raise RuntimeError("the simulation stalled: no event left before the last step")  # a bug, not input
            event = self.events.pop()
            handler = getattr(self, f"_on_{event.kind}")
            handler(*event.payload)
        return self._result()

    # -- generation ------------------------------------------------------------------------------------------------

    def _admit(self) -> None:
        scenario = self.scenario
        while len(self.batches) < scenario.simulation.num_steps:
            index = len(self.batches)
            if self.published_version < index - scenario.staleness:
                break
            previous = self.batches[-1] if self.batches else None
            if previous is not None and previous.scored_at is None and not scenario.rollout.continuous_batching:
                break
            self._start_batch(index)
        self._dispatch()

    def _start_batch(self, index: int) -> None:
        workload = self.scenario.workload
        first = len(self.episodes)
        num_tokens = 0.0
        for _ in range(workload.prompts_per_step):
            prompt = max(1.0, round(workload.prompt_tokens.sample(self.rng)))
            for _ in range(workload.samples_per_prompt):
                response = max(1, round(workload.response_tokens.sample(self.rng)))
                turns = [response // workload.num_turns] * workload.num_turns
                turns[-1] += response - sum(turns)
                self.episodes.append(Episode(batch=index, prompt_tokens=prompt, turn_tokens=[max(1, t) for t in turns]))
                num_tokens += prompt + response
        count = len(self.episodes) - first
        batch = Batch(
            version=self.published_version, admitted_at=self.events.now, num_remaining=count, num_tokens=num_tokens
        )
        self.batches.append(batch)
        self.pending.extend(range(first, len(self.episodes)))

    def _dispatch(self, engines: list[EngineReplica] | None = None) -> None:
        """Hand pending turns to the least-loaded replicas that are up and have a free slot, among ``engines``
        (default all). After a dispatch either nothing is pending or every replica that is up is full, and every
        event that adds a pending turn or brings a replica up dispatches to all; so when a sequence finishes, its
        replica is the only one that can have a free slot, and dispatching to it alone decides the same."""
        if not self.pending:
            return
        now, touched = self.events.now, set[int]()
        free = [
            (e.num_running, e.index)
            for e in (self.engines if engines is None else engines)
            if self.down_until[e.index] <= now and e.num_running < e.capacity
        ]
        heapq.heapify(free)
        while self.pending and free:
            _, index = heapq.heappop(free)
            engine = self.engines[index]
            engine.advance(now, self._round_seconds)
            episode_id = self.pending.popleft()
            episode = self.episodes[episode_id]
            context = episode.prompt_tokens + episode.decoded_tokens
            stall = self.costs.prefill_seconds(episode.prompt_tokens) if episode.turn == 0 else 0.0
            num_tokens = episode.turn_tokens[episode.turn]
            engine.admit(episode_id, context=context, num_tokens=num_tokens, now=now, stall=stall)
            episode.admitted_context, episode.engine = context, index
            touched.add(index)
            if engine.num_running < engine.capacity:
                heapq.heappush(free, (engine.num_running, index))
        for index in sorted(touched):
            self._schedule(self.engines[index])

    def _schedule(self, engine: EngineReplica) -> None:
        finish = engine.next_finish_time(self._round_seconds)
        if finish is not None:
            self.events.push(max(finish, self.events.now), "finish", engine.index, engine.epoch)

    def _on_finish(self, index: int, epoch: int) -> None:
        engine = self.engines[index]
        if epoch != engine.epoch:
            return  # the replica changed since this was scheduled; a newer event stands for it
        engine.advance_to_next_finish(self.events.now)
        for episode_id in engine.pop_finished():
            episode = self.episodes[episode_id]
            episode.decoded_tokens += episode.turn_tokens[episode.turn]
            episode.turn += 1
            fleet = self.environment if episode.turn < len(episode.turn_tokens) else self.reward
            fleet.submit(episode_id, self.events)
        self._schedule(engine)
        self._dispatch([engine])

    def _on_environment(self, episode_id: int) -> None:
        self.environment.finish(self.events)
        self.pending.appendleft(episode_id)
        self._dispatch()

    def _on_reward(self, episode_id: int) -> None:
        self.reward.finish(self.events)
        batch = self.batches[self.episodes[episode_id].batch]
        batch.num_remaining -= 1
        if batch.num_remaining == 0:
            batch.scored_at = self.events.now
            self._train()
            self._admit()

    # -- failures --------------------------------------------------------------------------------------------------

    def _on_fail(self, index: int) -> None:
        failures, engine, now = self.scenario.failures, self.engines[index], self.events.now
        if self.published_version >= self.scenario.simulation.num_steps:
            return
        engine.advance(now, self._round_seconds)
        self.num_failures += 1
        for episode_id, context in engine.fail(now=now, restart_seconds=failures.restart_seconds):
            episode = self.episodes[episode_id]
            self.wasted_tokens += context - episode.admitted_context
            self.pending.appendleft(episode_id)  # its turn starts again on another replica
        self.down_until[index] = engine.clock
        self.events.push(engine.clock, "up", index)
        assert failures.engine_mtbf_hours is not None
        self.events.push(
            engine.clock + self.rng.expovariate(1.0 / (failures.engine_mtbf_hours * 3600.0)), "fail", index
        )
        self._dispatch()

    def _on_up(self, index: int) -> None:
        self._dispatch()

    # -- training and weight sync ----------------------------------------------------------------------------------

    def _train(self) -> None:
        step = self.published_version
        if self.is_trainer_busy or step >= len(self.batches) or self.batches[step].scored_at is None:
            return
        costs = self.scenario.costs
        seconds = costs.step_overhead_s + self.costs.train_seconds(
            self.batches[step].num_tokens, slowdown=self.trainer_slowdown
        )
        if self.scenario.cluster.placement == "colocated":
            seconds += costs.sleep_wake_seconds
        self.is_trainer_busy = True
        self.trainer_seconds.append(seconds)
        self.trainer_busy_seconds += seconds
        self.events.push(self.events.now + seconds, "trained", step)

    def _on_trained(self, step: int) -> None:
        seconds, now = self.costs.sync_seconds(), self.events.now
        self.trainer_busy_seconds += seconds
        for engine in self.engines:  # every replica takes the broadcast: its running sequences pause
            engine.advance(now, self._round_seconds)
            engine.clock = max(engine.clock, now) + seconds
            engine.epoch += 1
            self._schedule(engine)
        self.events.push(now + seconds, "published", step + 1)

    def _on_published(self, version: int) -> None:
        self.published_version = version
        self.published_at.append(self.events.now)
        self.is_trainer_busy = False
        self._train()
        self._admit()

    def _result(self) -> SimulationResult:
        scenario = self.scenario
        warmup, total = scenario.simulation.warmup_steps, self.published_at[-1]
        steps = [b - a for a, b in zip(self.published_at, self.published_at[1:], strict=False)]
        trained = self.batches[: scenario.simulation.num_steps]
        engine_seconds = total * len(self.engines)
        bounded = all(e.capacity < 1_000_000 for e in self.engines)
        return SimulationResult(
            name=scenario.name,
            mode=scenario.rollout.mode,
            max_staleness=scenario.staleness,
            placement=scenario.cluster.placement,
            num_engines=len(self.engines),
            num_engine_gpus=scenario.cluster.num_engine_gpus,
            num_trainer_gpus=scenario.cluster.num_trainer_gpus,
            step_seconds=sum(steps[warmup:]) / len(steps[warmup:]),
            generation_seconds=sum((b.scored_at or 0.0) - b.admitted_at for b in trained) / len(trained),
            train_seconds=sum(self.trainer_seconds) / len(self.trainer_seconds),
            sync_seconds=self.costs.sync_seconds(),
            engine_busy_fraction=sum(e.busy_seconds for e in self.engines) / engine_seconds,
            engine_occupancy=sum(e.occupancy_seconds for e in self.engines) / engine_seconds if bounded else None,
            trainer_busy_fraction=self.trainer_busy_seconds / total,
            staleness_mean=sum(step - b.version for step, b in enumerate(trained)) / len(trained),
            tokens_per_second=sum(b.num_tokens for b in trained) / total,
            total_seconds=total,
            num_engine_failures=self.num_failures,
            wasted_tokens=self.wasted_tokens,
            step_times=steps,
        )


def simulate(scenario: Scenario) -> SimulationResult:
    return ClusterSimulation(scenario).run()
