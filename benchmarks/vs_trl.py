"""sharpen's demo recipe against TRL's GRPOTrainer at the same shape, alternating, on this machine.

Both train SmolLM2-135M-Instruct on the recipe's task (reasoning-gym one-digit addition, its system prompt), with
its prompts per step x samples per prompt (8 x 4), max new tokens (32), temperature, learning rate (constant: sharpen
has no schedule, so TRL's linear decay is turned off), gradient clipping, seed and micro-batch size (TRL:
per_device_train_batch_size = the micro-batch, gradient accumulation up to the 32 completions, one optimizer step
per step, no KL term). The reward is sharpen's own `Rubric` of the recipe (the last number in the completion is the
right sum), called from TRL's reward function, so both score a completion the same way. Contenders, each run for
``--steps`` steps in its own subprocess, one after the other in every round:

- ``sharpen``: `sharpen train RECIPE` (vLLM rollouts); s/step is the run's ``time/step`` (generate, score, train,
  sync), the reward its ``reward/mean``.
- ``trl-default``: GRPOTrainer at its own defaults apart from the shape: transformers ``generate``, bf16 mixed
  precision (TRL's default), gradient checkpointing on (TRL's default), its loss (``dapo``).
- ``trl-equal``: the same at sharpen's precision (what the sharpen run's trainer.precision resolved to, from its
  ``precision.json``: float32, or bf16 autocast over float32 weights, TRL's ``bf16``) and sharpen's
  gradient-checkpointing setting; skipped where that is already TRL's default.

s/step of a TRL step is the wall time between consecutive optimizer steps (generation, reward, training,
logging), the reward TRL's logged ``reward``. Both use the trainer's thread count (`TrainerConfig.
resolved_num_threads`). Prints each contender's median s/step over every step of every round, its ratio to sharpen
(goal: sharpen <= 0.4x trl-default, < 1x trl-equal) and the reward at step 1 and over the last 5 steps.

TRL is not a dependency of sharpen: install it for this benchmark with ``make bench-deps`` (the ``bench`` extra).

    .venv/bin/python benchmarks/vs_trl.py [--steps 30] [--rounds 2] [--recipe recipes/demo.toml]
        [--contenders sharpen,trl-default,trl-equal] [--equal-precision float32|bf16] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONTENDERS = ("sharpen", "trl-default", "trl-equal")
NUM_LAST = 5  # the reward "after N steps" is the mean over the last NUM_LAST steps (one step is 32 samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--recipe", type=Path, default=Path("recipes/demo.toml"))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--equal-precision", choices=("float32", "bf16"), help="default: read from sharpen's run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (both)")
    parser.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)  # internal: one TRL run, results here
    parser.add_argument("--trl-bf16", choices=("true", "false"), help=argparse.SUPPRESS)
    parser.add_argument("--trl-gradient-checkpointing", choices=("true", "false"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker is not None:
        run_trl_worker(args)
        return
    names = args.contenders.split(",")
    if unknown := set(names) - set(CONTENDERS):
        parser.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    if "trl-equal" in names and "sharpen" not in names and args.equal_precision is None:
        parser.error("trl-equal without sharpen needs --equal-precision (it is read from sharpen's run)")
    if any(name.startswith("trl") for name in names) and importlib.util.find_spec("trl") is None:
        raise SystemExit(
            "benchmarks/vs_trl.py: TRL is not installed (it is not a dependency of sharpen); install it with "
            "`make bench-deps` (pip install -c constraints.txt -e '.[bench]')"
        )
    config = load_recipe(args.recipe, args.set)  # bad input stops here, before any subprocess
    print(
        f"{config.rollout.prompts_per_step} prompts x {config.rollout.num_samples_per_prompt} samples, <= "
        f"{config.rollout.max_new_tokens} new tokens, lr {config.trainer.learning_rate:g}, {args.steps} steps x "
        f"{args.rounds} rounds, torch threads {config.trainer.resolved_num_threads}"
    )
    results = run_rounds(args, names, config)
    report(results, num_steps=args.steps)


def run_rounds(args: argparse.Namespace, names: list[str], config: Any) -> dict[str, list[dict[str, Any]]]:
    """Every contender once per round, in order; each run's per-step seconds, rewards and precision."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    equal_precision = args.equal_precision
    with tempfile.TemporaryDirectory(prefix="sharpen-vs-trl-") as scratch:
        for round_index in range(args.rounds):
            for name in names:
                folder = Path(scratch) / f"{name}-{round_index}"
                if name == "sharpen":
                    result = run_sharpen(args, folder)
                    equal_precision = equal_precision or result["precision"]
                    if "trl-equal" in names and equal_precision not in ("float32", "bf16"):
                        raise SystemExit(
                            f"benchmarks/vs_trl.py: {folder} has no precision.json; pass --equal-precision"
                        )
                else:
                    bf16, checkpointing = trl_settings(name, equal_precision, config.trainer.gradient_checkpointing)
                    if name == "trl-equal" and bf16 and checkpointing:
                        print("trl-equal: sharpen's settings are TRL's defaults; the trl-default row stands for it")
                        continue
                    result = run_trl(args, folder, bf16=bf16, gradient_checkpointing=checkpointing)
                results[name].append(result)
                print(
                    f"round {round_index} {name:<11} median {statistics.median(result['step_seconds']):6.2f} s/step "
                    f"({result['precision']}), reward {result['rewards'][0]:.2f} -> {result['rewards'][-1]:.2f}"
                )
    return results


def load_recipe(recipe: Path, overrides: list[str]) -> Any:
    from sharpen.config.loader import ConfigError, load_config

    try:
        config = load_config(recipe, overrides)
    except (ConfigError, FileNotFoundError) as exc:
        raise SystemExit(f"benchmarks/vs_trl.py: {exc}") from None
    num_samples = config.rollout.prompts_per_step * config.rollout.num_samples_per_prompt
    if num_samples % config.trainer.micro_batch_size:
        raise SystemExit(
            f"benchmarks/vs_trl.py: {num_samples} samples per step do not split into micro-batches of "
            f"{config.trainer.micro_batch_size} (TRL accumulates whole micro-batches)"
        )
    return config


def trl_settings(name: str, equal_precision: str | None, sharpen_checkpointing: bool) -> tuple[bool, bool]:
    """(bf16, gradient_checkpointing) of a TRL contender."""
    if name == "trl-default":
        return True, True  # GRPOConfig's defaults (bf16 unless fp16 is set; checkpointing on)
    return equal_precision == "bf16", sharpen_checkpointing


def run_logged(command: list[str], log: Path) -> None:
    """Run ``command`` with its output in ``log``; on failure, show the log's tail and stop."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"benchmarks/vs_trl.py: {' '.join(command[:3])} ... exited {code}:\n{tail}")


def run_sharpen(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One `sharpen train` run of the recipe; its per-step times and rewards from metrics.jsonl."""
    overrides = [
        *args.set,
        f"run.num_steps={args.steps}",
        f"run.output_dir={folder}",
        "run.name=sharpen",
        "run.export_model=false",
        "monitoring.progress=false",
    ]
    command = [sys.executable, "-m", "sharpen.cli.main", "train", str(args.recipe), *overrides]
    run_logged(command, folder / "output.log")
    run_dir = folder / "sharpen"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "step_seconds": [row["time/step"] for row in rows],
        "rewards": [row["reward/mean"] for row in rows],
        "precision": sharpen_precision(run_dir),
    }


def sharpen_precision(run_dir: Path) -> str:
    """The trainer precision a sharpen run used (float32 or bf16): what trainer.precision resolved to, from the
    run's ``precision.json`` ("unknown" without one)."""
    record = run_dir / "precision.json"
    return json.loads(record.read_text())["precision"] if record.is_file() else "unknown"


def run_trl(args: argparse.Namespace, folder: Path, *, bf16: bool, gradient_checkpointing: bool) -> dict[str, Any]:
    results = folder / "results.json"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--trl-worker",
        str(results),
        "--trl-bf16",
        str(bf16).lower(),
        "--trl-gradient-checkpointing",
        str(gradient_checkpointing).lower(),
        "--recipe",
        str(args.recipe),
        "--steps",
        str(args.steps),
        *(f"--set={override}" for override in args.set),
    ]
    run_logged(command, folder / "output.log")
    return json.loads(results.read_text())


def run_trl_worker(args: argparse.Namespace) -> None:
    """In the subprocess: TRL's GRPOTrainer on the recipe's task and shape; per-step times and rewards to JSON."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # pyright: ignore[reportPrivateImportUsage]

    from sharpen.config.kl import KLLoss
    from sharpen.config.models import resolve_model_path
    from sharpen.data import load_examples
    from sharpen.rewards import Rubric

    config = load_recipe(args.recipe, args.set)
    torch.set_num_threads(config.trainer.resolved_num_threads)  # what sharpen's trainer uses
    examples = {example.task_key: example for example in load_examples(config.data, seed=config.run.seed)}
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": m.role, "content": m.content} for m in example.prompt], "task_key": key}
            for key, example in examples.items()
        ]
    )
    rubric = Rubric(config.reward)

    def reward(completions: list[list[dict[str, str]]], task_key: list[str], **_: Any) -> list[float | None]:
        pairs = zip(completions, task_key, strict=True)
        return [rubric(examples[key], completion[-1]["content"]).score for completion, key in pairs]

    step_ends: list[float] = []
    rewards: dict[int, float] = {}

    class Recorder(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            step_ends.append(time.perf_counter())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            step_ends.append(time.perf_counter())

        def on_log(self, _args: Any, state: Any, _control: Any, logs: dict[str, float] | None = None, **__: Any):
            if logs and "reward" in logs:
                rewards[state.global_step] = logs["reward"]

    rollout, trainer = config.rollout, config.trainer
    num_samples = rollout.prompts_per_step * rollout.num_samples_per_prompt
    is_bf16 = args.trl_bf16 == "true"
    grpo_config = GRPOConfig(
        output_dir=str(args.trl_worker.parent / "trl"),
        max_steps=args.steps,
        per_device_train_batch_size=trainer.micro_batch_size,
        gradient_accumulation_steps=num_samples // trainer.micro_batch_size,
        num_generations=rollout.num_samples_per_prompt,
        max_completion_length=rollout.max_new_tokens,
        temperature=rollout.temperature,
        learning_rate=trainer.learning_rate,
        lr_scheduler_type="constant",
        adam_beta1=trainer.betas[0],
        adam_beta2=trainer.betas[1],
        weight_decay=trainer.weight_decay,
        max_grad_norm=trainer.max_grad_norm,
        beta=trainer.algorithm.kl.coef if isinstance(trainer.algorithm.kl, KLLoss) else 0.0,
        bf16=is_bf16,
        use_cpu=not torch.cuda.is_available(),  # the device sharpen's trainer picks; bf16 on a CPU needs it said
        gradient_checkpointing=args.trl_gradient_checkpointing == "true",
        seed=config.run.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    grpo = GRPOTrainer(
        model=str(resolve_model_path(config.model.path)),  # a folder: TRL names (and could rebuild) it from there
        reward_funcs=reward,
        args=grpo_config,
        train_dataset=dataset,
        callbacks=[Recorder()],
    )
    grpo.train()
    seconds = [end - start for start, end in itertools.pairwise(step_ends)]
    precision = f"{'bf16' if is_bf16 else 'float32'}{', grad ckpt' if grpo_config.gradient_checkpointing else ''}"
    record = {"step_seconds": seconds, "rewards": [rewards[step] for step in sorted(rewards)], "precision": precision}
    args.trl_worker.write_text(json.dumps(record))


def report(results: dict[str, list[dict[str, Any]]], *, num_steps: int) -> None:
    num_last = min(NUM_LAST, num_steps)
    rows = {name: runs for name, runs in results.items() if runs}
    medians = {name: statistics.median(s for run in runs for s in run["step_seconds"]) for name, runs in rows.items()}
    print(f"\n{'contender':<12} {'precision':<20} {'s/step':>7} {'sharpen/x':>9}  reward step 1 -> last {num_last}")
    for name, runs in rows.items():
        first = statistics.mean(run["rewards"][0] for run in runs)
        last = statistics.mean(statistics.mean(run["rewards"][-num_last:]) for run in runs)
        ratio = f"{medians['sharpen'] / medians[name]:8.2f}x" if "sharpen" in medians else f"{'-':>9}"
        print(f"{name:<12} {runs[0]['precision']:<20} {medians[name]:7.2f} {ratio}  {first:.2f} -> {last:.2f}")
    print("goal: sharpen <= 0.4x trl-default's s/step, and < 1x trl-equal's")


if __name__ == "__main__":
    main()
