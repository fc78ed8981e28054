"""Math with a calculator tool: `ToolEnvironment` with one tool that evaluates arithmetic safely.

The evaluator walks Python's AST and accepts only numbers, + - * / // % ** and parentheses, with bounds on
exponents and magnitudes, so a policy cannot run code or exhaust memory through it (``9**9**9`` is refused, not
computed). Scoring is the run's rubric on the final answer.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from sharpen.environments.tool_use import ToolEnvironment

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_MAGNITUDE = 1e100
MAX_EXPONENT = 1000
MAX_EXPRESSION_CHARS = 500


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError (with a message for the policy) on anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {error.msg}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("result too large") from None
    raise ValueError(f"unsupported element {type(node).__name__}: only numbers, + - * / // % ** and parentheses")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if abs(value) > MAX_MAGNITUDE or not math.isfinite(value):  # the size test first: huge ints overflow isfinite
        raise ValueError("result too large")
    return value


async def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: the expression, e.g. "(12 + 7) * 3"
    """
    # a coroutine: the bounds above keep an evaluation to microseconds, so it runs on the event loop instead of in
    # a thread (the hop cost ~0.1 ms a call, and a thread that cannot start would become the policy's observation)
    value = evaluate_arithmetic(expression)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


class CalculatorEnvironment(ToolEnvironment):
    name = "calculator"
    version = "1"

    def __init__(self, *, parser: str = "hermes", max_tool_calls: int = 4, max_output_chars: int = 2000) -> None:
        super().__init__([calculate], parser=parser, max_tool_calls=max_tool_calls, max_output_chars=max_output_chars)
