"""Each mutation operator on a small hand-written function, against the mutated sources written out by hand: only
the operator's own characters (or the statement's lines) change, everything else keeps its formatting."""

from __future__ import annotations

import ast
import textwrap

import pytest

from sharpen.tasks.mutations import OPERATORS, find_mutations


def _mutants(source: str, operator: str) -> list[str]:
    source = textwrap.dedent(source)
    return [m.apply(source) for m in find_mutations("m.py", source) if m.operator == operator]


def _golden(*sources: str) -> list[str]:
    return [textwrap.dedent(source) for source in sources]


def test_arithmetic():
    source = """\
        def area(w, h):
            total = (w + 1)  *  h
            total //= 2
            return total
        """
    assert _mutants(source, "arithmetic") == _golden(
        """\
        def area(w, h):
            total = (w - 1)  *  h
            total //= 2
            return total
        """,
        """\
        def area(w, h):
            total = (w + 1)  //  h
            total //= 2
            return total
        """,
        """\
        def area(w, h):
            total = (w + 1)  *  h
            total *= 2
            return total
        """,
    )


def test_comparison():
    source = """\
        def within(a, b):
            return a < b <= 3 and a is not None
        """
    assert _mutants(source, "comparison") == _golden(
        """\
        def within(a, b):
            return a <= b <= 3 and a is not None
        """,
        """\
        def within(a, b):
            return a < b < 3 and a is not None
        """,
        """\
        def within(a, b):
            return a < b <= 3 and a is None
        """,
    )


def test_boolean():
    source = """\
        def either(a, b, c):
            return a and (b or c)
        """
    assert _mutants(source, "boolean") == _golden(
        """\
        def either(a, b, c):
            return a or (b or c)
        """,
        """\
        def either(a, b, c):
            return a and (b and c)
        """,
    )


def test_negate_condition():
    source = """\
        def steps(x):
            if x > 0:
                return 1
            while not x:
                x = x + 1
            return 2 if x else 3
        """
    assert _mutants(source, "negate_condition") == _golden(
        """\
        def steps(x):
            if not (x > 0):
                return 1
            while not x:
                x = x + 1
            return 2 if x else 3
        """,
        """\
        def steps(x):
            if x > 0:
                return 1
            while x:
                x = x + 1
            return 2 if x else 3
        """,
        """\
        def steps(x):
            if x > 0:
                return 1
            while not x:
                x = x + 1
            return 2 if not (x) else 3
        """,
    )


def test_off_by_one():
    source = """\
        def ends(s):
            return s[1:] + s[-1] if len(s) > 2 else list(range(3))
        """
    assert _mutants(source, "off_by_one") == _golden(
        """\
        def ends(s):
            return s[2:] + s[-1] if len(s) > 2 else list(range(3))
        """,
        """\
        def ends(s):
            return s[1:] + s[-2] if len(s) > 2 else list(range(3))
        """,
        """\
        def ends(s):
            return s[1:] + s[-1] if len(s) > 3 else list(range(3))
        """,
        """\
        def ends(s):
            return s[1:] + s[-1] if len(s) > 2 else list(range(4))
        """,
    )


def test_remove_statement():
    source = """\
        def total(items):
            \"\"\"The docstring stays.\"\"\"
            items.sort()
            count = 0  # a comment goes with its line
            if not items:
                raise ValueError("empty")
            return count
        """
    assert _mutants(source, "remove_statement") == _golden(
        """\
        def total(items):
            \"\"\"The docstring stays.\"\"\"
            count = 0  # a comment goes with its line
            if not items:
                raise ValueError("empty")
            return count
        """,
        """\
        def total(items):
            \"\"\"The docstring stays.\"\"\"
            items.sort()
            if not items:
                raise ValueError("empty")
            return count
        """,
        """\
        def total(items):
            \"\"\"The docstring stays.\"\"\"
            items.sort()
            count = 0  # a comment goes with its line
            if not items:
                pass
            return count
        """,
    )


def test_swap_arguments():
    source = """\
        def power(a, b):
            return pow(a,  b) + max(a, a) + divmod(*a)
        """
    assert _mutants(source, "swap_arguments") == _golden(
        """\
        def power(a, b):
            return pow(b,  a) + max(a, a) + divmod(*a)
        """
    )


def test_only_function_bodies_are_mutated_and_offsets_count_bytes():
    source = textwrap.dedent(
        """\
        LIMIT = 1 + 2


        class Box:
            size = 3 - 1

            def grow(self, by=4 - 3):
                return "é" + by
        """
    )
    mutants = find_mutations("m.py", source)
    assert [(m.operator, m.function, m.line) for m in mutants] == [("arithmetic", "Box.grow", 8)]
    assert mutants[0].apply(source).endswith('        return "é" - by\n')


def test_every_operator_has_a_golden_test_and_mutants_parse():
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert set(OPERATORS) <= tested
    source = textwrap.dedent(
        """\
        def mixed(a, b):
            if a < b and b % 2:
                a += f(b, a) - 1
            return a[0:-1]
        """
    )
    for mutation in find_mutations("m.py", source):
        ast.parse(mutation.apply(source))


@pytest.mark.parametrize("source", ["def broken(:\n", "x = 1\n"])
def test_files_without_sites(source):
    assert find_mutations("m.py", source) == []
