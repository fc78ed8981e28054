"""The code grader on the whole HumanEval set in a real bwrap sandbox: every canonical solution scores 1.0 (a
correct answer never loses reward, helpers defined in the prompt included), and every one of them with its result
perturbed scores 0.0 (the tests really decide)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from sharpen.config.sandbox import SandboxConfig
from sharpen.data.humaneval import humaneval_examples
from sharpen.environments.sandbox import Sandbox
from sharpen.rewards.code_tests import HumanEvalReward
from sharpen.types import Example, RewardStatus

pytestmark = pytest.mark.slow

PERTURB = """

def _sharpen_perturbed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "#"
    if isinstance(value, list):
        return [*value, None]
    if isinstance(value, tuple):
        return (*value, None)
    if value is None:
        return 0
    return None

_sharpen_original = {entry_point}

def {entry_point}(*args, **kwargs):
    return _sharpen_perturbed(_sharpen_original(*args, **kwargs))
"""


@pytest.fixture(scope="module")
def reward() -> Iterator[HumanEvalReward]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (make system-deps)")
    with Sandbox(SandboxConfig(backend="bwrap", wall_seconds=20.0, cpu_seconds=20, memory_mb=512)) as box:
        yield HumanEvalReward(box)


def _canonical(example: Example) -> str:
    return example.metadata["prompt_code"] + example.metadata["canonical_solution"]


def test_every_canonical_solution_scores_one(reward: HumanEvalReward):
    examples = humaneval_examples()
    assert len(examples) == 164
    failed = []
    for example in examples:
        result = reward(example, f"```python\n{_canonical(example)}```")
        if (result.score, result.status, result.hack_flags) != (1.0, RewardStatus.OK, []):
            failed.append((example.task_key, result.status, result.detail))
    assert failed == []


def test_every_perturbed_solution_scores_zero(reward: HumanEvalReward):
    passed = []
    for example in humaneval_examples():
        program = _canonical(example) + PERTURB.format(entry_point=example.metadata["entry_point"])
        result = reward(example, f"```python\n{program}```")
        if result.score != 0.0 or result.status not in (RewardStatus.WRONG, RewardStatus.TIMEOUT):
            passed.append((example.task_key, result.score, result.status, result.detail))
    assert passed == []
