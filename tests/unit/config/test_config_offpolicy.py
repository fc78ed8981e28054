"""trainer.algorithm.off_policy_correction's reject and normalize: recipes load, and each bad input is one line naming
its key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sharpen.config import ConfigError, load_config

_KEY = "trainer.algorithm.off_policy_correction.reject"


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message, f"expected one line, got: {message!r}"
    return message


def test_defaults_reject_nothing_and_do_not_normalise():
    correction = load_config(None).trainer.algorithm.off_policy_correction
    assert correction.reject == [] and correction.normalizes_weights() is False


def test_a_recipe_chains_criteria_as_an_array_of_tables(tmp_path: Path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        "[trainer.algorithm.off_policy_correction]\n"
        'type = "token_tis"\nnormalize = true\n'
        "[[trainer.algorithm.off_policy_correction.reject]]\n"
        'level = "token"\nlow = 0.5\nhigh = 2.0\n'
        "[[trainer.algorithm.off_policy_correction.reject]]\n"
        'level = "sequence"\nstatistic = "max"\ndivergence = "k3"\nhigh = 1.0\n'
    )
    correction = load_config(recipe).trainer.algorithm.off_policy_correction
    assert [c.name for c in correction.reject] == ["token_k1", "seq_max_k3"]
    assert correction.normalizes_weights()
    override = f'{_KEY}=[{{level = "sequence", statistic = "mean", low = 0, high = 1.5}}]'
    (criterion,) = load_config(None, [override]).trainer.algorithm.off_policy_correction.reject
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
            r"trainer\.algorithm\.off_policy_correction: reject lists token_k1 more than once",
        ),
    ],
)
def test_each_bad_criterion_is_one_line_naming_its_key(criteria: str, message: str):
    error = _error([f"{_KEY}=[{criteria}]"])
    assert re.match(message, error), error


@pytest.mark.parametrize("mode", ["none", "token_mask", "sequence_mask"])
def test_normalising_needs_importance_weights(mode: str):
    message = _error([f'trainer.algorithm.off_policy_correction={{type = "{mode}", normalize = true}}'])
    assert message == (
        "trainer.algorithm.off_policy_correction.normalize: unknown key "
        "(it belongs to type = 'icepop' or 'sequence_tis' or 'token_tis')"
    )


def test_the_flat_keys_of_earlier_recipes_still_load_with_one_deprecation_line():
    flat = ['trainer.algorithm.off_policy_correction="icepop"', "trainer.algorithm.off_policy_normalize=true"]
    with pytest.warns(FutureWarning, match="the flat keys off_policy_normalize are deprecated") as caught:
        correction = load_config(None, flat).trainer.algorithm.off_policy_correction
    assert len(caught) == 1
    assert correction.type == "icepop" and correction.normalizes_weights()
    message = _error(
        ['trainer.algorithm.off_policy_correction="token_mask"', "trainer.algorithm.off_policy_normalize=1"]
    )
    assert message == (
        "trainer.algorithm: off_policy_normalize = 1 applies to off_policy_correction = 'icepop' or "
        "'sequence_tis' or 'token_tis', not 'token_mask': it had no effect; remove it"
    )
