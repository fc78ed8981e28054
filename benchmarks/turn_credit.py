"""Turn-level credit against episode-level GRPO on a multi-turn game, the same runs over several seeds.

For every seed (``--seeds 0,1,2``) and every estimator (``--advantages grpo,turn_grpo,gigpo``) it runs
`sharpen train RECIPE` (default recipes/turn_grpo.toml: the guess-number game, 1 to 8, up to 4 guesses) with
``trainer.algorithm.advantage`` set to that estimator's default table and ``run.seed`` to the seed, everything else
identical: the same seed gives the same games in the same order and the same first weights. ``turn_grpo`` and
``gigpo`` keep their defaults (gamma 0.95; omega 1.0 and no std for gigpo), the recipes' settings. From each run's
metrics.jsonl (``reward/mean``: the fraction of games won, one step being prompts x samples games) it prints, per
run, the mean reward of the first and of the last ``--window`` steps, the area under the reward curve (the mean
reward over all steps: higher is faster learning), the first step whose trailing ``--window``-step mean reaches
``--threshold`` and the wall time; then a side-by-side table per seed, and whether "turn-level >= GRPO" holds per seed
and on average (on the area under the curve, the "learns at least as fast" of issue 34, and on the last steps);
then the paired per-step differences against the first estimator (mean, its standard error over the steps, which
treats the steps as independent and so understates it, and the steps above, level and below). ``--report DIR``
prints that report again from the finished runs of an earlier ``--out DIR``.

The model (``--model``): ``tiny`` (default) is a warm-started tiny Llama built here first (seconds), because a step
of SmolLM2-135M-Instruct takes minutes on a CPU and SmolLM2 does not answer the game's format (docs/algorithms.md):
`sharpen.testing.save_tiny_llama` (2 layers, ``--hidden-size``, SmolLM2's tokenizer and chat template), then
``--warm-start-steps`` AdamW steps (``--warm-start-lr``, 32 games a step) of next-token loss on whole games rendered
the way the episodes render them (`sharpen.data.chat`). Each guess is, with probability ``--informed-share``
(default 0), drawn from the numbers the hints so far leave possible, otherwise uniformly from the game's range; the
first guess is not trained on, only its end of turn (fitting its uniform digit pulls every later guess to the same
hint-blind prior). With the default share of 0 it teaches the FORMAT (one number a turn, then the end of the turn),
not the game, and the default warm start is short (40 steps), so the format is only half learnt: the model often
writes several digits or an empty turn and starts far below the random guesser's win rate (1 - (7/8)^4 = 0.41 with
4 guesses of 1 to 8). Every 100 warm-start steps it prints the loss on the guesses after the first: ln 8 = 2.08 means
they ignore the hints, 1.18 is the informed guesser's optimum (a share of 1). Its runs generate with the ``hf``
engine and train at ``--learning-rate``. ``smollm2``: the recipe's own model, engine and learning rate. ``--set``
adds recipe overrides to every run; ``--tiny-model`` reuses the tiny model of an earlier run's ``--out``.

    .venv/bin/python benchmarks/turn_credit.py [--steps 70] [--seeds 0,1,2] [--advantages grpo,turn_grpo,gigpo]
        [--model tiny|smollm2] [--recipe recipes/turn_grpo.toml] [--window 10] [--threshold 0.6]
        [--out DIR] [--set KEY=VALUE ...] [--report DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EPISODE_LEVEL = "grpo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--advantages", default="grpo,turn_grpo,gigpo", help="the first is the baseline")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--recipe", type=Path, default=Path("recipes/turn_grpo.toml"))
    parser.add_argument("--hidden-size", type=int, default=128, help="tiny model")
    parser.add_argument("--warm-start-steps", type=int, default=40, help="tiny model")
    parser.add_argument("--warm-start-lr", type=float, default=1e-2, help="tiny model")
    parser.add_argument(
        "--informed-share",
        type=float,
        default=0.0,
        help="tiny model: share of warm-start guesses that follow the hints",
    )
    parser.add_argument(
        "--tiny-model", type=Path, help="tiny model: the warm-started model of an earlier run's --out (no warm start)"
    )
    parser.add_argument("--learning-rate", type=float, default=5e-4, help="tiny model's RL learning rate")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.6)
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (all)")
    parser.add_argument("--report", type=Path, metavar="DIR", help="print the report of the finished runs in DIR")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    advantages = args.advantages.split(",")
    if args.report is not None:
        runs = {
            (seed, name): summarise(
                read_run(args.report / f"{name}-seed{seed}", wall=float("nan")),
                window=args.window,
                threshold=args.threshold,
            )
            for seed in seeds
            for name in advantages
        }
        report(runs, seeds, advantages, args)
        return
    with tempfile.TemporaryDirectory(prefix="sharpen-turn-credit-") as scratch:
        out = args.out or Path(scratch)
        overrides = list(args.set)
        if args.model == "tiny":
            model = args.tiny_model or build_tiny_model(out / "tiny-guess-number", args=args)
            overrides = [
                f"model.path={json.dumps(str(model))}",
                'rollout.engine.type="hf"',
                f"trainer.learning_rate={args.learning_rate}",
                *overrides,
            ]
        print(f"{args.recipe}, {args.steps} steps, seeds {seeds}, overrides: {' '.join(overrides) or 'none'}")
        runs: dict[tuple[int, str], dict[str, Any]] = {}
        for seed in seeds:
            for advantage in advantages:
                run = run_sharpen(args, out / f"{advantage}-seed{seed}", overrides, seed=seed, advantage=advantage)
                runs[seed, advantage] = summarise(run, window=args.window, threshold=args.threshold)
                print_run(seed, advantage, runs[seed, advantage])
    report(runs, seeds, advantages, args)


def build_tiny_model(folder: Path, *, args: argparse.Namespace) -> Path:
    """The tiny Llama warm-started on the game's format (module docstring); returns ``folder``. Seeded."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from sharpen.config import load_config
    from sharpen.config.models import resolve_model_path
    from sharpen.data.chat import render_continuation, render_prompt
    from sharpen.environments.guess_number import GuessNumberEnvironment
    from sharpen.testing import save_tiny_llama
    from sharpen.types import Message

    started = time.perf_counter()
    config = load_config(args.recipe, args.set)
    env = config.environment
    low, high, max_turns = env.low, env.high, env.max_turns  # pyright: ignore[reportAttributeAccessIssue]
    save_tiny_llama(folder, tokenizer_from=resolve_model_path("smollm2-135m-instruct"), hidden_size=args.hidden_size)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    end = tokenizer.eos_token_id  # SmolLM2's <|im_end|>, the end of an assistant turn
    prompt = render_prompt(tokenizer, GuessNumberEnvironment.make_tasks(1, seed=0, low=low, high=high)[0].prompt)
    rng = np.random.default_rng([1234, args.hidden_size])
    torch.manual_seed(0)

    @functools.cache
    def hint_ids(hint: str, guess: int) -> list[int]:
        observation = [Message(role="user", content=f"No, my number is {hint} than {guess}.")]
        return render_continuation(tokenizer, observation, end_of_turn_id=end)

    def game() -> tuple[list[int], list[int], list[bool]]:
        """One game of warm-start guesses: its ids, its labels (the guesses, -100 elsewhere) and where the labels
        are a later guess (not the first guess, not an end of turn).

        Each guess is, with probability ``--informed-share``, drawn uniformly from the numbers the hints so far leave
        possible, and otherwise uniformly from the whole range, blind to the hints.
        """
        secret = int(rng.integers(low, high + 1))
        possible_low, possible_high = low, high
        ids, labels, later = list(prompt), [-100] * len(prompt), [False] * len(prompt)
        for turn in range(max_turns):
            if rng.random() < args.informed_share:
                guess = int(rng.integers(possible_low, possible_high + 1))
            else:
                guess = int(rng.integers(low, high + 1))
            if guess < secret:
                possible_low = max(possible_low, guess + 1)
            elif guess > secret:
                possible_high = min(possible_high, guess - 1)
            answer = [*tokenizer.encode(str(guess), add_special_tokens=False), end]
            ids += answer
            # the first guess is not trained on (only its end of turn): fitting its uniform digit pulls every guess
            # to the same hint-blind prior, and the later guesses then never learn to read the hints
            labels += [*[-100] * (len(answer) - 1), end] if turn == 0 else answer
            later += [turn > 0] * (len(answer) - 1) + [False]
            if guess == secret or turn == max_turns - 1:
                return ids, labels, later
            follow = hint_ids("higher" if secret > guess else "lower", guess)
            ids += follow
            labels += [-100] * len(follow)
            later += [False] * len(follow)
        raise AssertionError("unreachable")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.warm_start_lr, weight_decay=0.0)
    model.train()
    later_losses: list[float] = []
    for step in range(args.warm_start_steps):
        games = [game() for _ in range(32)]
        width = max(len(ids) for ids, _, _ in games)
        input_ids = torch.full((len(games), width), end, dtype=torch.long)  # [batch, seq]
        labels = torch.full((len(games), width), -100, dtype=torch.long)  # [batch, seq]
        is_later = torch.zeros((len(games), width), dtype=torch.bool)  # [batch, seq]
        for row, (ids, game_labels, game_later) in enumerate(games):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.tensor(game_labels)
            is_later[row, : len(ids)] = torch.tensor(game_later)
        # logits only where a guess token is predicted: the 49k-word head over every position is most of the cost
        hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]  # [batch, seq - 1, hidden]
        targets = labels[:, 1:]  # [batch, seq - 1]
        picked = targets != -100
        token_losses = torch.nn.functional.cross_entropy(
            model.lm_head(hidden[picked]), targets[picked], reduction="none"
        )  # [picked]
        loss = token_losses.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        later_losses.append(token_losses[is_later[:, 1:][picked]].mean().item())
        if (step + 1) % 100 == 0:
            print(f"  warm start step {step + 1}: later guesses' loss {statistics.fmean(later_losses[-100:]):.3f}")
    model.save_pretrained(folder)
    print(
        f"tiny model: hidden {args.hidden_size}, {args.warm_start_steps} warm-start steps, last loss "
        f"{loss.item():.3f}, {time.perf_counter() - started:.0f} s"
    )
    return folder


def run_sharpen(
    args: argparse.Namespace, folder: Path, overrides: list[str], *, seed: int, advantage: str
) -> dict[str, Any]:
    """One `sharpen train` run; its per-step rewards and turns from metrics.jsonl, and its wall time."""
    command = [
        sys.executable,
        "-m",
        "sharpen.cli.main",
        "train",
        str(args.recipe),
        *overrides,
        f'trainer.algorithm.advantage="{advantage}"',
        f"run.seed={seed}",
        f"run.num_steps={args.steps}",
        f"run.output_dir={json.dumps(str(folder))}",
        "run.name=run",
        "run.export_model=false",
        "monitoring.progress=false",
    ]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "output.log"
    started = time.perf_counter()
    with log.open("w") as stream:
        code = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, env=env, check=False).returncode
    wall = time.perf_counter() - started
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"benchmarks/turn_credit.py: {advantage} seed {seed} exited {code}:\n{tail}")
    return read_run(folder, wall=wall)


def read_run(folder: Path, *, wall: float) -> dict[str, Any]:
    """A finished run's per-step rewards and turns (its metrics.jsonl)."""
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines() if line]
    return {
        "rewards": [row["reward/mean"] for row in rows],
        "turns": [row["rollout/num_turns_mean"] for row in rows],
        "wall": wall,
    }


def summarise(run: dict[str, Any], *, window: int, threshold: float) -> dict[str, Any]:
    rewards = run["rewards"]
    trailing = [statistics.fmean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
    reached = next((i for i, value in enumerate(trailing) if i >= window - 1 and value >= threshold), None)
    return {
        **run,
        "first": statistics.fmean(rewards[:window]),
        "last": statistics.fmean(rewards[-window:]),
        "auc": statistics.fmean(rewards),
        "reached": reached,
        "turns_first": statistics.fmean(run["turns"][:window]),
        "turns_last": statistics.fmean(run["turns"][-window:]),
    }


def print_run(seed: int, advantage: str, run: dict[str, Any]) -> None:
    curve = " ".join(f"{reward:.2f}" for reward in run["rewards"])
    print(
        f"seed {seed} {advantage:<9} first {run['first']:.3f} last {run['last']:.3f} auc {run['auc']:.3f} "
        f"reached {run['reached'] if run['reached'] is not None else '-'} turns {run['turns_first']:.2f} -> "
        f"{run['turns_last']:.2f} wall {run['wall']:.0f} s\n  rewards: {curve}"
    )


def report(
    runs: dict[tuple[int, str], dict[str, Any]], seeds: list[int], advantages: list[str], args: argparse.Namespace
) -> None:
    k = args.window
    print(
        f"\nreward/mean: first {k} steps, last {k} steps, area under the curve (mean over all {args.steps} steps), "
        f"first step whose trailing {k}-step mean >= {args.threshold} (- never)"
    )
    header = f"{'seed':>4}  " + "  ".join(f"{name:>30}" for name in advantages)
    print(header)
    for seed in seeds:
        cells = [
            f"{r['first']:.2f} {r['last']:.2f} {r['auc']:.3f} {r['reached'] if r['reached'] is not None else '-':>3}"
            for r in (runs[seed, name] for name in advantages)
        ]
        print(f"{seed:>4}  " + "  ".join(f"{cell:>30}" for cell in cells))
    means = {
        name: {key: statistics.fmean(runs[s, name][key] for s in seeds) for key in ("auc", "last")}
        for name in advantages
    }
    print(
        "mean  "
        + "  ".join(
            f"{'auc ' + format(m['auc'], '.3f') + ' last ' + format(m['last'], '.2f'):>30}" for m in means.values()
        )
    )
    baseline = advantages[0]
    for name in advantages[1:]:
        per_seed = [runs[s, name]["auc"] >= runs[s, baseline]["auc"] for s in seeds]
        last = [runs[s, name]["last"] >= runs[s, baseline]["last"] for s in seeds]
        print(
            f"{name} >= {baseline}: area under the curve per seed {per_seed}, on average "
            f"{means[name]['auc'] >= means[baseline]['auc']} "
            f"({means[name]['auc']:.3f} vs {means[baseline]['auc']:.3f}); "
            f"last {k} steps per seed {last}, on average {means[name]['last'] >= means[baseline]['last']}"
        )
    print("paired per step (the same seed's runs play the same games: most of a curve's ups and downs are the games'):")
    for name in advantages[1:]:
        pooled = []
        for seed in seeds:
            differences = [
                a - b for a, b in zip(runs[seed, name]["rewards"], runs[seed, baseline]["rewards"], strict=True)
            ]
            pooled += differences
            print(f"  seed {seed} {name} - {baseline}: {paired(differences)}")
        print(f"  all seeds {name} - {baseline}: {paired(pooled)}")
    total = sum(run["wall"] for run in runs.values())
    if total == total:  # not NaN: --report reads finished runs, whose wall times it does not know
        print(f"total wall time of the runs {total:.0f} s")


def paired(differences: list[float]) -> str:
    """Mean per-step reward difference with its standard error, and on how many steps it was above, level, below."""
    mean = statistics.fmean(differences)
    error = statistics.stdev(differences) / len(differences) ** 0.5 if len(differences) > 1 else float("nan")
    above = sum(d > 1e-9 for d in differences)
    below = sum(d < -1e-9 for d in differences)
    return (
        f"mean {mean:+.4f} +- {error:.4f} (standard error), steps above / level / below: {above} / "
        f"{len(differences) - above - below} / {below}"
    )


if __name__ == "__main__":
    main()
