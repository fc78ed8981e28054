"""[[reward.components]] in a recipe: loading, default names, a TOML round trip, and one clear line per mistake."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sharpen.config import ConfigError, dump_config, load_config
from sharpen.config.rewards import JudgeComponentConfig, LengthComponentConfig, RewardModelComponentConfig
from sharpen.config.section import DeprecatedKeyWarning

RECIPE = """
[reward]
correct_weight = 1.0
judge_canary_every = 10

[[reward.components]]
type = "judge"
base_url = "http://127.0.0.1:8000/v1"
model = "Qwen/Qwen2.5-7B-Instruct"
api_key_env = "JUDGE_API_KEY"
weight = 0.5

[[reward.components]]
type = "reward_model"
name = "rm"
backend = "ray"
model_path = "/models/rm"
fleet = { num_replicas = 2, num_cpus = 0.5 }
weight = 0.0

[[reward.components]]
type = "length"
target_length = 256
max_length = 512
"""


def _error(*components: str, extra: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"reward.components=[{', '.join(components)}]", *extra])
    message = str(info.value)
    assert "\n" not in message, f"expected one line, got: {message!r}"
    return message


def test_a_recipe_with_components_loads_and_round_trips(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE)
    config = load_config(recipe)
    judge, model, length = config.reward.components
    assert isinstance(judge, JudgeComponentConfig) and judge.name == "judge" and judge.weight == 0.5
    assert isinstance(model, RewardModelComponentConfig) and model.name == "rm" and model.fleet.num_replicas == 2
    assert isinstance(length, LengthComponentConfig) and length.name == "length" and length.unit == "tokens"
    assert config.reward.judge_canary_every == 10
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(dump_config(config))
    assert load_config(dumped) == config


def test_no_components_by_default():
    config = load_config(None)
    assert config.reward.components == [] and config.reward.judge_canary_every is None
    assert config.reward.canary_every_steps() == 0


JUDGE = '{type="judge", base_url="http://x", model="m"}'


@pytest.mark.parametrize(
    ("components", "expected"),
    [
        (
            '{type="jury"}',
            "reward.components.0: Input tag 'jury' found using 'type' does not match any of the expected tags: "
            "'judge', 'reward_model', 'length'",
        ),
        ('{base_url="http://x", model="m"}', "reward.components.0: missing key 'type' (it chooses the implementation)"),
        (
            '{type="judge", base_url="http://x", model="m", weight=-1}',
            "reward.components.0.weight: Input should be greater than or equal to 0 (got -1)",
        ),
        (f"{JUDGE}, {JUDGE}", "reward: 2 components are named 'judge'; give each a distinct name"),
        (
            '{type="length", target_length=1, max_length=9, name="format"}',
            "reward.components.0.name: component name 'format' is taken by the rubric or its metrics",
        ),
        (
            '{type="length", target_length=1, max_length=9, name="My Length"}',
            "reward.components.0.name: component name 'My Length': use lowercase letters, digits and _",
        ),
        (
            '{type="length", target_length=1, max_length=9, name="status_ok"}',
            "reward.components.0.name: component name 'status_ok' is taken",
        ),
        (
            '{type="reward_model"}',
            "reward.components.0: reward model 'reward_model': backend = \"http\" needs url",
        ),
        (
            '{type="reward_model", backend="ray"}',
            "reward.components.0: reward model 'reward_model': backend = \"ray\" needs model_path",
        ),
        (
            '{type="length", target_length=10, max_length=10}',
            "reward.components.0: length 'length': max_length (10) must exceed target_length (10)",
        ),
        (
            '{type="judge", base_url="http://x", model="m", max_score=0}',
            "reward.components.0: judge 'judge': max_score (0.0) must exceed min_score (0.0)",
        ),
        ('{type="judge", base_url="http://x"}', 'reward.components.0.model: Field required (got {"type": "judge"'),
        ('{type="judge", base_url="http://x", model="m", temprature=0}', "reward.components.0.temprature: unknown key"),
    ],
)
def test_each_mistake_is_one_clear_line(components, expected):
    assert _error(components).startswith(expected)


def test_judge_canaries_need_a_judge():
    message = _error('{type="length", target_length=1, max_length=9}', extra=("reward.judge_canary_every=5",))
    assert (
        message == 'reward: judge_canary_every = 5 needs a judge: add a [[reward.components]] table with type = "judge"'
    )
    assert load_config(None, [f"reward.components=[{JUDGE}]", "reward.judge_canary_every=5"])


def test_an_error_inside_a_typed_section_names_the_section():
    """The environment section shares a name with a data tag ("environment"); the key keeps it."""
    with pytest.raises(ConfigError, match=r"^environment\.max_turns: "):
        load_config(None, ["environment.type=calculator", "environment.max_turns=0"])


def test_the_toml_examples_of_docs_rewards_md_are_valid_recipes(tmp_path):
    docs = Path(__file__).resolve().parents[3] / "docs" / "rewards.md"
    components, served = re.findall(r"```toml\n(.*?)```", docs.read_text(), flags=re.DOTALL)
    recipe = tmp_path / "r.toml"
    recipe.write_text(components)
    config = load_config(recipe)
    assert [c.type for c in config.reward.components] == ["judge", "reward_model", "length", "custom"]
    recipe.write_text(served)  # serving a reward model
    (model,) = load_config(recipe).reward.components
    assert model.type == "reward_model" and (model.backend, model.url) == ("http", "http://rm-host:8300")


def test_the_reward_models_old_actor_keys_load_into_its_fleet_with_a_deprecation():
    old = '{type="reward_model", backend="ray", model_path="/m", num_actors=2, cpus_per_actor=0.5, gpus_per_actor=1}'
    with pytest.warns(DeprecatedKeyWarning, match=r"'reward_model': num_actors is now fleet\.num_replicas"):
        (model,) = load_config(None, [f"reward.components=[{old}]"]).reward.components
    assert isinstance(model, RewardModelComponentConfig)
    assert (model.fleet.num_replicas, model.fleet.num_cpus, model.fleet.num_gpus) == (2, 0.5, 1.0)
    both = '{type="reward_model", backend="ray", model_path="/m", num_actors=2, fleet={num_replicas=3}}'
    with pytest.warns(DeprecatedKeyWarning):
        assert "fleet.num_replicas is given twice (once by its old name)" in _error(both)
