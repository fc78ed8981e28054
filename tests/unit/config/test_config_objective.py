"""The objective as typed parts: each part chosen by ``type`` carries its paper's knobs; a name alone is the part
with its defaults; the flat keys of earlier recipes and resolved configs still load, to the same config."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path
from typing import get_args

import pytest

from sharpen.config import ConfigError, dump_config, load_config
from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.legacy_keys import TYPED_SECTIONS
from sharpen.config.policy_losses import PolicyLossConfig
from sharpen.config.section import DeprecatedKeyWarning

_LEGACY = Path(__file__).parent / "legacy_configs"
"""Resolved configs written by sharpen before the objective was typed (`sharpen config` of each recipe at commit
f6a71a7): what a run directory of an earlier version holds."""
_RECIPES = Path(__file__).parents[3] / "recipes"


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message, f"expected one line, got: {message!r}"
    return message


def test_gspo_by_its_name_alone_runs_with_its_papers_clip_range_and_aggregation(tmp_path: Path):
    config = load_config(None, ['trainer.algorithm.policy_loss="gspo"'])
    resolved = tomllib.loads(dump_config(config))["trainer"]["algorithm"]  # what the run directory keeps
    # Zheng et al. 2025 (GSPO), section 5.1: clipping ranges 3e-4 (left) and 4e-4 (right); sequence-mean loss.
    assert resolved["policy_loss"] == {"type": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4}
    assert resolved["loss_aggregation"] == "seq_mean_token_mean"
    # the resolved config loads back to the same config, as `--resume` and `sharpen replay` read it
    (tmp_path / "resolved.toml").write_text(dump_config(config))
    assert load_config(tmp_path / "resolved.toml") == config


def test_each_part_defaults_to_its_papers_aggregation():
    defaults = {
        section.model_fields["type"].default: section.paper_aggregation
        for section in get_args(get_args(PolicyLossConfig)[0])
    }
    for name, aggregation in defaults.items():
        algorithm = AlgorithmConfig.model_validate({"policy_loss": name})
        assert algorithm.aggregation == aggregation
    assert defaults["ppo_clip"] == "token_mean" and defaults["gmpo"] == defaults["sapo"] == "seq_mean_token_mean"
    # an explicit choice wins where the loss allows it
    assert AlgorithmConfig(policy_loss="sapo", loss_aggregation="token_mean").aggregation == "token_mean"


def test_a_sequence_objective_refuses_another_aggregation():
    message = _error(['trainer.algorithm.policy_loss="gspo"', 'trainer.algorithm.loss_aggregation="token_mean"'])
    assert message.startswith('trainer.algorithm: policy_loss = "gspo" is a sequence-level objective')


def test_a_part_carries_only_its_own_knobs():
    message = _error(['trainer.algorithm.policy_loss={type = "sapo", clip_eps_high = 0.3}'])
    assert message == (
        "trainer.algorithm.policy_loss.clip_eps_high: unknown key "
        "(it belongs to type = 'cispo' or 'clip_cov' or 'gspo' or 'ppo_clip')"
    )
    assert _error(['trainer.algorithm.advantage="passk"']).startswith("trainer.algorithm.advantage.k: Field required")
    assert _error(['trainer.algorithm.kl="loss"']).startswith("trainer.algorithm.kl.coef: Field required")
    message = _error(['trainer.algorithm.policy_loss="ppo"'])
    assert message.startswith("trainer.algorithm.policy_loss: Input tag 'ppo' found using 'type' does not match")


@pytest.mark.parametrize("name", sorted(p.stem for p in _LEGACY.glob("*.toml")))
def test_an_earlier_versions_resolved_config_loads_to_todays_recipe(name: str):
    with pytest.warns(DeprecatedKeyWarning) as caught:
        legacy = load_config(_LEGACY / f"{name}.toml")
    lines = sorted(str(warning.message).split(":")[0] for warning in caught)
    assert lines == ['runtime.type = "local" is now called "embedded"', "trainer.algorithm"], "one line each"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # today's recipes use no deprecated key
        today = load_config(_RECIPES / f"{name}.toml")
    # reward.judge_canary_every: the earlier versions wrote their default 0 (never); today's default (unset) runs the
    # canaries only with a judge, and these recipes have none, so both mean never
    assert legacy.reward.judge_canary_every == 0 and today.reward.judge_canary_every is None
    assert legacy.reward.canary_every_steps() == today.reward.canary_every_steps() == 0
    reward = legacy.reward.model_copy(update={"judge_canary_every": None})
    assert legacy.model_copy(update={"reward": reward}) == today


def test_the_deprecation_line_says_what_to_write():
    with pytest.warns(DeprecatedKeyWarning) as caught:
        load_config(None, ['trainer.algorithm.policy_loss="ppo_clip"', "trainer.algorithm.clip_eps_high=0.28"])
    (warning,) = caught
    assert str(warning.message) == (
        "trainer.algorithm: the flat keys clip_eps_high are deprecated; they were read as "
        'policy_loss = {type = "ppo_clip", clip_eps_high = 0.28} (write that in the recipe; docs/algorithms.md, '
        "Configuration)"
    )


def test_flat_kl_keys_choose_the_kl_form():
    with pytest.warns(DeprecatedKeyWarning):
        kl = load_config(None, ["trainer.algorithm.kl_coef=0.05", 'trainer.algorithm.kl_estimator="k3"']).trainer
    assert kl.algorithm.kl.model_dump() == {
        "type": "loss",
        "coef": 0.05,
        "estimator": "k3",
        "target": None,
        "horizon": 10000,
    }
    with pytest.warns(DeprecatedKeyWarning):
        kl = load_config(None, ["trainer.algorithm.kl_coef=0.05", "trainer.algorithm.kl_in_reward=true"]).trainer
    assert kl.algorithm.kl.type == "reward" and kl.algorithm.kl.in_reward
    assert _error(["trainer.algorithm.kl_in_reward=true"]) == "trainer.algorithm: kl_in_reward needs kl_coef > 0"
    message = _error(['trainer.algorithm.kl={type = "loss", coef = 0.1}', "trainer.algorithm.kl_coef=0.2"])
    assert message == "trainer.algorithm: kl_coef and kl.coef are both set: keep the second"


def test_the_typed_sections_are_the_discriminated_fields():
    discriminated = {name for name, field in AlgorithmConfig.model_fields.items() if field.discriminator == "type"}
    assert discriminated == set(TYPED_SECTIONS)


def test_flat_knobs_dropped_to_what_each_part_needs():
    # 34 flat fields before; each part's knobs now live in its own section (the 11th: the adaptive entropy section)
    assert len(AlgorithmConfig.model_fields) == 11
    sizes = {s.model_fields["type"].default: len(s.model_fields) for s in get_args(get_args(PolicyLossConfig)[0])}
    assert sizes == {"ppo_clip": 4, "gspo": 3, "cispo": 3, "sapo": 3, "gmpo": 3, "clip_cov": 6, "kl_cov": 3, "pg": 1}


def test_a_turn_level_estimator_needs_a_multi_turn_environment():
    assert _error(['trainer.algorithm.advantage="gigpo"']) == (
        'trainer.algorithm.advantage = "gigpo" gives each turn of an episode its own advantage and needs a multi-turn '
        'environment (environment.max_turns > 1), not environment.type = "single_turn": use an episode-level '
        'estimator such as "grpo" there'
    )
    game = ['environment.type="guess_number"', 'data.type="environment"']
    message = _error(['trainer.algorithm.advantage="turn_grpo"', *game, "environment.max_turns=1"])
    assert 'not environment.type = "guess_number" with max_turns = 1' in message
    config = load_config(None, ['trainer.algorithm.advantage="turn_grpo"', *game])
    assert config.trainer.algorithm.advantage.model_dump() == {"type": "turn_grpo", "gamma": 0.95, "std": "unbiased"}


def test_a_turn_discount_outside_0_1_is_refused():
    game = ['environment.type="guess_number"', 'data.type="environment"']
    message = _error(['trainer.algorithm.advantage={type = "gigpo", gamma = 1.5}', *game])
    assert message.startswith("trainer.algorithm.advantage.gamma: Input should be less than or equal to 1")
    message = _error(['trainer.algorithm.advantage={type = "turn_grpo", gamma = -0.1}', *game])
    assert message.startswith("trainer.algorithm.advantage.gamma: Input should be greater than or equal to 0")
    assert _error(['trainer.algorithm.advantage={type = "gigpo", omega = -1}', *game]).startswith(
        "trainer.algorithm.advantage.omega: Input should be greater than or equal to 0"
    )
