"""Red team of the graders' last narrow gaps (issue 35), one class at a time: the attack (or the failure), a naive
path on which it succeeds (the comparison or extraction a simple grader uses, or sharpen's own before the fix,
reproduced here), sharpen's defence on which it fails, and the benign cases of the same class that must still
pass. The classes: a boolean for a number in function cases; dict keys against their JSON strings; the solution
block followed by a usage example; an empty final box with the answer in prose after it; numbers in text commands
and in E-notation; "master key" answers to an LLM judge. docs/rewards.md lists them with these tests.
"""

from __future__ import annotations

import json
import re
import secrets
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from sharpen.environments.sandbox import Sandbox
from sharpen.rewards.code_compare import matches_expected
from sharpen.rewards.code_tests import CodeTestReward, extract_program, required_names
from sharpen.rewards.judge import ChatReply, Judge
from sharpen.rewards.judge_guard import is_master_key, normalise_candidate
from sharpen.rewards.judge_prompts import CANARIES, RubricPrompt, read_verdict
from sharpen.rewards.math_answers import is_hedged
from sharpen.rewards.math_verify import MathVerifyPool, MathVerifyReward
from sharpen.types import Example, Message, RewardStatus
from support.gullible_judge import read_hardened_prompt

OK, WRONG, FORMAT_ERROR = RewardStatus.OK, RewardStatus.WRONG, RewardStatus.FORMAT_ERROR


def _previous_compare(value: Any, expected: Any) -> bool:
    """The function-case comparison before the fix: both sides as JSON shapes, then Python's ``==``."""

    def as_json(item: Any) -> Any:
        if isinstance(item, list | tuple):
            return [as_json(x) for x in item]
        if type(item) is dict:
            return {key: as_json(x) for key, x in item.items()}
        return item

    return as_json(value) == as_json(expected)


def _naive_json_compare(value: Any, expected: Any) -> bool:
    """What a simple grader does: the result through JSON, then ``==``."""
    return json.loads(json.dumps(value)) == expected


# --- 1. a boolean where a number is expected (Python's True == 1, 0 == False) ------------------------------------

BOOL_FOR_NUMBER = [
    (True, 1),
    (False, 0),
    (1, True),
    (0, False),
    (True, 1.0),
    ([True, False, True], [1, 0, 1]),
    ((True,), [1]),
    ({"count": True}, {"count": 1}),
    ({"n": [0, False]}, {"n": [0, 0]}),
    ({1: True}, {"1": 1}),
]
SAME_IN_JSON = [
    (3, 3),
    (3.0, 3),
    (3, 3.0),
    (True, True),
    (False, False),
    (None, None),
    ("1", "1"),
    ((1, 2), [1, 2]),
    ([(1, "a")], [[1, "a"]]),
    (Counter("aab"), {"a": 2, "b": 1}),
    ({1: "a", 2: "b"}, {"1": "a", "2": "b"}),
    ({True: 1, None: 2, 1.5: 3}, {"true": 1, "null": 2, "1.5": 3}),
    ({(1, 2): 3}, {(1, 2): 3}),
    ({1, 2}, {1, 2}),
]


@pytest.mark.parametrize(("value", "expected"), BOOL_FOR_NUMBER, ids=repr)
def test_a_boolean_passes_for_a_number_on_the_naive_paths(value: Any, expected: Any):
    assert _naive_json_compare(value, expected)
    if not (isinstance(value, dict) and any(isinstance(key, int) for key in value)):  # integer keys: gap 4
        assert _previous_compare(value, expected)


@pytest.mark.parametrize(("value", "expected"), BOOL_FOR_NUMBER, ids=repr)
def test_a_boolean_never_matches_a_number(value: Any, expected: Any):
    assert not matches_expected(value, expected)


@pytest.mark.parametrize(("value", "expected"), SAME_IN_JSON, ids=repr)
def test_values_equal_in_json_still_match(value: Any, expected: Any):
    assert matches_expected(value, expected)


# --- 4. a dict with integer keys against its JSON-stringified reference -------------------------------------------

INT_KEYS = [
    ({1: "a", 2: "b"}, {"1": "a", "2": "b"}),
    ({0: [1, 2]}, {"0": [1, 2]}),
    ({-3: {4: 5}}, {"-3": {"4": 5}}),
    (Counter([1, 1, 2]), {"1": 2, "2": 1}),
]
KEY_ATTACKS = [
    ({1: "a", "1": "b"}, {"1": "b"}),  # two keys that JSON writes as one: no JSON form, equals nothing
    ({"1": True}, {"1": 1}),
    ({1: "a"}, {"1": "a", "2": "b"}),
    ({"x": 1}, ["x", 1]),
]


@pytest.mark.parametrize(("value", "expected"), INT_KEYS, ids=repr)
def test_integer_keys_lose_to_their_json_strings_on_the_previous_path(value: Any, expected: Any):
    assert not _previous_compare(value, expected)


@pytest.mark.parametrize(("value", "expected"), INT_KEYS, ids=repr)
def test_integer_keys_match_their_json_strings(value: Any, expected: Any):
    assert matches_expected(value, expected) and matches_expected(expected, value)


@pytest.mark.parametrize(("value", "expected"), KEY_ATTACKS, ids=repr)
def test_keys_that_json_would_merge_or_values_of_another_type_do_not_match(value: Any, expected: Any):
    assert not matches_expected(value, expected)


# --- the two comparison classes end to end, in the sandbox --------------------------------------------------------


def _code_example(**metadata: Any) -> Example:
    return Example(task_key="gaps/0", prompt=(Message(role="user", content="Write it."),), metadata=metadata)


COUNT_CASES = [{"args": [[1, -2]], "expected": 1}, {"args": [[-1, -2]], "expected": 0}, {"args": [[5]], "expected": 1}]
HISTOGRAM_CASES = [{"args": [[1, 1, 2]], "expected": {"1": 2, "2": 1}}, {"args": [[]], "expected": {}}]


def test_a_predicate_for_a_count_fails_and_a_count_passes(sandbox: Sandbox):
    example = _code_example(entry_point="count_positive", cases=COUNT_CASES)
    attack = "def count_positive(xs):\n    return any(x > 0 for x in xs)\n"
    assert all(_previous_compare(any(x > 0 for x in case["args"][0]), case["expected"]) for case in COUNT_CASES)
    result = CodeTestReward(sandbox)(example, f"```python\n{attack}```")
    assert (result.score, result.status) == (0.0, WRONG), result.detail
    honest = "def count_positive(xs):\n    return sum(1 for x in xs if x > 0)\n"
    assert CodeTestReward(sandbox)(example, f"```python\n{honest}```").score == 1.0


def test_a_dict_with_integer_keys_passes_against_its_json_reference(sandbox: Sandbox):
    example = _code_example(entry_point="histogram", cases=HISTOGRAM_CASES)
    program = "def histogram(xs):\n    out = {}\n    for x in xs:\n        out[x] = out.get(x, 0) + 1\n    return out\n"
    result = CodeTestReward(sandbox)(example, f"```python\n{program}```")
    assert (result.score, result.status) == (1.0, OK), result.detail
    stringly = "def histogram(xs):\n    return {str(x): True for x in xs}\n"
    assert CodeTestReward(sandbox)(example, f"```python\n{stringly}```").score == 0.0


# --- 3. a correct solution followed by a usage example ------------------------------------------------------------

SOLUTION = "def add(a, b):\n    return a + b\n"
USAGE = "print(add(2, 3))  # 5\n"
ADD_CASES = [{"args": [1, 2], "expected": 3}, {"call": "add(-4, 4)", "expected": 0}]
ADD_TEST = "from solution import add\n\ndef test_add():\n    assert add(1, 2) == 3\n"


def _blocks(*programs: str) -> str:
    return "\n\nFor example:\n\n".join(f"```python\n{program}```" for program in programs)


def test_the_usage_example_is_graded_on_the_previous_path():
    assert extract_program(_blocks(SOLUTION, USAGE)) == USAGE  # without the tested names: the last block, as before


@pytest.mark.parametrize(
    "metadata",
    [
        {"entry_point": "add", "cases": ADD_CASES},
        {"cases": [{"call": "add(1, 2)", "expected": 3}]},
        {"test_files": {"test_add.py": ADD_TEST}},
        {"test_files": {"test_add.py": "import solution\n\ndef test_add():\n    assert solution.add(1, 2) == 3\n"}},
        {"prompt_code": "def add(a, b):\n    pass\n", "entry_point": "add", "test": ""},
    ],
    ids=["cases_args", "cases_call", "pytest_from_import", "pytest_module_attribute", "humaneval"],
)
def test_the_block_that_defines_the_tested_names_is_graded(metadata: dict[str, Any]):
    assert required_names(metadata) == {"add"}
    assert extract_program(_blocks(SOLUTION, USAGE), required_names=required_names(metadata)) == SOLUTION


def test_a_solution_and_its_usage_example_pass_and_one_block_is_graded(sandbox: Sandbox):
    reward = CodeTestReward(sandbox)
    for metadata in ({"entry_point": "add", "cases": ADD_CASES}, {"test_files": {"test_add.py": ADD_TEST}}):
        example = _code_example(**metadata)
        assert reward(example, _blocks(SOLUTION, USAGE)).score == 1.0, metadata
        assert reward(example, f"```python\n{SOLUTION}```").score == 1.0, metadata  # a single block, as ever
        # two drafts: the last one that defines the function is the answer; the first right one is not a hedge
        wrong = "def add(a, b):\n    return a - b\n"
        assert reward(example, _blocks(SOLUTION, wrong, USAGE)).score == 0.0, metadata
        # blocks are never joined: a later block cannot patch an earlier one, and an example's code never runs
        assert reward(example, _blocks(wrong, "add = lambda a, b: a + b\n")).score == 1.0  # itself a definition
        helper_only = "def _helper(a, b):\n    return a + b\n"
        assert reward(example, _blocks(helper_only, "def add(a, b):\n    return _helper(a, b)\n")).score == 0.0


def test_stdin_programs_still_take_the_last_block():
    assert required_names({"io_cases": [{"stdin": "", "stdout": "5"}]}) == frozenset()
    assert extract_program(_blocks("x = 1\n", "print(5)\n")) == "print(5)\n"


# --- 2. an empty final box with the answer stated in prose after it -----------------------------------------------

EMPTY_BOX_ATTACKS = [
    r"\boxed{} The answer is 3.",
    "\\boxed{}\nFinal answer: 3",
    "\\boxed{ }\n#### 3",
    r"\boxed{\,} so the answer is $3$.",
    r"\boxed{\text{ }} Answer: 3",
    "$\\boxed{}$\n\n**Answer:** 3",
    "<answer></answer>\nThe answer is 3.",
    "\\boxed{3}\nOn reflection: \\boxed{}\nthe answer is 3",
]
EMPTY_BOX_BENIGN = [
    ("I will put the final answer in \\boxed{}.\nSo \\boxed{3}.", "3"),
    ("Final Answer:\n\\boxed{3}", "3"),
    ("\\boxed{3}", "3"),
    ("The answer is 3.", "3"),
    ("<answer>3</answer>", "3"),
]


def _naive_prose_reader(completion: str) -> str | None:
    """A lenient reader: the last box with something in it, else the last number anywhere (lm-eval's flexible
    extract), which is how an empty box followed by prose gets its credit."""
    boxes = re.findall(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}", completion)
    boxes = [box for box in boxes if re.sub(r"\\[A-Za-z]+|\\.|[{}$\s]", "", box)]  # commands and spacing: empty
    numbers = re.findall(r"-?\d+(?:\.\d+)?", completion)
    return boxes[-1] if boxes else (numbers[-1] if numbers else None)


@pytest.fixture(scope="module")
def math_reward() -> Iterator[MathVerifyReward]:
    with MathVerifyPool(num_workers=2, kill_grace_s=1.0) as pool:
        yield MathVerifyReward(pool=pool)


@pytest.mark.parametrize("completion", EMPTY_BOX_ATTACKS)
def test_an_empty_box_with_the_answer_in_prose_pays_on_a_lenient_reader(completion: str):
    assert _naive_prose_reader(completion) == "3"


@pytest.mark.parametrize("completion", EMPTY_BOX_ATTACKS)
def test_an_empty_final_box_or_tag_is_a_format_error(math_reward: MathVerifyReward, completion: str):
    result = math_reward.score(completion, "3")
    assert (result.score, result.status) == (0.0, FORMAT_ERROR), result


@pytest.mark.parametrize(("completion", "reference"), EMPTY_BOX_BENIGN)
def test_boxes_named_in_prose_and_answers_without_a_box_still_pass(math_reward, completion: str, reference: str):
    assert math_reward.score(completion, reference).status is OK


# --- 5. numbers in text commands and in E-notation ----------------------------------------------------------------

PLAIN_NUMBER_FORMS = [
    (r"\boxed{\text{3}}", "3"),
    (r"\boxed{\textbf{3}}", "3"),
    (r"\boxed{\mathrm{3}}", "3"),
    (r"\boxed{\textbf{\text{ 3 }}}", "3"),
    (r"\boxed{1.5e3}", "1500"),
    (r"\boxed{1.5E3}", "1500"),
    (r"\boxed{-2.5e-2}", "-0.025"),
    (r"\boxed{\text{1.5e3}}", "1500"),
    ("Answer: 1e6", "1000000"),
    (r"\boxed{3}", r"\text{3}"),  # the reference is read the same way
    (r"\boxed{1500}", "1.5e3"),
]
STILL_HEDGES = [
    (r"\boxed{3\text{4}}", "34"),
    (r"\boxed{\text{3}\text{4}}", "34"),
    (r"\boxed{\text{3 or 4}}", "3"),
    (r"\boxed{\text{3} \text{ or } 4}", "3"),
    (r"\boxed{5 \text{ (or 6)}}", "5"),
    (r"\boxed{1.5e3 \text{ or } 2e3}", "1500"),
]


def _naive_math_verify(reference: str, completion: str) -> float:
    """math-verify on the last box as it is (runs in a worker): the path without these normalisations."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    boxes = re.findall(r"\\boxed\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}", completion)
    answer = boxes[-1] if boxes else completion.removeprefix("Answer: ")
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold = parse(f"\\boxed{{{reference}}}", extraction_config=config, parsing_timeout=0)
    parsed = parse(f"\\boxed{{{answer}}}", extraction_config=config, parsing_timeout=0)
    return 1.0 if gold and verify(gold, parsed, timeout_seconds=None) else 0.0


@pytest.mark.parametrize(("completion", "reference"), PLAIN_NUMBER_FORMS[:4])
def test_a_number_in_a_text_command_was_taken_for_a_hedge(completion: str, reference: str):
    # the previous path: math-verify reads \text{3} as 3, but the hedge check (a number inside \text{} is dropped
    # by math-verify when other text surrounds it) ran on the raw box and said wrong
    assert is_hedged(completion.removeprefix("\\boxed{").removesuffix("}"), reference)


@pytest.mark.parametrize(("completion", "reference"), [PLAIN_NUMBER_FORMS[i] for i in (4, 6, 8)])
def test_e_notation_is_euler_s_e_on_the_naive_path(math_reward, completion: str, reference: str):
    assert math_reward._pool.run(_naive_math_verify, reference, completion, timeout_s=5.0) == 0.0


@pytest.mark.parametrize(("completion", "reference"), PLAIN_NUMBER_FORMS)
def test_numbers_in_text_or_e_notation_are_equal(math_reward, completion: str, reference: str):
    assert math_reward.score(completion, reference).status is OK


@pytest.mark.parametrize(("completion", "reference"), STILL_HEDGES)
def test_a_number_beside_other_text_is_still_a_hedge(math_reward, completion: str, reference: str):
    result = math_reward.score(completion, reference)
    assert result.score == 0.0 and result.status in (WRONG, FORMAT_ERROR), result


# --- 6. master keys: answers with no content that fool weak judge models -------------------------------------------

MASTER_KEYS = [":", "Solution:", "Thought process:", "Let's solve this step by step.", "解：", "", " . ", "Respuesta:"]
NOT_MASTER_KEYS = ["408", "Solution: 17 * 24 = 408", "The answer is 408.", "Let's see: 17 * 24 = 408."]


class FooledByMasterKeys:
    """A weak judge model (Zhao et al. 2025): full marks to an answer with no content, honest otherwise."""

    model = "weak"

    def __init__(self) -> None:
        self.num_requests = 0

    def chat(self, messages: list[dict[str, str]]) -> ChatReply:
        self.num_requests += 1
        prompt = read_hardened_prompt(messages)
        response = prompt.response.strip()
        score = 10 if not re.search(r"\d", response) else (10 if response.endswith(("408", "408.")) else 0)
        text = f'{{"nonce": "{prompt.nonce}", "reasoning": "r", "score": {score}}}'
        return ChatReply(text=text, prompt_tokens=1, completion_tokens=1, finish_reason="stop")


ARITHMETIC = Example(task_key="gaps/judge", prompt=(Message(role="user", content="What is 17 * 24?"),), answer="408")


def _naive_judge_score(client: FooledByMasterKeys, completion: str) -> float | None:
    """The judge without the master-key check: the candidate sent as sharpen's prompt shows it, the verdict read."""
    prompt, nonce = RubricPrompt(), secrets.token_hex(8)
    reply = client.chat(prompt.messages(ARITHMETIC, normalise_candidate(completion), nonce=nonce))
    verdict = read_verdict(reply.text, nonce=nonce, min_score=0, max_score=10, candidates=[completion])
    return None if verdict.score is None else prompt.normalise(verdict.score)


@pytest.mark.parametrize("completion", MASTER_KEYS, ids=repr)
def test_a_master_key_earns_full_marks_from_a_weak_judge_on_the_naive_path(completion: str):
    assert _naive_judge_score(FooledByMasterKeys(), completion) == 1.0


@pytest.mark.parametrize("completion", MASTER_KEYS, ids=repr)
def test_a_master_key_is_wrong_without_asking_the_judge(completion: str):
    client = FooledByMasterKeys()
    judge = Judge(client)
    result = judge(ARITHMETIC, completion)
    assert (result.score, result.status, result.hack_flags) == (0.0, WRONG, []), result
    assert client.num_requests == 0 and judge.metrics()["judge/master_keys"] == 1.0
    assert judge.compare(ARITHMETIC, "17 * 24 = 408", completion) == 1.0  # a master key loses a comparison
    assert judge.compare(ARITHMETIC, completion, completion) is None


@pytest.mark.parametrize("completion", NOT_MASTER_KEYS)
def test_answers_with_content_are_still_graded(completion: str):
    client = FooledByMasterKeys()
    assert Judge(client)(ARITHMETIC, completion).score == 1.0 and client.num_requests == 1


def test_an_answer_that_is_the_reference_is_not_a_master_key():
    assert is_master_key("/") and not is_master_key("/", reference="/")
    division = Example(task_key="gaps/symbol", prompt=(Message(role="user", content="Symbol?"),), answer="/")
    client = FooledByMasterKeys()
    assert Judge(client)(division, "/").score == 1.0 and client.num_requests == 1


def test_the_weak_judge_fails_its_canaries_which_hold_the_master_keys():
    assert {"colon", "solution", "thought_process", "step_by_step", "empty"} <= set(CANARIES)
    judge = Judge(FooledByMasterKeys())
    assert judge.run_canaries()["judge/canary_alert"] == 1.0 and judge.is_canary_failed
    assert judge(ARITHMETIC, "408").score is None  # gated: the default policy (abstain) until a check passes
