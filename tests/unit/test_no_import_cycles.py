"""No two modules of sharpen import each other, directly or round a circle, function-level imports included.

A function-level import can hide a circle from Python (the import runs after both modules are loaded) but not from a
reader: the two modules are one piece that pretends to be two. This test parses every module under ``src/sharpen``
with `ast`, takes every ``import sharpen...`` and ``from sharpen... import ...`` (relative ones resolved) at any depth
except under ``if TYPE_CHECKING:``, and fails on any strongly connected component of more than one module.

Edges: ``import sharpen.x.y`` -> ``sharpen.x.y``; ``from sharpen.x import y`` -> ``sharpen.x.y`` when ``y`` is a
submodule, else ``sharpen.x`` (a package's ``__init__.py``). Importing a submodule also runs its parents'
``__init__.py``, but that is not counted: it would join every package with its children.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

KNOWN_CYCLES: list[frozenset[str]] = [
    # Each entry: the modules of one circle that is known and not yet broken, with why it is still here. A cycle is
    # tolerated only while all its modules are inside one entry; delete an entry once its circle is gone.
]


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the sharpen package (a package is its ``__init__.py``)."""
    modules = {}
    for path in sorted((SRC / "sharpen").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(nodes: Iterable[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``nodes``, at any depth, except in the body of ``if TYPE_CHECKING:``."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse)
        else:
            yield from _imports(ast.iter_child_nodes(node))


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The sharpen modules that module ``name`` (at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in _imports([ast.parse(path.read_text(), filename=str(path))]):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            targets.add(submodule if submodule in modules else base)
    return {target for target in targets if target in modules and target != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def cycle_through(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """One shortest import chain that starts and ends at the component's first module (for the failure message)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not a strongly connected component")


def import_cycles() -> list[set[str]]:
    return [component for component in strongly_connected(import_graph()) if len(component) > 1]


def test_no_module_of_sharpen_imports_itself_round_a_circle():
    graph = import_graph()
    new = [
        " -> ".join(cycle_through(component, graph))
        for component in strongly_connected(graph)
        if len(component) > 1 and not any(component <= known for known in KNOWN_CYCLES)
    ]
    assert new == [], "import cycles (function-level imports included; move the shared piece down):\n" + "\n".join(new)


def test_every_known_cycle_is_still_a_cycle():
    cycles = import_cycles()
    stale = [sorted(known) for known in KNOWN_CYCLES if not any(cycle <= known for cycle in cycles)]
    assert stale == [], f"these circles are gone: delete their entries from KNOWN_CYCLES: {stale}"


def test_the_graph_sees_function_level_relative_and_submodule_imports(tmp_path):
    package = tmp_path / "sharpen"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import leaf\n")
    (package / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import sharpen.top\n"
        "def f():\n    from ..top import thing\n"
    )
    (package / "top.py").write_text("from sharpen.sub import leaf\nimport sharpen\n")
    modules = {
        "sharpen": package / "__init__.py",
        "sharpen.sub": package / "sub" / "__init__.py",
        "sharpen.sub.leaf": package / "sub" / "leaf.py",
        "sharpen.top": package / "top.py",
    }
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert graph == {
        "sharpen": set(),
        "sharpen.sub": {"sharpen.sub.leaf"},
        "sharpen.sub.leaf": {"sharpen.top"},
        "sharpen.top": {"sharpen.sub.leaf", "sharpen"},
    }
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [{"sharpen.sub.leaf", "sharpen.top"}]
    assert cycle_through({"sharpen.sub.leaf", "sharpen.top"}, graph) == [
        "sharpen.sub.leaf",
        "sharpen.top",
        "sharpen.sub.leaf",
    ]
