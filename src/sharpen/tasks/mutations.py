"""Mutation operators over Python source: where a small, plausible bug can be planted in a function, and the
mutated text.

Owns the operator catalogue and the enumeration of mutation sites, in a fixed order (file, then position, then
operator). A `Mutation` is a text edit of the original source (a byte span and its replacement), so everything
outside the edited expression or statement keeps its formatting and comments: the mutated file differs from the
original only where the bug is. Only code inside function bodies is mutated (not decorators, defaults, class or
module level). Which sites become tasks is decided elsewhere (build.py: a seeded sample, kept when some tests fail).

Operators (each swaps operators of the same precedence, so the edit never regroups its surroundings):

- ``arithmetic``: ``+`` <-> ``-``, ``*`` <-> ``//``, ``/`` -> ``*``, ``%`` -> ``//``, ``<<`` <-> ``>>`` (also in
  augmented assignments, ``x += 1`` -> ``x -= 1``)
- ``comparison``: ``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``, ``is`` <-> ``is not``, ``in`` <-> ``not in``
- ``boolean``: ``and`` <-> ``or``
- ``negate_condition``: the test of an ``if``, ``elif``, ``while`` or conditional expression becomes ``not (...)``
  (a test ``not x`` becomes ``x``)
- ``off_by_one``: an integer literal ``k`` in a comparison, an index or slice bound, a ``range()`` argument or an
  arithmetic operand becomes ``k + 1`` (written as the number; ``-1`` becomes ``-2``)
- ``remove_statement``: an assignment, an expression statement (a call) or a ``raise`` on lines of its own is
  deleted (or becomes ``pass`` when it is its block's only statement)
- ``swap_arguments``: the first two positional arguments of a call change places (when their texts differ)
"""

from __future__ import annotations

import ast
import bisect
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass

OPERATORS = (
    "arithmetic",
    "comparison",
    "boolean",
    "negate_condition",
    "off_by_one",
    "remove_statement",
    "swap_arguments",
)

_ARITHMETIC: dict[type[ast.operator], tuple[str, str]] = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "//"),
    ast.FloorDiv: ("//", "*"),
    ast.Div: ("/", "*"),
    ast.Mod: ("%", "//"),
    ast.LShift: ("<<", ">>"),
    ast.RShift: (">>", "<<"),
}
_COMPARISON: dict[type[ast.cmpop], tuple[str, str]] = {
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
}
_REMOVABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Raise)


@dataclass(kw_only=True, slots=True, frozen=True)
class Mutation:
    """One planted bug: replace bytes ``start:end`` of the file's UTF-8 source with ``replacement``."""

    operator: str
    path: str
    """The file, relative to the package's root (POSIX separators)."""
    function: str
    """The qualified name of the function it is in (``Class.method``, ``outer.<locals>.inner``)."""
    line: int
    start: int
    end: int
    replacement: str
    description: str
    """What changed, e.g. ``'<' -> '<='`` (for the task's record; never shown to a solver)."""

    def apply(self, source: str) -> str:
        data = source.encode()
        return (data[: self.start] + self.replacement.encode() + data[self.end :]).decode()


class _Source:
    """A file's text with byte offsets of its lines (ast's col_offset counts UTF-8 bytes)."""

    def __init__(self, text: str) -> None:
        self.data = text.encode()
        self.line_starts = [0]
        for index, byte in enumerate(self.data):
            if byte == 0x0A:
                self.line_starts.append(index + 1)

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.line_starts[node.lineno - 1] + node.col_offset  # pyright: ignore[reportAttributeAccessIssue]
        end_line, end_col = node.end_lineno, node.end_col_offset  # pyright: ignore[reportAttributeAccessIssue]
        assert end_line is not None and end_col is not None
        return start, self.line_starts[end_line - 1] + end_col

    def text(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.data[start:end].decode()

    def line_of(self, offset: int) -> int:
        return bisect.bisect_right(self.line_starts, offset)

    def operator_edit(self, left: ast.AST, right: ast.AST, old: str, new: str) -> tuple[tuple[int, int], str] | None:
        """The edit that turns operator ``old`` between two operands into ``new``: only the operator's own
        characters change (the operands, their parentheses and the spacing stay). None when the text between the
        operands is not just that operator (a comment in the way, say)."""
        gap_start, gap_end = self.span(left)[1], self.span(right)[0]
        gap = self.data[gap_start:gap_end].decode()
        words = r"\s+".join(re.escape(word) for word in old.split())
        match = re.fullmatch(rf"([\s()\\]*)({words})([\s()\\]*)", gap)
        if match is None:
            return None
        return (gap_start + len(match[1].encode()), gap_start + len(match[1].encode()) + len(match[2].encode())), new

    def line_bounds(self, node: ast.stmt) -> tuple[int, int] | None:
        """The bytes of the whole lines ``node`` occupies, when it has them to itself (nothing before it on its
        first line, nothing but a comment after it on its last)."""
        start, end = self.span(node)
        line_start = self.line_starts[node.lineno - 1]
        if self.data[line_start:start].strip():
            return None
        line_end = self.data.find(b"\n", end)
        line_end = len(self.data) if line_end < 0 else line_end + 1
        rest = self.data[end:line_end].strip()
        if rest and not rest.startswith(b"#"):
            return None
        return line_start, line_end


def find_mutations(path: str, source: str) -> list[Mutation]:
    """Every mutation site in the functions of one file, in order of position, then operator. A file that does
    not parse has none."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    text = _Source(source)
    found = []
    for function, qualname in _functions(tree, ""):
        nodes = [inner for statement in function.body for inner in _walk_body(statement)]
        for node in [function, *nodes]:
            found += _mutations_at(node, text, path=path, function=qualname, only_blocks=node is function)
    order = {name: index for index, name in enumerate(OPERATORS)}
    return sorted(found, key=lambda m: (m.start, m.end, order[m.operator], m.replacement))


def _functions(node: ast.AST, prefix: str) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    """Each function with its qualified name; nested functions and methods included, each once."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield child, prefix + child.name
            yield from _functions(child, f"{prefix}{child.name}.<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        elif not isinstance(child, ast.Lambda):
            yield from _functions(child, prefix)


def _walk_body(node: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function body, without nested functions or classes (they are visited as functions of their
    own)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield from _walk_body(child)


def _mutations_at(
    node: ast.AST, text: _Source, *, path: str, function: str, only_blocks: bool = False
) -> Iterator[Mutation]:
    """The mutations of one node; ``only_blocks``: just the removals in its blocks (for the function itself, whose
    decorators and defaults are not mutated)."""

    def make(operator: str, span: tuple[int, int], replacement: str, description: str) -> Mutation:
        return Mutation(
            operator=operator,
            path=path,
            function=function,
            line=text.line_of(span[0]),
            start=span[0],
            end=span[1],
            replacement=replacement,
            description=description,
        )

    for field in ("body", "orelse", "finalbody"):
        block = getattr(node, field, None)
        if isinstance(block, list):
            for statement in block:
                edit = _removal(statement, text, is_alone=len(block) == 1)
                if edit is not None:
                    yield make("remove_statement", edit[0], edit[1], edit[2])
    if only_blocks:
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        old, new = _ARITHMETIC[type(node.op)]
        edit = text.operator_edit(node.left, node.right, old, new)
        if edit is not None:
            yield make("arithmetic", edit[0], edit[1], f"'{old}' -> '{new}'")
    if isinstance(node, ast.AugAssign) and type(node.op) in _ARITHMETIC:
        old, new = _ARITHMETIC[type(node.op)]
        edit = text.operator_edit(node.target, node.value, old + "=", new + "=")
        if edit is not None:
            yield make("arithmetic", edit[0], edit[1], f"'{old}=' -> '{new}='")
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        for left, op, right in zip(operands, node.ops, operands[1:], strict=False):
            old, new = _COMPARISON[type(op)]
            edit = text.operator_edit(left, right, old, new)
            if edit is not None:
                yield make("comparison", edit[0], edit[1], f"'{old}' -> '{new}'")
    if isinstance(node, ast.BoolOp):
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        for left, right in itertools.pairwise(node.values):
            edit = text.operator_edit(left, right, old, new)
            if edit is not None:
                yield make("boolean", edit[0], edit[1], f"'{old}' -> '{new}'")
    if isinstance(node, ast.If | ast.While | ast.IfExp):
        test = node.test
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):  # `not x` -> `x`, not `not (not x)`
            yield make("negate_condition", text.span(test), text.text(test.operand), "'not' dropped")
        else:
            yield make("negate_condition", text.span(test), f"not ({text.text(test)})", "condition negated")
    for target in _int_operands(node):
        value = target.value
        assert isinstance(value, int)
        yield make("off_by_one", text.span(target), str(value + 1), f"{value} -> {value + 1}")
    if (
        isinstance(node, ast.Call)
        and len(node.args) >= 2
        and not any(isinstance(arg, ast.Starred) for arg in node.args[:2])
    ):
        first, second = text.text(node.args[0]), text.text(node.args[1])
        if first != second:
            (start, first_end), (second_start, end) = text.span(node.args[0]), text.span(node.args[1])
            between = text.data[first_end:second_start].decode()
            yield make("swap_arguments", (start, end), second + between + first, "first two arguments swapped")


def _int_operands(node: ast.AST) -> list[ast.Constant]:
    """The integer literals of a comparison, an index or slice, a ``range()`` call or an arithmetic operation."""
    if isinstance(node, ast.Compare):
        candidates = [node.left, *node.comparators]
    elif isinstance(node, ast.Subscript):
        piece = node.slice
        candidates = [piece.lower, piece.upper, piece.step] if isinstance(piece, ast.Slice) else [piece]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
        candidates = list(node.args)
    elif isinstance(node, ast.BinOp):
        candidates = [node.left, node.right]
    else:
        return []
    negated = [c.operand for c in candidates if isinstance(c, ast.UnaryOp) and isinstance(c.op, ast.USub)]
    return [c for c in [*candidates, *negated] if isinstance(c, ast.Constant) and type(c.value) is int]


def _removal(statement: ast.stmt, text: _Source, *, is_alone: bool) -> tuple[tuple[int, int], str, str] | None:
    """Deleting a statement's lines (``pass`` in their place when it is its block's only statement)."""
    if not isinstance(statement, _REMOVABLE):
        return None
    if isinstance(statement, ast.AnnAssign) and statement.value is None:
        return None
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
        return None  # a docstring or a bare constant: removing it changes nothing
    bounds = text.line_bounds(statement)
    if bounds is None:
        return None
    if not is_alone:
        return bounds, "", "statement removed"
    indent = text.data[bounds[0] : text.span(statement)[0]].decode()
    return bounds, f"{indent}pass\n", "statement replaced by pass"
