"""A million episodes through the episode runner, an environment and the reward, twice: flat memory, one digest.

Each run makes --episodes episodes in steps of --groups-per-step groups x --samples samples, as a training run's
steps do (`EpisodeRunner.generate_groups`, each group scored by the rubric as soon as its episodes end), with a
seeded scripted engine (each completion a function of its prompt ids and sampling seed: a fast engine whose output
does not depend on scheduling). The environment is multi-turn: the calculator (tool calls, then an answer scored by
the rubric's exact-match verifier) or guess_number (the environment's own reward). After each step its rollouts go
into the `EpisodeDigest` and are dropped, so nothing should grow with the number of episodes.

The runs differ in scheduling, concurrency and engine (--runs; default: independent episodes 64 at a time against a
batch engine, whose requests the runner groups into batches, then 1,024 at a time against a request-level engine,
which gets each request on its own). Prints per run: episodes/s (wall clock, and per CPU-second of this process,
which a shared machine disturbs less), turns and tokens per episode, resident memory (RSS) after a few steps along
the run, the peak, live gc objects, and the digest; then whether all digests match.

--tokenizer bytes (default) is `sharpen.testing.ByteChatTokenizer` (ChatML over bytes, microseconds per render), so
the figures are the episode path's own; --tokenizer smollm2 renders with SmolLM2's Jinja chat template instead.
--profile runs the first run under cProfile and prints the top functions.

    .venv/bin/python benchmarks/million_episodes.py [--episodes 1000000] [--groups-per-step 250] [--samples 8]
        [--environment calculator|guess_number] [--tokenizer bytes|smollm2] [--runs async:64:batch,async:1024:request]
        [--profile]
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from sharpen.config.rewards import RewardConfig
from sharpen.environments import EpisodeLimits
from sharpen.environments.calculator import CalculatorEnvironment
from sharpen.environments.guess_number import GuessNumberEnvironment
from sharpen.monitoring import EpisodeDigest
from sharpen.orchestration.phases import score_groups
from sharpen.rewards import Rubric
from sharpen.rewards.verifiers import ExactMatchVerifier
from sharpen.rollout.engines.scripted import AsyncSeededScriptedEngine, SeededScriptedEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.testing import ByteChatTokenizer
from sharpen.types import Example, Message, RolloutGroup, SamplingParams

CALCULATOR_TURNS = [
    '<tool_call>{"name": "calculate", "arguments": {"expression": "6 * 7"}}</tool_call>',
    '<tool_call>{"name": "calculate", "arguments": {"expression": "(17 + 25) * 3 - 80"}}</tool_call>',
    '<tool_call>{"name": "calculate", "arguments": {"expression": "1 / 0"}}</tool_call>',
    "Let me check that once more.",
    "The product is <answer>42</answer>",
    "<answer>46</answer>",
]
GUESS_TURNS = ["8", "I guess 4.", "12", "My guess: 2", "15", "Is it 6?", "10"]


@dataclass(frozen=True)
class RunSpec:
    scheduling: str
    max_concurrent: int
    engine: str  # "batch": grouped by the request batcher; "request": one by one, out of order

    @classmethod
    def parse(cls, text: str) -> RunSpec:
        scheduling, concurrent, engine = text.split(":")
        if scheduling not in ("async", "lockstep") or engine not in ("batch", "request"):
            raise ValueError(f"--runs: {text!r} is not async|lockstep:N:batch|request")
        return cls(scheduling, int(concurrent), engine)

    def __str__(self) -> str:
        bound = f"max_concurrent {self.max_concurrent}" if self.max_concurrent else "all at once"
        return f"{self.scheduling}, {bound}, {self.engine} engine"


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def step_examples(step: int, num_groups: int, environment: str) -> list[Example]:
    """The step's tasks, made fresh (the runner keeps none of them after the step)."""
    first = step * num_groups
    if environment == "guess_number":
        examples = GuessNumberEnvironment.make_tasks(num_groups, seed=step)
        return [
            Example(task_key=f"guess_number/{first + i}", prompt=e.prompt, answer=e.answer, metadata=e.metadata)
            for i, e in enumerate(examples)
        ]
    return [  # half of them are answered right by the engine's answer turn (42)
        Example(
            task_key=f"calc/{first + i}",
            prompt=(Message(role="user", content=f"What is 6 * {7 + i % 2}? Use the calculator."),),
            answer=str(6 * (7 + i % 2)),
            metadata={"source": "exact_match"},
        )
        for i in range(num_groups)
    ]


@dataclass
class RunResult:
    spec: RunSpec
    seconds: float
    cpu_seconds: float
    num_episodes: int
    num_turns: int
    num_tokens: int
    num_correct: int
    digest: str
    rss_samples: list[tuple[int, int]]  # (step, RSS bytes after it)
    peak_rss: int
    live_objects: tuple[int, int]  # gc-tracked objects after the first steps and at the end


def run_once(spec: RunSpec, args: argparse.Namespace, tokenizer: Any, make_environment: Callable[[], Any]) -> RunResult:
    texts = CALCULATOR_TURNS if args.environment == "calculator" else GUESS_TURNS
    encode = partial(tokenizer.encode, add_special_tokens=False)
    if spec.engine == "request":
        engine = AsyncSeededScriptedEngine(
            texts, encode=encode, eos_token_id=tokenizer.eos_token_id, max_delay_s=args.max_delay_ms / 1000
        )
    else:
        engine = SeededScriptedEngine(texts, encode=encode, eos_token_id=tokenizer.eos_token_id)
    runner = EpisodeRunner(
        tokenizer=tokenizer,
        make_environment=make_environment,
        limits=EpisodeLimits(max_turns=args.max_turns, max_tokens=1024),
        scheduling=spec.scheduling,  # type: ignore[arg-type]
        max_concurrent=spec.max_concurrent,
    )
    rubric = Rubric(RewardConfig(), verifiers={"exact_match": ExactMatchVerifier()})
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    digest = EpisodeDigest()

    def score(group: RolloutGroup) -> None:
        score_groups(rubric, [group])

    per_step = args.groups_per_step * args.samples
    num_steps = -(-args.episodes // per_step)
    sample_at = {0, 1, 9, num_steps // 4, num_steps // 2, 3 * num_steps // 4, num_steps - 1}
    rss_samples: list[tuple[int, int]] = []
    live_first = live_last = 0
    num_turns = num_tokens = num_correct = num_episodes = 0
    started, cpu_started = time.perf_counter(), time.process_time()
    for step in range(num_steps):
        num_groups = min(args.groups_per_step, -(-(args.episodes - num_episodes) // args.samples))
        groups = runner.generate_groups(
            engine,
            step_examples(step, num_groups, args.environment),
            sampling=sampling,
            num_samples=args.samples,
            seed=f"{args.seed}/{step}",
            on_group=score,
        )
        rollouts = [r for g in groups for r in g.rollouts]
        digest.add_step(step, rollouts)
        for rollout in rollouts:
            num_turns += len(rollout.episode.turns) if rollout.episode is not None else 1
            num_tokens += rollout.num_tokens
            num_correct += rollout.reward is not None and rollout.reward.score == 1.0
        num_episodes += len(rollouts)
        del groups, rollouts
        if step in sample_at:
            rss_samples.append((step, rss_bytes()))
            if step == min(1, num_steps - 1):
                live_first = len(gc.get_objects())
    live_last = len(gc.get_objects())
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    engine.close()
    return RunResult(
        spec=spec,
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        num_episodes=num_episodes,
        num_turns=num_turns,
        num_tokens=num_tokens,
        num_correct=num_correct,
        digest=digest.hexdigest,
        rss_samples=rss_samples,
        peak_rss=peak_rss_bytes(),
        live_objects=(live_first, live_last),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=1_000_000)
    parser.add_argument("--groups-per-step", type=int, default=250)
    parser.add_argument("--samples", type=int, default=8, help="episodes per task (a group)")
    parser.add_argument("--environment", choices=["calculator", "guess_number"], default="calculator")
    parser.add_argument("--tokenizer", choices=["bytes", "smollm2"], default="bytes")
    parser.add_argument(
        "--runs",
        default="async:64:batch,async:1024:request",
        help="comma-separated scheduling:max_concurrent:batch|request (0: no bound)",
    )
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--max-delay-ms",
        type=float,
        default=0.0,
        help="the request-level engine answers each request after up to this long (0: at once)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="cProfile the first run; print the top functions")
    args = parser.parse_args()

    if args.tokenizer == "smollm2":
        from transformers import AutoTokenizer

        from sharpen.config.models import resolve_model_path

        tokenizer: Any = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    else:
        tokenizer = ByteChatTokenizer()
    make_environment: Callable[[], Any] = (
        CalculatorEnvironment if args.environment == "calculator" else GuessNumberEnvironment
    )
    specs = [RunSpec.parse(text) for text in args.runs.split(",")]
    print(
        f"{args.episodes:,} episodes per run: {args.environment} (up to {args.max_turns} turns), steps of "
        f"{args.groups_per_step} groups x {args.samples} samples, seeded scripted engine, {args.tokenizer} tokenizer"
    )
    print(f"RSS before the first run: {rss_bytes() / 2**20:.0f} MiB")
    results = []
    for index, spec in enumerate(specs):
        if args.profile and index == 0:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            result = profiler.runcall(run_once, spec, args, tokenizer, make_environment)
            stats = pstats.Stats(profiler).sort_stats("tottime")
            stats.print_stats(25)
            stats.sort_stats("cumulative").print_stats(40)
        else:
            result = run_once(spec, args, tokenizer, make_environment)
        results.append(result)
        rss = ", ".join(f"step {step}: {value / 2**20:.0f}" for step, value in result.rss_samples)
        print(f"\nrun {index + 1}: {spec}")
        print(
            f"  {result.num_episodes:,} episodes in {result.seconds:.1f} s: {result.num_episodes / result.seconds:,.0f}"
            f" episodes/s ({result.num_episodes / result.cpu_seconds:,.0f} per CPU-second of this process), "
            f"{result.num_turns / result.num_episodes:.2f} turns and "
            f"{result.num_tokens / result.num_episodes:.0f} tokens per episode, "
            f"{result.num_correct / result.num_episodes:.1%} scored 1"
        )
        print(f"  RSS (MiB) after {rss}; peak of the process so far {result.peak_rss / 2**20:.0f} MiB")
        print(f"  live gc objects after step 1: {result.live_objects[0]:,}, at the end: {result.live_objects[1]:,}")
        print(f"  digest {result.digest}")
    digests = {r.digest for r in results}
    print(f"\nsame digest in every run: {len(digests) == 1}")


if __name__ == "__main__":
    main()
