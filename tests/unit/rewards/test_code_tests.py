"""Code-test rewards in a real bwrap sandbox: correct programs pass (plain values of every common type compared by
value, unflagged), wrong ones fail, a hang is a scored timeout, only a sandbox that did not start abstains, and
fences in their common spellings are found. The attacks are in test_code_redteam.py."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

from sharpen.config.sandbox import SandboxConfig
from sharpen.data.humaneval import humaneval_examples
from sharpen.environments.sandbox import Sandbox
from sharpen.rewards.base import RewardFn
from sharpen.rewards.code_tests import CodeTestReward, HumanEvalReward, extract_program, pytest_ro_binds
from sharpen.types import Example, Message, RewardResult, RewardStatus

CORRECT = "def add(a, b):\n    return a + b\n"
CASES = [
    {"args": [1, 2], "expected": 3},  # the visible example
    {"args": [5, 7], "expected": 12},  # hidden
    {"call": "add(-4, 4)", "expected": 0},  # hidden, as a call expression
]
TEST_FILE = """\
from solution import add

def test_add():
    assert add(1, 2) == 3
    assert add(5, 7) == 12
"""


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (make system-deps)")
    config = SandboxConfig(
        backend="bwrap", wall_seconds=4.0, cpu_seconds=4, memory_mb=256, extra_ro_binds=pytest_ro_binds()
    )
    with Sandbox(config) as box:
        yield box


def _example(**metadata: Any) -> Example:
    return Example(task_key="add/0", prompt=(Message(role="user", content="Write add(a, b)."),), metadata=metadata)


CASES_EXAMPLE = _example(entry_point="add", cases=CASES)
PYTEST_EXAMPLE = _example(test_files={"test_add.py": TEST_FILE})
IO_EXAMPLE = _example(io_cases=[{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 7", "stdout": "12"}])


def _fenced(code: str) -> str:
    return f"Here it is:\n```python\n{textwrap.dedent(code)}```\n"


def _score(sandbox: Sandbox, code: str, example: Example = CASES_EXAMPLE) -> RewardResult:
    return CodeTestReward(sandbox)(example, _fenced(code))


def test_extract_program_takes_the_last_python_block():
    completion = "```python\nx = 1\n```\ntext\n```python\nx = 2\n```"
    assert extract_program(completion) == "x = 2\n"
    assert extract_program("no code here") is None
    assert all(":/opt/sharpen-pytest/" in bind for bind in pytest_ro_binds())


@pytest.mark.parametrize(
    "completion",
    [
        "```python\nx = 2\n```",
        "```Python\nx = 2\n```",
        "```py\nx = 2\n```",
        "```python3\nx = 2\n```",
        "``` python\nx = 2\n```",
        "```{python}\nx = 2\n```",
        "```{.python}\nx = 2\n```",
        '```python title="solution.py"\nx = 2\n```',
        "```python:solution.py\nx = 2\n```",
        "~~~python\nx = 2\n~~~",
        "````python\nx = 2\n````",
        "```\nx = 2\n```",
        "```python\r\nx = 2\r\n```\r\n",
        "1. Here:\n\n   ```python\n   x = 2\n   ```\n",
        "```python\nx = 2\n",  # cut off before the closing fence
        "```text\nnot code\n```\n```python\nx = 2\n```\n```\nplain\n```",  # a python block beats later plain ones
    ],
)
def test_code_fences_in_any_common_spelling_are_found(completion: str):
    assert extract_program(completion) == "x = 2\n"


def test_a_shorter_fence_inside_a_block_does_not_end_it():
    completion = '````python\ns = """\n```\n"""\n````'
    assert extract_program(completion) == 's = """\n```\n"""\n'


@pytest.mark.parametrize("example", [CASES_EXAMPLE, PYTEST_EXAMPLE], ids=["cases", "pytest"])
def test_correct_solution_passes(sandbox: Sandbox, example: Example):
    result = _score(sandbox, CORRECT, example)
    assert (result.score, result.status, result.hack_flags) == (1.0, RewardStatus.OK, []), result.detail
    assert result.components == {"format": 1.0, "correct": 1.0, "fraction_passed": 1.0}
    assert isinstance(CodeTestReward(sandbox), RewardFn) and result.verifier_version and result.cache_key


@pytest.mark.parametrize("example", [CASES_EXAMPLE, PYTEST_EXAMPLE], ids=["cases", "pytest"])
def test_wrong_solution_fails(sandbox: Sandbox, example: Example):
    result = _score(sandbox, "def add(a, b):\n    return a - b if a < 0 else a + b + (a == 5)\n", example)
    assert (result.score, result.status, result.hack_flags) == (0.0, RewardStatus.WRONG, [])
    assert not result.is_policy_error


def test_fraction_passed_is_a_component(sandbox: Sandbox):
    result = _score(sandbox, "def add(a, b):\n    return a + b if a > 0 else 1\n")
    assert result.components["fraction_passed"] == pytest.approx(2 / 3) and result.score == 0.0


def test_hard_coded_visible_output_fails_the_hidden_cases(sandbox: Sandbox):
    result = _score(sandbox, "def add(a, b):\n    return 3\n")
    assert (result.score, result.status) == (0.0, RewardStatus.WRONG)
    assert result.components["fraction_passed"] == pytest.approx(1 / 3)


def test_no_code_block_is_a_format_error(sandbox: Sandbox):
    result = CodeTestReward(sandbox)(CASES_EXAMPLE, "def add(a, b): return a + b")
    assert (result.score, result.status, result.components["format"]) == (0.0, RewardStatus.FORMAT_ERROR, 0.0)


@pytest.mark.parametrize("example", [CASES_EXAMPLE, PYTEST_EXAMPLE], ids=["cases", "pytest"])
def test_a_hang_is_a_scored_timeout_caused_by_the_policy(sandbox: Sandbox, example: Example):
    result = _score(sandbox, "def add(a, b):\n    while True:\n        pass\n", example)
    assert (result.score, result.status, result.is_policy_error) == (0.0, RewardStatus.TIMEOUT, True)


class _NeverStarted:
    """A session whose sandbox failed before the program started (what the policy cannot cause)."""

    status, detail, is_program_started = "sandbox_error", "bwrap: setting up uid map: Permission denied", False
    stdout, is_output_truncated = "", False

    def send(self, message: bytes, *, timeout: float) -> bool:
        return False

    def receive(self, *, timeout: float) -> bytes | None:
        return None

    def close(self, *, grace_seconds: float | None = None) -> Any:
        return self


class _BrokenRunner:
    def run_python(self, code: str, *, files: Any = None, stdin: str | bytes = "") -> Any:
        return _NeverStarted()

    def open_python_session(self, code: str, *, files: Any = None) -> Any:
        return _NeverStarted()


@pytest.mark.parametrize("example", [CASES_EXAMPLE, PYTEST_EXAMPLE, IO_EXAMPLE], ids=["cases", "pytest", "io"])
def test_a_sandbox_that_did_not_start_abstains_instead_of_scoring_zero(example: Example):
    result = CodeTestReward(_BrokenRunner())(example, _fenced(CORRECT))
    assert (result.score, result.status, result.is_policy_error) == (None, RewardStatus.INFRA_ERROR, False)


def test_pytest_missing_from_the_sandbox_abstains(sandbox: Sandbox):
    result = CodeTestReward(sandbox, pytest_path="/nonexistent")(PYTEST_EXAMPLE, _fenced(CORRECT))
    assert (result.score, result.status) == (None, RewardStatus.INFRA_ERROR)


VALUE_PROGRAM = """\
import collections, fractions, decimal
def make(kind):
    return {
        "dict": {"b": 2, "a": [1, (2, 3)]},
        "int_keys": {1: "x", (2, 3): None},
        "set": {3, 1, 2},
        "frozenset": frozenset({"a"}),
        "counter": collections.Counter("abracadabra"),
        "ordered": collections.OrderedDict(a=1),
        "default": collections.defaultdict(int, a=1),
        "fraction": fractions.Fraction(3, 4),
        "decimal": decimal.Decimal("1.10"),
        "complex": complex(1, -2),
        "tuple": (1, "a", None),
        "named": collections.namedtuple("P", "x y")(1, 2),
        "big": 3 ** 200,
        "nan": float("nan"),
        "bytes": bytes([0, 255]),
        "nested": [[[]], {"k": {1, 2}}],
        "bool": True,
    }[kind]
"""
VALUE_TEST = """\
import collections, fractions, decimal, math
from solution import make

def test_values():
    assert make("dict") == {"a": [1, (2, 3)], "b": 2}
    assert make("int_keys") == {(2, 3): None, 1: "x"}
    assert make("set") == {1, 2, 3}
    assert make("frozenset") == frozenset({"a"})
    assert make("counter") == collections.Counter(a=5, b=2, r=2, c=1, d=1)
    assert make("counter").most_common(1) == [("a", 5)]
    assert make("ordered") == collections.OrderedDict(a=1)
    assert make("default") == {"a": 1}
    assert make("fraction") == fractions.Fraction(3, 4)
    assert make("decimal") == decimal.Decimal("1.1")
    assert make("complex") == 1 - 2j
    assert make("tuple") == (1, "a", None) and isinstance(make("tuple"), tuple)
    assert make("named") == (1, 2)
    assert make("big") == 3 ** 200
    assert math.isnan(make("nan"))
    assert make("bytes") == bytes([0, 255])
    assert make("nested") == [[[]], {"k": {1, 2}}]
    assert make("bool") is True
"""


def test_plain_values_of_every_common_type_compare_by_value_unflagged(sandbox: Sandbox):
    result = _score(sandbox, VALUE_PROGRAM, _example(test_files={"test_values.py": VALUE_TEST}))
    assert (result.score, result.status, result.hack_flags) == (1.0, RewardStatus.OK, []), result.detail


def test_function_cases_compare_a_tuple_with_a_json_list(sandbox: Sandbox):
    example = _example(entry_point="pair", cases=[{"args": [1], "expected": [1, [2, "x"]]}])
    result = _score(sandbox, "def pair(a):\n    return (a, (a + 1, 'x'))\n", example)
    assert (result.score, result.status) == (1.0, RewardStatus.OK), result.detail


def test_exceptions_cross_as_builtin_exceptions(sandbox: Sandbox):
    test = (
        "import pytest\nfrom solution import root\n\ndef test_root():\n"
        "    with pytest.raises(ValueError):\n        root(-1)\n    assert root(4) == 2\n"
    )
    program = "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return int(x ** 0.5)\n"
    result = _score(sandbox, program, _example(test_files={"test_root.py": test}))
    assert (result.score, result.status) == (1.0, RewardStatus.OK), result.detail


def test_stdin_stdout_cases_compare_the_output_on_the_host(sandbox: Sandbox):
    right = _score(sandbox, "a, b = map(int, input().split())\nprint(a + b)  \n", IO_EXAMPLE)
    assert (right.score, right.status) == (1.0, RewardStatus.OK), right.detail
    wrong = _score(sandbox, "a, b = map(int, input().split())\nprint(a + b + (a == 5))\n", IO_EXAMPLE)
    assert (wrong.score, wrong.status, wrong.components["fraction_passed"]) == (0.0, RewardStatus.WRONG, 0.5)


@pytest.mark.parametrize("call", ["add(1) + 1", "__import__('os').system('true')", "add(*[1, 2])", "add(x)"])
def test_a_case_call_that_is_not_a_plain_call_is_the_datasets_error(sandbox: Sandbox, call: str):
    with pytest.raises(ValueError, match=r"name\(literal"):
        _score(sandbox, CORRECT, _example(entry_point="add", cases=[{"call": call, "expected": 3}]))


def test_humaneval_continuations_and_whole_functions_pass_and_a_wrong_one_fails(sandbox: Sandbox):
    reward = HumanEvalReward(sandbox)
    examples = humaneval_examples(limit=3)
    for example in examples:  # the model continuing the prompt's function
        result = reward(example, example.metadata["canonical_solution"])
        assert (result.score, result.status, result.hack_flags) == (1.0, RewardStatus.OK, []), example.task_key
    first = examples[0]
    whole = _fenced(first.metadata["prompt_code"] + first.metadata["canonical_solution"])
    assert reward(first, whole).status == RewardStatus.OK  # the model writing the whole function in a block
    wrong = reward(first, "    return False\n")
    assert (wrong.score, wrong.status) == (0.0, RewardStatus.WRONG)
