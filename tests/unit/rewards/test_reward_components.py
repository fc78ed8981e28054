"""The weighted Rubric: the verifier plus [[reward.components]]: arithmetic, zero-weight components logged only,
abstention of a weighted component abstains the whole verdict, merged hack flags, the combined verifier name, and
the length, judge and reward-model components built from their config."""

from __future__ import annotations

import logging

import pytest

from sharpen.config.rewards import (
    JudgeComponentConfig,
    LengthComponentConfig,
    RewardConfig,
    RewardModelComponentConfig,
)
from sharpen.rewards import RewardFn, Rubric
from sharpen.rewards.components import LengthReward, build_component, build_judge
from sharpen.rewards.judge import Judge
from sharpen.rewards.rm_client import RewardModelClient
from sharpen.types import Example, Message, RewardResult, RewardStatus

EXAMPLE = Example(
    task_key="t/0", prompt=(Message(role="user", content="12+7?"),), answer="19", metadata={"source": "jsonl"}
)
RIGHT, WRONG, UNFORMATTED = "<answer>19</answer>", "<answer>18</answer>", "nineteen"
JUDGE = {"base_url": "http://127.0.0.1:9", "model": "m"}


class Fixed:
    """A component that always gives the same verdict and counts its calls."""

    def __init__(self, score: float | None, *, status: RewardStatus = RewardStatus.OK, flags: tuple[str, ...] = ()):
        self.score, self.status, self.flags = score, status, list(flags)
        self.num_calls = 0

    def __call__(self, example: Example, completion: str) -> RewardResult:
        self.num_calls += 1
        return RewardResult(score=self.score, status=self.status, verifier="fixed", hack_flags=list(self.flags))


class Broken:
    def __call__(self, example: Example, completion: str) -> RewardResult:
        raise ConnectionError("service down")


def _config(*components: dict, **weights: float) -> RewardConfig:
    return RewardConfig.model_validate({**weights, "components": list(components)})


def _length(**options: object) -> dict:
    return {"type": "length", "unit": "chars", "target_length": 10, "max_length": 30, **options}


def test_score_is_the_weighted_sum_of_the_verifier_and_every_component():
    config = _config(
        {"type": "judge", **JUDGE, "weight": 3.0},
        {"type": "reward_model", "url": "http://127.0.0.1:9", "name": "rm", "weight": 0.5},
        _length(weight=2.0),
        correct_weight=2.0,
        format_weight=0.5,
    )
    rubric = Rubric(config, components={"judge": Fixed(0.8), "rm": Fixed(-1.2)})
    completion = RIGHT + "x" * 6  # 25 characters: 15 past the target of 10, of a 20-character ramp
    result = rubric(EXAMPLE, completion)
    assert result.status is RewardStatus.OK
    assert result.components == pytest.approx(
        {"correct": 1.0, "format": 1.0, "judge": 0.8, "rm": -1.2, "length": -0.75}
    )
    assert result.score == pytest.approx(2.0 * 1 + 0.5 * 1 + 3.0 * 0.8 + 0.5 * -1.2 + 2.0 * -0.75)
    wrong = rubric(EXAMPLE, WRONG)  # 19 characters
    assert wrong.status is RewardStatus.WRONG, "the verifier's status says whether the answer was right"
    assert wrong.score == pytest.approx(0.5 * 1 + 3.0 * 0.8 + 0.5 * -1.2 + 2.0 * -0.45)


def test_a_zero_weight_component_is_computed_and_logged_but_does_not_change_the_score():
    logged = Fixed(0.9)
    rubric = Rubric(_config({"type": "judge", **JUDGE, "weight": 0.0}), components={"judge": logged})
    alone = Rubric(RewardConfig())(EXAMPLE, RIGHT)
    result = rubric(EXAMPLE, RIGHT)
    assert logged.num_calls == 1
    assert result.components["judge"] == 0.9
    assert result.score == alone.score == 1.0 and result.status is alone.status


def test_a_zero_weight_component_that_abstains_changes_nothing():
    rubric = Rubric(_config({"type": "judge", **JUDGE, "weight": 0.0}), components={"judge": Fixed(None)})
    result = rubric(EXAMPLE, RIGHT)
    assert result.score == 1.0 and result.status is RewardStatus.OK
    assert "judge" not in result.components, "an abstention is not logged as a made-up score"


@pytest.mark.parametrize("status", [RewardStatus.JUDGE_UNPARSEABLE, RewardStatus.TIMEOUT, RewardStatus.INFRA_ERROR])
def test_a_weighted_component_that_abstains_abstains_the_whole_verdict_with_its_status(status):
    config = _config({"type": "judge", **JUDGE, "weight": 1.0}, _length(weight=1.0))
    result = Rubric(config, components={"judge": Fixed(None, status=status, flags=("judge_injection",))})(
        EXAMPLE, RIGHT
    )
    assert result.score is None and result.status is status
    assert result.components["correct"] == 1.0 and result.components["length"] == pytest.approx(-0.45)
    assert result.hack_flags == ["judge_injection"]


def test_a_component_that_raises_abstains_with_infra_error(caplog):
    rubric = Rubric(_config({"type": "judge", **JUDGE}), components={"judge": Broken()})
    with caplog.at_level(logging.WARNING, logger="sharpen.rewards.rubric"):
        result = rubric(EXAMPLE, RIGHT)
    assert result.score is None and result.status is RewardStatus.INFRA_ERROR
    assert "reward component judge failed on t/0" in caplog.text


def test_a_verifier_failure_abstains_only_while_the_verifier_is_weighted():
    class Crashing:
        name = "crashing"

        def __call__(self, example: Example, answer: str) -> float:
            raise RuntimeError("verifier bug")

    verifiers = {"jsonl": Crashing()}
    judge = {"type": "judge", **JUDGE}
    weighted = Rubric(_config(judge), verifiers=verifiers, components={"judge": Fixed(0.7)})
    assert weighted(EXAMPLE, RIGHT).score is None
    # with both verifier weights 0 the verifier is logged only: the judge decides score and status
    judge_only = Rubric(
        _config(judge, correct_weight=0.0),
        verifiers=verifiers,
        components={"judge": Fixed(0.3, status=RewardStatus.WRONG)},
    )
    result = judge_only(EXAMPLE, RIGHT)
    assert result.score == pytest.approx(0.3) and result.status is RewardStatus.WRONG


def test_hack_flags_of_all_components_are_merged_once_each():
    config = _config({"type": "judge", **JUDGE}, {"type": "judge", **JUDGE, "name": "judge2", "weight": 0.0})
    judge = Fixed(1.0, flags=("judge_injection",))
    other = Fixed(1.0, flags=("judge_injection", "length_gaming"))
    result = Rubric(config, components={"judge": judge, "judge2": other})(EXAMPLE, RIGHT)
    assert result.hack_flags == ["judge_injection", "length_gaming"]


def test_verifier_name_and_version_describe_the_combination():
    plain = Rubric(RewardConfig())(EXAMPLE, RIGHT)
    assert plain.verifier == "exact_match" and plain.verifier_version == "", "no components: the verifier's verdict"
    config = _config({"type": "judge", **JUDGE}, _length())
    combined = Rubric(config, components={"judge": Fixed(0.5)})(EXAMPLE, RIGHT)
    assert combined.verifier == "exact_match+fixed+length:chars"
    reweighted = _config({"type": "judge", **JUDGE, "weight": 2.0}, _length())
    assert Rubric(reweighted, components={"judge": Fixed(0.5)})(EXAMPLE, RIGHT).verifier_version not in (
        "",
        combined.verifier_version,
    )


def test_format_errors_keep_their_status_with_components():
    rubric = Rubric(_config(_length()), components={})
    result = rubric(EXAMPLE, UNFORMATTED)
    assert result.status is RewardStatus.FORMAT_ERROR and result.score == 0.0


@pytest.mark.parametrize(("num_chars", "score"), [(0, 0.0), (10, 0.0), (20, -0.5), (30, -1.0), (500, -1.0)])
def test_length_shaping_is_zero_to_the_target_then_falls_to_minus_one(num_chars, score):
    reward = build_component(LengthComponentConfig.model_validate(_length()))
    assert isinstance(reward, LengthReward) and isinstance(reward, RewardFn)
    result = reward(EXAMPLE, "x" * num_chars)
    assert result.score == pytest.approx(score) and result.status is RewardStatus.OK


def test_length_in_tokens_needs_the_tokenizer():
    config = LengthComponentConfig(target_length=2, max_length=4)
    with pytest.raises(ValueError, match="counts tokens: pass count_tokens"):
        build_component(config)
    reward = build_component(config, count_tokens=lambda text: len(text.split()))
    assert reward(EXAMPLE, "one two three").score == pytest.approx(-0.5)


def test_components_are_built_from_config(monkeypatch):
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", "t")  # the reward model client reads serve-rm's token at start
    rubric = Rubric(
        _config({"type": "judge", **JUDGE, "max_score": 5.0}, {"type": "reward_model", "url": "http://h:1"})
    )
    judge, model = (c.reward_fn for c in rubric.components)
    assert isinstance(judge, Judge) and judge.prompt.max_score == 5.0 and judge.verifier == "judge:m"
    assert isinstance(model, RewardModelClient) and model.url == "http://h:1"
    assert rubric.judges() == {"judge": judge}


def test_judge_api_key_is_read_from_the_named_environment_variable(monkeypatch, tmp_path):
    config = JudgeComponentConfig(**JUDGE, api_key_env="SHARPEN_TEST_JUDGE_KEY", cache_path=str(tmp_path / "c/j.jsonl"))
    monkeypatch.delenv("SHARPEN_TEST_JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match="SHARPEN_TEST_JUDGE_KEY', but that environment variable is not set"):
        build_judge(config)
    monkeypatch.setenv("SHARPEN_TEST_JUDGE_KEY", "secret")
    judge = build_judge(config)
    assert judge.client.client.config.token_env == "SHARPEN_TEST_JUDGE_KEY"  # type: ignore[attr-defined]
    assert (tmp_path / "c").is_dir(), "the cache's folder is made at start"


def test_a_ray_reward_model_must_be_started_by_the_runtime():
    config = RewardModelComponentConfig(backend="ray", model_path="/models/rm")
    with pytest.raises(ValueError, match="runs in actors that the runtime starts"):
        Rubric(RewardConfig(components=[config]))
    started = Fixed(0.1)
    assert (
        Rubric(RewardConfig(components=[config]), components={"reward_model": started}).components[0].reward_fn
        is started
    )


def test_given_components_must_be_configured():
    with pytest.raises(ValueError, match=r"components \['rm'\] are not in reward.components"):
        Rubric(RewardConfig(), components={"rm": Fixed(0.0)})


def test_a_custom_base_replaces_the_verifier():
    rubric = Rubric(_config(_length(weight=1.0)), base=Fixed(1.0, status=RewardStatus.OK))
    result = rubric(EXAMPLE, "x" * 20)
    assert result.score == pytest.approx(0.5) and result.verifier == "fixed+length:chars"
