"""The custom reward component: a function or class from the user's file or module, loaded once when the Rubric is
built, scored through the Rubric (weight applied, abstention propagated), and one clear error for a bad path, bad
arguments or a return value that is not a verdict."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sharpen.config.loader import load_config
from sharpen.config.rewards import CustomComponentConfig, RewardConfig
from sharpen.plugins import PluginLoadError
from sharpen.rewards import Rubric
from sharpen.rewards.base import RewardContractError
from sharpen.rewards.scoring import score_rollout
from sharpen.types import Example, Message, RewardStatus, Rollout

EXAMPLE = Example(
    task_key="t/0", prompt=(Message(role="user", content="12+7?"),), answer="19", metadata={"source": "jsonl"}
)
RIGHT, LONG = "<answer>19</answer>", "<answer>19</answer> because twelve plus seven is nineteen"

REWARDS = '''
from sharpen.types import RewardResult, RewardStatus

def brevity(example, completion, *, limit):
    return 1.0 if len(completion) <= limit else 0.0

def answer_echo(example, completion):
    return example.answer in completion  # a bool is a number: 1 or 0

def undecided(example, completion):
    return RewardResult(score=None, status=RewardStatus.TIMEOUT, verifier="undecided")

def forgot_to_return(example, completion):
    completion.upper()

def not_a_number(example, completion):
    return float("nan")

class Counter:
    """Built once with the kwargs; keeps state between calls."""

    def __init__(self, *, step):
        self.step, self.num_calls = step, 0

    def __call__(self, example, completion):
        self.num_calls += 1
        return self.step * self.num_calls
'''


@pytest.fixture
def rewards_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    return "my_rewards.py"


def _rubric(*components: dict, **weights: float) -> Rubric:
    return Rubric(RewardConfig.model_validate({**weights, "components": list(components)}))


def test_a_function_from_a_file_is_weighted_into_the_score(rewards_file):
    rubric = _rubric(
        {
            "type": "custom",
            "name": "brevity",
            "function": f"{rewards_file}:brevity",
            "kwargs": {"limit": 25},
            "weight": 0.5,
        }
    )
    short, long = rubric(EXAMPLE, RIGHT), rubric(EXAMPLE, LONG)
    assert (short.score, short.components["brevity"], short.status) == (1.5, 1.0, RewardStatus.OK)
    assert (long.score, long.components["brevity"]) == (1.0, 0.0)
    assert short.verifier == "exact_match+custom:brevity"


def test_a_function_from_a_module_and_a_bool_score(rewards_file, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    rubric = _rubric({"type": "custom", "function": "my_rewards:answer_echo", "weight": 2.0}, correct_weight=0.0)
    result = rubric(EXAMPLE, "it is 19")
    assert (result.score, result.components["custom"]) == (2.0, 1.0)  # the component is named after its type


def test_a_class_is_built_once_with_the_kwargs(rewards_file):
    rubric = _rubric({"type": "custom", "function": f"{rewards_file}:Counter", "kwargs": {"step": 0.25}})
    assert [rubric(EXAMPLE, RIGHT).components["custom"] for _ in range(3)] == [0.25, 0.5, 0.75]


def test_an_abstention_of_a_weighted_custom_reward_abstains_the_verdict(rewards_file):
    weighted = _rubric({"type": "custom", "function": f"{rewards_file}:undecided"})
    assert (weighted(EXAMPLE, RIGHT).score, weighted(EXAMPLE, RIGHT).status) == (None, RewardStatus.TIMEOUT)
    logged_only = _rubric({"type": "custom", "function": f"{rewards_file}:undecided", "weight": 0.0})
    assert logged_only(EXAMPLE, RIGHT).score == 1.0


@pytest.mark.parametrize(("name", "shown"), [("forgot_to_return", "returned None (NoneType)"), ("not_a_number", "nan")])
def test_a_return_value_that_is_not_a_verdict_stops_the_run_instead_of_abstaining(rewards_file, name, shown):
    rubric = _rubric({"type": "custom", "function": f"{rewards_file}:{name}"})
    with pytest.raises(RewardContractError, match=r"return a finite number or a RewardResult") as info:
        rubric(EXAMPLE, RIGHT)
    assert shown in str(info.value)
    rollout = Rollout(
        example=EXAMPLE, prompt_ids=[1], completion_ids=[], completion_logprobs=[], versions=[], completion_text=RIGHT
    )
    with pytest.raises(RewardContractError):  # the training and evaluation scorer lets it through too
        score_rollout(rubric, EXAMPLE, rollout)


@pytest.mark.parametrize(
    ("function", "kwargs", "message"),
    [
        ("nope.py:brevity", {}, "reward component 'custom': function = 'nope.py:brevity': no file /"),
        ("my_rewards.py:missing", {}, "my_rewards.py has no attribute 'missing'"),
        ("my_rewards.py:brevity", {}, "cannot be called (example, completion): missing a required argument: 'limit'"),
        ("my_rewards.py:brevity", {"limt": 3}, "cannot be called (example, completion, limt=...)"),
        ("my_rewards.py:Counter", {"stepp": 1}, "function = 'my_rewards.py:Counter' cannot be called (stepp=...)"),
        ("math:pi", {}, "function = 'math:pi' is not callable (type float)"),
    ],
)
def test_a_bad_function_fails_when_the_rubric_is_built_with_one_line(rewards_file, function, kwargs, message):
    with pytest.raises(PluginLoadError) as info:
        _rubric({"type": "custom", "function": function, "kwargs": kwargs})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_custom_component_in_a_recipe():
    table = '{type = "custom", name = "short", function = "r.py:f", kwargs = {limit = 3}, weight = 0.2}'
    config = load_config(None, [f"reward.components=[{table}]"])
    assert config.reward.components == [
        CustomComponentConfig(name="short", function="r.py:f", kwargs={"limit": 3}, weight=0.2)
    ]


def test_the_documented_custom_reward_scores_and_abstains(tmp_path, monkeypatch):
    doc = (Path(__file__).resolve().parents[3] / "docs" / "rewards.md").read_text()
    [code] = [b for b in re.findall(r"```python\n(.*?)```", doc, re.DOTALL) if "def cites_source" in b]
    (tmp_path / "my_rewards.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    component = {"type": "custom", "function": "my_rewards.py:cites_source", "kwargs": {"marker": "Source:"}}
    rubric = _rubric({**component, "weight": 0.3})
    cited = Example(task_key="t/1", prompt=EXAMPLE.prompt, answer="19", metadata={"source": "jsonl", "url": "u"})
    assert rubric(cited, RIGHT + " Source: u").score == pytest.approx(1.3)
    assert rubric(EXAMPLE, RIGHT).score is None  # no url in the metadata: abstains
