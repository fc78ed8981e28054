"""Async vs sync throughput of the real loop, side by side in one run.

Scripted (default): the whole loop (`run_embedded`: sampler, episodes, scoring, advantages, trainer, weight snapshots
and loads, metrics, checkpoints) with a 2-layer random model, a scripted engine that sleeps GEN seconds per batch
and a trainer that sleeps TRAIN seconds per step on top of its real (tiny) step. For each GEN:TRAIN ratio it runs
sync and async (max_staleness 1) and prints seconds per step, the async speedup, the ideal speedup
(gen + train) / max(gen, train) computed from the sync run's own measured phases, and their ratio (goal >= 0.9).

    .venv/bin/python benchmarks/async_overlap.py [--steps 8] [--ratios 0.5,1,2]

Recipe: the same recipe run sync and async (e.g. SmolLM2 with vLLM on the CPU) for a few steps each:

    .venv/bin/python benchmarks/async_overlap.py --recipe recipes/demo.toml --steps 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from sharpen.config import SharpenConfig, load_config
from sharpen.config.models import resolve_model_path
from sharpen.monitoring import read_jsonl
from sharpen.orchestration.build import build_trainer, load_tokenizer
from sharpen.orchestration.embedded import run_embedded
from sharpen.rollout.engines.scripted import ScriptedEngine
from sharpen.testing import save_tiny_llama
from sharpen.types import Completion, Example, RewardResult, RewardStatus, SamplingParams, TrainBatch


class SleepingEngine(ScriptedEngine):
    def __init__(self, *args: Any, seconds: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = seconds

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        time.sleep(self.seconds)
        return super().generate(prompts, params)


class SleepingTrainer:
    def __init__(self, trainer: Any, *, seconds: float) -> None:
        self._trainer = trainer
        self.seconds = seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)

    def step(self, batch: TrainBatch) -> dict[str, float]:
        time.sleep(self.seconds)
        return self._trainer.step(batch)


def length_reward(example: Example, completion: str) -> RewardResult:
    score = len(completion) / 40
    return RewardResult(score=score, status=RewardStatus.OK, verifier="length")


def scripted_config(model: Path, out: Path, *, name: str, steps: int, mode: str) -> SharpenConfig:
    overrides = [
        f'run.name="{name}"',
        f'run.output_dir="{out}"',
        f"run.num_steps={steps}",
        f'model.path="{model}"',
        "data.size=64",
        'rollout.engine.type="scripted"',
        "rollout.prompts_per_step=2",
        "rollout.num_samples_per_prompt=4",
        "rollout.max_new_tokens=12",
        f'rollout.mode="{mode}"',
        "rollout.max_staleness=1",
        "trainer.micro_batch_size=8",
        "monitoring.progress=false",
        "monitoring.tensorboard=false",
        "monitoring.timeline=false",
        "weight_sync.verify=false",
    ]
    return load_config(None, overrides)


def seconds_per_step(run_dir: Path) -> tuple[float, dict[str, float]]:
    """Median wall seconds per step after the first (pipeline filling), and the median of each phase."""
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]
    phases = {
        name: statistics.median(r.get(f"time/{name}", 0.0) for r in rows)
        for name in ("generate", "score", "train", "sync")
    }
    return statistics.median(r["time/step"] for r in rows), phases


def scripted(steps: int, ratios: list[float], base: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_llama(Path(tmp) / "tiny", tokenizer_from=resolve_model_path("smollm2-135m-instruct"))
        tokenizer = load_tokenizer(model)
        print(f"{steps} steps each; base {base:.2f} s; max_staleness 1, weights between batches")
        print(f"{'gen:train':>9} {'sync s/step':>11} {'async s/step':>12} {'speedup':>8} {'ideal':>6} {'of ideal':>8}")
        for ratio in ratios:
            gen, train = base * ratio, base
            seconds = {}
            for mode in ("sync", "async"):
                config = scripted_config(model, Path(tmp), name=f"{mode}-{ratio}", steps=steps, mode=mode)
                engine = SleepingEngine(
                    ["<answer>1</answer> a b c d e f", "x"],
                    encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
                    eos_token_id=tokenizer.eos_token_id,
                    seconds=gen,
                )
                trainer = SleepingTrainer(build_trainer(config, model_path=model, tokenizer=tokenizer), seconds=train)
                run_dir = run_embedded(config, reward_fn=length_reward, engine=engine, trainer=trainer)  # pyright: ignore
                seconds[mode] = seconds_per_step(run_dir)
            (sync_s, phases), (async_s, _) = seconds["sync"], seconds["async"]
            generation = phases["generate"] + phases["score"]
            training = sync_s - generation  # everything else the sync step does: train, sync, bookkeeping
            ideal = sync_s / max(generation, training)
            speedup = sync_s / async_s
            row = f"{ratio:>9.2f} {sync_s:>11.3f} {async_s:>12.3f}"
            print(f"{row} {speedup:>7.2f}x {ideal:>5.2f}x {speedup / ideal:>8.1%}")


def recipe(path: Path, steps: int) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "async"):
            config = load_config(
                path,
                [
                    f'run.name="bench-{mode}"',
                    f'run.output_dir="{tmp}"',
                    f"run.num_steps={steps}",
                    f'rollout.mode="{mode}"',
                    "rollout.max_staleness=1",
                    "monitoring.progress=false",
                    "run.export_model=false",
                ],
            )
            started = time.perf_counter()
            run_dir = run_embedded(config)
            total = time.perf_counter() - started
            rows = read_jsonl(run_dir / "metrics.jsonl")
            per_step = [r["time/step"] for r in rows]
            results[mode] = per_step
            rewards = [round(r["reward/mean"], 3) for r in rows]
            print(f"{mode:>5}: total {total:.1f} s (incl. start-up); s/step {[round(s, 1) for s in per_step]}")
            print(f"       reward/mean by step {rewards}")
    sync_s = statistics.median(results["sync"][1:])
    async_s = statistics.median(results["async"][1:])
    print(f"median s/step after the first: sync {sync_s:.1f}, async {async_s:.1f}, speedup {sync_s / async_s:.2f}x")
    print(json.dumps({"sync": results["sync"], "async": results["async"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ratios", default="0.5,1,2", help="generation seconds : training seconds, comma-separated")
    parser.add_argument("--base", type=float, default=0.4, help="training seconds added per step")
    parser.add_argument("--recipe", type=Path, help="run this recipe sync and async instead")
    args = parser.parse_args()
    if args.recipe is not None:
        recipe(args.recipe, args.steps)
    else:
        scripted(args.steps, [float(r) for r in args.ratios.split(",")], args.base)


if __name__ == "__main__":
    main()
