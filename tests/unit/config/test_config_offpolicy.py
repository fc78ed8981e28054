"""trainer.algorithm.off_policy_reject and off_policy_normalize: recipes load, and each bad input is one line naming
its key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sharpen.config import ConfigError, load_config

_KEY = "trainer.algorithm.off_policy_reject"


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message, f"expected one line, got: {message!r}"
    return message


def test_defaults_reject_nothing_and_do_not_normalise():
    algorithm = load_config(None).trainer.algorithm
    assert algorithm.off_policy_reject == [] and algorithm.off_policy_normalize is False


def test_a_recipe_chains_criteria_as_an_array_of_tables(tmp_path: Path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        "[trainer.algorithm]\n"
        "off_policy_normalize = true\n"
        "[[trainer.algorithm.off_policy_reject]]\n"
        'level = "token"\nlow = 0.5\nhigh = 2.0\n'
        "[[trainer.algorithm.off_policy_reject]]\n"
        'level = "sequence"\nstatistic = "max"\ndivergence = "k3"\nhigh = 1.0\n'
    )
    algorithm = load_config(recipe).trainer.algorithm
    assert [c.name for c in algorithm.off_policy_reject] == ["token_k1", "seq_max_k3"]
    assert algorithm.off_policy_normalize
    override = f'{_KEY}=[{{level = "sequence", statistic = "mean", low = 0, high = 1.5}}]'
    (criterion,) = load_config(None, [override]).trainer.algorithm.off_policy_reject
    assert (criterion.name, criterion.low, criterion.high) == ("seq_mean_k1", 0.0, 1.5)


@pytest.mark.parametrize(
    ("criteria", "message"),
    [
        ('{level = "token", high = 2.0}', rf"{_KEY}\.0: a k1 criterion needs low"),
        ('{level = "token", low = 0.5, high = 0.9}', rf"{_KEY}\.0: a k1 criterion needs high >= 1"),
        ('{level = "token", low = 1.2, high = 2.0}', rf"{_KEY}\.0\.low: Input should be less than or equal to 1"),
        ('{level = "token", divergence = "k2", low = 0.1, high = 1.0}', rf"{_KEY}\.0: low applies to k1 only"),
        ('{level = "token", statistic = "sum", low = 0.5, high = 2.0}', rf"{_KEY}\.0: statistic applies to level"),
        ('{level = "sequence", low = 0.5, high = 2.0}', rf'{_KEY}\.0: level = "sequence" needs statistic'),
        ('{level = "sequence", statistic = "max", low = 0.5, high = 2.0}', rf'{_KEY}\.0: statistic = "max" needs'),
        ('{level = "token", divergence = "k3", high = 0}', rf"{_KEY}\.0\.high: Input should be greater than 0"),
        ('{level = "token", divergence = "k3"}', rf"{_KEY}\.0\.high: Field required"),
        ('{level = "tokens", low = 0.5, high = 2.0}', rf"{_KEY}\.0\.level: Input should be 'token' or 'sequence'"),
        ('{level = "token", low = 0.5, high = 2.0, cap = 3}', rf"{_KEY}\.0\.cap: unknown key"),
        (
            '{level = "token", low = 0.5, high = 2.0}, {level = "token", low = 0.2, high = 3.0}',
            r"trainer\.algorithm: off_policy_reject lists token_k1 more than once",
        ),
    ],
)
def test_each_bad_criterion_is_one_line_naming_its_key(criteria: str, message: str):
    error = _error([f"{_KEY}=[{criteria}]"])
    assert re.match(message, error), error


@pytest.mark.parametrize("mode", ["none", "token_mask", "sequence_mask"])
def test_normalising_needs_importance_weights(mode: str):
    message = _error(
        ["trainer.algorithm.off_policy_normalize=true", f'trainer.algorithm.off_policy_correction="{mode}"']
    )
    assert message.startswith("trainer.algorithm: off_policy_normalize needs importance weights")
    assert f'"{mode}"' in message
