"""No check passes over nothing (issue 54 item 6): ``all()`` of an empty collection is True.

A static scan (``ast``, no notebook runs; well under a second):

* **across cells.** A chapter cell that fills a list or dict made empty at its top (``rows = {}``
  then a loop) can be interrupted; the next cell then iterates over nothing and its checks and
  "every rank within 10%" pass on no rows. Every later cell that iterates over such a
  collection must first pass it through ``ultrascale.checks.nonempty`` or ``all_of``.
* **filters.** ``assert all(... for x in xs)`` where ``xs`` was made in the same scope by a
  comprehension with an ``if`` (a filter can keep nothing) or as an empty container that a
  loop fills, in chapters/ and lib/: the check must go through ``all_of`` (or ``nonempty``),
  unless an assertion of the same scope states how many there are (``assert len(xs) == n``).

The helpers themselves are checked on an empty input, a failing one and a passing one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ultrascale.checks import EmptyInput, all_of, nonempty

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.py"))
LIBRARY = sorted(
    path for package in ("ultrascale", "ultrascale_grading") for path in (ROOT / "lib" / package).rglob("*.py")
)
GUARDS = {"nonempty", "all_of"}
EMPTY_CALLS = {"list", "dict", "set", "OrderedDict", "defaultdict", "Counter", "deque"}
# Calls whose first argument is what the loop really goes over: `for i, r in enumerate(rows)`.
PASS_THROUGH = {"enumerate", "sorted", "reversed", "list", "tuple", "zip"}


def _is_empty_container(node: ast.AST) -> bool:
    if isinstance(node, (ast.List, ast.Set)):
        return not node.elts
    if isinstance(node, ast.Dict):
        return not node.keys
    if isinstance(node, ast.Call):
        name = getattr(node.func, "id", getattr(node.func, "attr", None))
        return name in EMPTY_CALLS and (name == "defaultdict" or not node.args) and not node.keywords
    return False


def _is_filter(node: ast.AST) -> bool:
    """A comprehension with an ``if``: it may keep nothing."""
    return isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)) and any(
        gen.ifs for gen in node.generators
    )


def _iterated_name(node: ast.AST) -> str | None:
    """The variable a ``for`` goes over: ``rows``, ``rows.items()``, ``enumerate(rows)`` -> rows."""
    while isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("items", "values", "keys"):
            node = node.func.value
        elif isinstance(node.func, ast.Name) and node.func.id in PASS_THROUGH and node.args:
            node = node.args[0]
        else:
            return None
    return node.id if isinstance(node, ast.Name) else None


def _bindings(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names bound by the plain assignments of one block (``a = ...``, ``a, b = x, y``) -> value."""
    bound = {}
    for node in body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name):
                bound[target.id] = node.value
            elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                bound.update({t.id: v for t, v in zip(target.elts, node.value.elts) if isinstance(t, ast.Name)})
    return bound


def _guarded(tree: ast.AST) -> set[str]:
    """Names passed to nonempty / all_of somewhere in ``tree``."""
    return {
        call.args[0].id
        for call in ast.walk(tree)
        if isinstance(call, ast.Call)
        and getattr(call.func, "id", getattr(call.func, "attr", None)) in GUARDS
        and call.args
        and isinstance(call.args[0], ast.Name)
    }


def _assigned(tree: ast.AST) -> set[str]:
    return {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        for target in ast.walk(target)
        if isinstance(target, ast.Name)
    }


def _counted(assertion: ast.Assert) -> set[str]:
    """Names whose count an assertion states (``assert len(sends) == CP - 1``): their checks
    cover a known number of items, which the assertion on the count makes sure of."""
    return {
        call.args[0].id
        for call in ast.walk(assertion.test)
        if isinstance(call, ast.Call)
        and getattr(call.func, "id", None) == "len"
        and call.args
        and isinstance(call.args[0], ast.Name)
    }


def _iterations(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)):
            yield node.iter


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _cells(path: Path) -> list[ast.Module]:
    """A jupytext chapter's code cells, parsed with their line numbers in the file."""
    lines = path.read_text().splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith("# %%")] + [len(lines)]
    cells = []
    for start, stop in zip(starts, starts[1:]):
        if "[markdown]" in lines[start]:
            continue
        tree = ast.parse("".join(lines[start:stop]))
        ast.increment_lineno(tree, start)
        cells.append(tree)
    return cells


def across_cells(path: Path) -> list[str]:
    """Iterations over a collection an earlier cell filled, without nonempty/all_of first."""
    found, filled = [], {}
    for cell in _cells(path):
        guarded = _guarded(cell) | _assigned(cell)  # a name this cell binds again is its own
        for iterable in _iterations(cell):
            name = _iterated_name(iterable)
            if name in filled and name not in guarded:
                found.append(
                    f"{_shown(path)}:{iterable.lineno}: iterates {name!r}, filled in an "
                    f"earlier cell (line {filled[name]}), without nonempty/all_of"
                )
        for name, value in _bindings(cell.body).items():
            if _is_empty_container(value):
                filled[name] = value.lineno
            else:
                filled.pop(name, None)  # rebound to something else in this cell
    return found


class _Scopes(ast.NodeVisitor):
    """One walk of a module: per function (and the module itself), the values its plain
    assignments bind, the names whose count an assertion states, and its ``assert all(genexp)``."""

    def __init__(self):
        self.scopes, self.stack = [], []

    def _enter(self, node):
        self.stack.append({"bound": {}, "counted": set(), "asserts": []})
        self.scopes.append(self.stack[-1])
        self.generic_visit(node)
        self.stack.pop()

    visit_Module = visit_FunctionDef = visit_AsyncFunctionDef = _enter

    def visit_Assign(self, node):
        self.stack[-1]["bound"].update(_bindings([node]))
        self.generic_visit(node)

    def visit_Assert(self, node):
        scope = self.stack[-1]
        scope["counted"] |= _counted(node)
        test = node.test
        if (
            isinstance(test, ast.Call)
            and getattr(test.func, "id", None) == "all"
            and test.args
            and isinstance(test.args[0], ast.GeneratorExp)
        ):
            scope["asserts"].append(node)
        self.generic_visit(node)


def vacuous_asserts(path: Path) -> list[str]:
    """``assert all(...)`` over a filter's result or a loop-filled container of the same scope."""
    walk = _Scopes()
    walk.visit(ast.parse(path.read_text()))
    found = []
    for scope in walk.scopes:
        suspects = {
            name for name, value in scope["bound"].items() if _is_filter(value) or _is_empty_container(value)
        } - scope["counted"]
        for node in scope["asserts"]:
            for gen in node.test.args[0].generators:
                name = _iterated_name(gen.iter)
                if name in suspects:
                    found.append(
                        f"{_shown(path)}:{node.lineno}: assert all(...) over {name!r}, which "
                        "may be empty (a filter or a filled container): use all_of"
                    )
    return sorted(set(found))


def test_no_cell_iterates_over_what_an_interrupted_cell_left_empty():
    found = [line for path in CHAPTERS for line in across_cells(path)]
    assert not found, "\n".join(found)


def test_no_assert_all_over_a_possibly_empty_collection():
    found = [line for path in CHAPTERS + LIBRARY for line in vacuous_asserts(path)]
    assert not found, "\n".join(found)


def test_the_scan_finds_both_kinds(tmp_path):
    """The two rules catch what they exist for (so a scan that finds nothing means something)."""
    chapter = tmp_path / "chapter.py"
    chapter.write_text(
        "# %%\nrows = {}\nfor i in range(3):\n    rows[i] = i\n\n"
        "# %% [markdown]\n# text\n\n# %%\nfor k, v in rows.items():\n    assert v >= 0\n"
        "print('all rows fine')\n\n# %%\nnonempty(rows, 'rows')\nfor k in rows:\n    pass\n"
    )
    found = [line.split(": ", 1)[1] for line in across_cells(chapter)]
    assert found == ["iterates 'rows', filled in an earlier cell (line 2), without nonempty/all_of"], found
    module = tmp_path / "module.py"
    module.write_text(
        "def f(events):\n    sends = [e for e in events if e['op'] == 'send']\n"
        "    assert all(e['bytes'] > 0 for e in sends)\n    assert all(e for e in events)\n"
    )
    assert [line.split(": ", 1)[1] for line in vacuous_asserts(module)] == [
        "assert all(...) over 'sends', which may be empty (a filter or a filled container): use all_of"
    ]


def test_helpers_refuse_nothing():
    with pytest.raises(EmptyInput, match=re.escape("no rows to check") + ".*interrupted"):
        all_of([], "rows")
    with pytest.raises(EmptyInput, match="no rows"):
        nonempty({}, "rows")
    assert all_of([1, 2], "rows", lambda x: x > 0) and not all_of([1, -2], "rows", lambda x: x > 0)
    rows = {"a": 1}
    assert nonempty(rows, "rows") is rows
    with pytest.raises(TypeError, match="length"):
        nonempty(iter([1]), "rows")
