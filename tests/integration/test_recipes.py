"""Every algorithm recipe runs end to end with the tiny model and the transformers engine; switching to SmolLM2 is
a change of `model.path` only (the recipes name it; here it is overridden). A recipe whose prompts show images runs
on the tiny Qwen2-VL instead (a text model refuses them), or, if the recipe generates with vLLM, on vLLM with the tiny
Idefics3 (the vision-language model vLLM's CPU build serves)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sharpen.config import SharpenConfig, load_config
from sharpen.config.advantages import PassKAdvantage
from sharpen.data.chat import ImageInputError
from sharpen.monitoring import read_jsonl
from sharpen.orchestration.build import load_run_examples
from sharpen.orchestration.embedded import run_embedded
from sharpen.types import Example, RewardResult, RewardStatus

RECIPES = sorted(p for p in (Path(__file__).parents[2] / "recipes").glob("*.toml") if p.stem != "demo")


def vowel_reward(example: Example, completion: str) -> RewardResult:
    """Random tokens give varied scores, so every recipe sees non-zero advantages."""
    score = sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)
    return RewardResult(score=score, status=RewardStatus.OK, components={"vowels": score}, verifier="vowels")


def even_length_reward(example: Example, completion: str) -> RewardResult:
    """Right (1) or wrong (0) for the pass@k advantage, which counts only scores >= 1 as correct (a vowel fraction
    never is): whether the random text has an even number of characters, about one sample in two."""
    score = float(len(completion) % 2 == 0)
    return RewardResult(score=score, status=RewardStatus.OK, components={"even": score}, verifier="even")


def shows_images(config: SharpenConfig) -> bool:
    """Whether the recipe's prompts carry images: the run's own check refuses them for the tiny text model."""
    try:
        load_run_examples(config)
    except ImageInputError:
        return True
    return False


def test_every_algorithm_has_a_recipe() -> None:
    assert {p.stem for p in RECIPES} >= {
        "grpo",
        "drgrpo",
        "dapo",
        "rloo",
        "reinforce_pp",
        "gspo",
        "ppo",
        "remax",
        "turn_grpo",
        "gigpo",
    }


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_runs_with_the_tiny_model(
    recipe: Path,
    tiny_model_path: Path,
    tiny_moe_path: Path,
    tiny_vlm_path: Path,
    tiny_idefics3_path: Path,
    tmp_path: Path,
) -> None:
    replays_routes = load_config(recipe).trainer.moe.routing_replay != "none"  # needs a Mixture-of-Experts model
    overrides = [
        f"model.path={json.dumps(str(tiny_moe_path if replays_routes else tiny_model_path))}",
        f"run.output_dir={json.dumps(str(tmp_path))}",
        "run.num_steps=2",
        "run.export_model=false",
        # the whole engine section: a vLLM recipe's own engine keys (max_model_len) are not the hf engine's
        'rollout.engine={type = "hf"}',
        "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=12",
        "trainer.micro_batch_size=4",
        "trainer.learning_rate=1e-3",
        "monitoring.progress=false",
        "data.size=64",
    ]
    if "overlong_buffer_tokens" in recipe.read_text():
        overrides.append("reward.overlong_buffer_tokens=4")
    if "mask_truncated = true" in recipe.read_text():
        # A random tiny model never emits EOS: every completion is truncated and overlong filtering would leave
        # nothing to train on (tests/unit/orchestration covers the filter itself).
        overrides.append("trainer.algorithm.mask_truncated=false")
    is_passk = isinstance(load_config(recipe).trainer.algorithm.advantage, PassKAdvantage)
    if is_passk:
        # only a group with 1 to n - k right samples trains: 8 groups make one all but certain in each step
        overrides.append("rollout.prompts_per_step=8")
    config = load_config(recipe, overrides)
    if shows_images(config):
        # a vLLM recipe gets the model vLLM's CPU build runs, on the hf engine as every recipe here: a run through
        # vLLM on image prompts is tests/integration/test_vllm_images.py's, on its module's engine
        model = tiny_idefics3_path if load_config(recipe).rollout.engine.type == "vllm" else tiny_vlm_path
        config = load_config(recipe, [*overrides, f"model.path={json.dumps(str(model))}"])
    run_dir = run_embedded(config, reward_fn=even_length_reward if is_passk else vowel_reward)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    # trainer.precision = "auto" picks bf16 on a CPU that runs it fast: the engine and the trainer then round
    # differently (measured here: 4e-4 mean), far below the probe's bf16 tolerance but above float32's agreement.
    precision = json.loads((run_dir / "precision.json").read_text())["precision"]
    max_mismatch = 1e-4 if precision == "float32" else 5e-3
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert "train/skipped" not in row
        assert math.isfinite(row["train/loss"]) and math.isfinite(row["train/grad_norm"])
        assert row["train/num_optimizer_steps"] == config.trainer.algorithm.num_mini_batches
        assert row["sync/probe_mismatch_mean"] < max_mismatch
    if any(f'type = "{kind}"' in recipe.read_text() for kind in ("browser", "terminal", "repository")):
        # the browser's task rewards, not vowel_reward: a random tiny model never writes a tool call, every reward is
        # 0 and nothing moves (tests/integration/test_browser_env.py, tests/unit/environments/test_env_terminal.py and
        # test_env_repository.py cover the environments with scripted actions)
        assert rows[-1]["reward/mean"] == 0.0
        return
    if config.trainer.algorithm.advantage.needs_turns:
        # the guess-number game's own rewards, not vowel_reward: a random tiny model rarely names the secret, so every
        # advantage may be 0 and nothing move (tests/unit/trainer/algorithms/test_trainer_turn_estimators.py and
        # tests/unit/orchestration/test_orchestration_turn_advantages.py cover the estimators on hand-made episodes)
        assert all(math.isfinite(row["reward/mean"]) and row["rollout/num_turns_mean"] >= 1.0 for row in rows)
        return
    assert rows[-1]["sync/probe_trainer_delta"] > 0.0  # the policy moved and the engine followed
    if config.trainer.algorithm.kl.in_reward:
        assert rows[-1]["reward/kl_penalty"] != 0.0  # the policy moved away from the frozen reference
    elif config.trainer.algorithm.kl.needs_reference:
        assert rows[-1]["train/kl"] > 0.0  # the reference is a separate, frozen copy
    if replays_routes:  # the engine's routes came with every rollout and were measured against the trainer's
        assert all(0.0 <= row["moe/engine_disagreement"] <= 0.1 for row in rows)
        assert all(row["moe/logprob_gap_replayed"] < 1e-4 for row in rows)
    if config.trainer.algorithm.advantage.needs_critic:
        assert all(math.isfinite(row["critic/value_loss"]) for row in rows)
        assert rows[0]["critic/value_mean"] == 0.0  # the fresh head predicts exactly 0
        assert rows[1]["critic/value_mean"] != rows[0]["critic/value_mean"]  # the critic trained in step 0
