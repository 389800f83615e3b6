"""The library's shape, read from its source: which module may import which.

The graph is built with ``ast`` from every ``import`` and ``from ... import`` in
lib/ultrascale, at module level and inside functions alike (a function-level import is
still a dependency; it only runs later), relative imports resolved. An edge is recorded
to the module an import names, and to ``package.name`` when ``from package import name``
takes a submodule; the parent packages Python also initialises on the way are not edges.

The rules are DESIGN.md's conventions for the library:
* no two modules import each other, directly or round a longer circle;
* techniques import ``data`` and ``train``, never the checks in ``parity``; in particular
  nothing under ``parallel`` does, without exception;
* the collectives and their cost models (``comm``) know no model: a cost takes the numbers
  it needs (a FLOP count, a hidden size) from its caller;
* the pure packages (the schedule simulator, the collectives and cost models, the planner,
  the model, the data and the training loop) import neither the notebook side (``runtime``)
  nor the drawings (``viz``);
* the planner is arithmetic: only ``plan.calibrate``, which measures real runs, uses ``parallel``;
* the number formats (``precision``) sit beside the techniques, not above them: they import
  nothing from ``parallel`` (a plan is read with ``matching``, which every package may use);
* no private name crosses a module: ``from x import _name`` and ``x._name`` (``x`` bound by an
  import to a course module or to something taken from one) stay inside the module that
  defines ``_name``; what two modules share has a public name;
* the library never imports the grader (``ultrascale_grading``, the in-notebook ``check``, the
  command-line grader and the exercises' tests): the grader imports the library.
Each rule lists its exceptions by name; an exception that is no longer needed fails too,
so the lists only shrink.
"""

import ast
from pathlib import Path

LIB = Path(__file__).resolve().parent.parent / "lib" / "ultrascale"


def module_name(path: Path, package: Path = LIB) -> str:
    """``lib/ultrascale/parallel/mesh.py`` -> ``ultrascale.parallel.mesh``; a package's
    ``__init__.py`` is the package itself. ``package``: the top package's folder."""
    parts = (package.name,) + path.relative_to(package).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(LIB.rglob("*.py"))}


def named_modules(importer: str, path: Path, node) -> list[str]:
    """The dotted names an import statement may refer to, relative ones made absolute."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    base = node.module or ""
    if node.level:  # from .x (level 1: this package), from ..x (its parent), ...
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def imports_of(name: str, path: Path) -> set[str]:
    """Every library module that ``name`` imports, anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(m for m in named_modules(name, path, node) if m in MODULES and m != name)
    return found


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def find_circle(graph: dict) -> list | None:
    """One import circle as ``[a, b, ..., a]``, or None: a depth-first search that meets a
    module still on its own path has come round."""
    done, path = set(), []

    def visit(node):
        path.append(node)
        for child in sorted(graph.get(node, ())):
            if child in path:
                return path[path.index(child) :] + [child]
            if child not in done:
                circle = visit(child)
                if circle:
                    return circle
        done.add(path.pop())
        return None

    for start in sorted(graph):
        if start not in done:
            circle = visit(start)
            if circle:
                return circle
    return None


def inside(module: str, *prefixes: str) -> bool:
    """``module`` is one of ``ultrascale.<prefix>`` or lies in that package."""
    return any(module == f"ultrascale.{p}" or module.startswith(f"ultrascale.{p}.") for p in prefixes)


def violations(importers: tuple, forbidden: tuple) -> set[tuple[str, str]]:
    """Every (importer, imported) edge from the ``importers`` packages into the ``forbidden`` ones."""
    return {
        (name, target)
        for name, targets in GRAPH.items()
        if inside(name, *importers)
        for target in targets
        if inside(target, *forbidden)
    }


def assert_only_the_exceptions(found: set, exceptions: set, rule: str) -> None:
    """``found`` breaks ``rule`` only where ``exceptions`` say so, and every exception is still needed."""
    assert found - exceptions == set(), f"{rule}; broken by {sorted(found - exceptions)}"
    assert exceptions - found == set(), f"no longer needed, remove from the exceptions: {sorted(exceptions - found)}"


# --------------------------------------------------------------------------- the rules
TECHNIQUES = ("parallel", "comm", "precision", "schedule", "moe", "model", "kernels", "plan", "data", "train")
# The checks that compare a technique's run with one process or with PyTorch's own version
# (parity.pipeline_runs, parity.expert_runs, parity.composition) live in parity, beside
# assert_same; what techniques train with is train's (run_steps, run_pipeline_steps).
CHECKING = set()

PURE = ("schedule", "comm", "plan", "model", "moe", "data", "train")
NOTEBOOK_SIDE = ("runtime", "viz")
PURE_EXCEPTIONS = set()  # the schedules' drawing and widget are viz.schedule and viz.schedule_widget

PLANNER_RUNS = {("ultrascale.plan.calibrate", "ultrascale.parallel")}  # measures the techniques for real

# The grader and the exercises' tests are a package of their own beside the library (issue 56,
# item 6): they import the library, which never imports them.
GRADER = "ultrascale_grading"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_crossings(name: str, path: Path, tree=None, modules: dict = MODULES) -> set[str]:
    """``"<line>: <what>"`` for every private name that ``name`` takes from another course
    module: ``from x import _y``, or ``z._y`` where ``z`` was imported (a module, or a class or
    function from a course module). ``modules``: the course modules, by name."""
    tree = tree or ast.parse(path.read_text(), filename=str(path))
    found, bound = set(), {}  # bound: local name -> the course module it came from
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = named_modules(name, path, node)[0]
            for alias in node.names:
                if source in modules and source != name:
                    bound[alias.asname or alias.name] = source
                    if _private(alias.name):
                        found.add(f"{node.lineno}: from {source} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.name != name:
                    bound[alias.asname or alias.name.partition(".")[0]] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
        ):
            found.add(f"{node.lineno}: {node.value.id}.{node.attr} ({bound[node.value.id]})")
    return found


def grader_imports(name: str, path: Path, tree=None) -> set[str]:
    """``"<line>: <module>"`` for every import of the grader in ``name``'s source: ``import`` and
    ``from ... import`` anywhere in it, and ``importlib.import_module`` or ``__import__`` of a
    literal name."""
    tree = tree or ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = named_modules(name, path, node)[:1]  # the module it imports from, made absolute
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        else:
            continue
        found.update(f"{node.lineno}: {m}" for m in names if m == GRADER or m.startswith(GRADER + "."))
    return found


def found_in(finder, source: str) -> set[str]:
    """What ``finder`` (``private_crossings``, ``grader_imports``) sees in ``source``, read as if it
    were ``ultrascale.comm.direct``'s."""
    return finder("ultrascale.comm.direct", MODULES["ultrascale.comm.direct"], ast.parse(source))


def across_the_library(finder) -> list[str]:
    """``"<module> <line>: <what>"`` for everything ``finder`` sees in the library's modules."""
    return sorted(f"{name} {where}" for name, path in MODULES.items() for where in finder(name, path))


# --------------------------------------------------------------------------- tests
def test_the_graph_sees_module_level_and_function_level_imports():
    # Without these the rules below could pass on a graph that misses imports.
    assert len(GRAPH) > 100
    assert "ultrascale.data" in GRAPH["ultrascale.parallel.pipeline_parallel"]  # from ..data import
    assert "ultrascale.schedule.simulate" in GRAPH["ultrascale.schedule.actions"]  # from .simulate import
    assert "ultrascale.parallel" in GRAPH["ultrascale.plan.calibrate"]  # inside a function
    assert "ultrascale.runtime.magic" in GRAPH["ultrascale.runtime.cluster"]  # inside a function
    assert "ultrascale.comm.functional" in GRAPH["ultrascale.comm"]  # from .functional import


def test_the_private_name_finder_sees_both_forms():
    source = (
        "from .ring import _normalise_op, keep\nfrom . import functional\nimport ultrascale.train as t\n"
        "functional._piece_size(1, 1, 0, '')\nt._full(x)\nkeep._kept\nself._mine\nkeep.__doc__\n"
    )
    found = found_in(private_crossings, source)
    assert found == {
        "1: from ultrascale.comm.ring import _normalise_op",
        "4: functional._piece_size (ultrascale.comm)",
        "5: t._full (ultrascale.train)",
        "6: keep._kept (ultrascale.comm.ring)",
    }, found


def test_no_private_name_crosses_a_module():
    found = across_the_library(private_crossings)
    assert found == [], f"a private name used outside its module; give what modules share a public name: {found}"


# The grader's own modules follow the same rule. It may name a library private for one reason: to
# refuse a learner's call to it (guards.without_library / forbid_library), since a learner could
# reach the answer through it. Those are listed by (grader module, private name).
GRADER_MODULES = {module_name(path, LIB.parent / GRADER): path for path in sorted((LIB.parent / GRADER).rglob("*.py"))}
REFUSED_PRIVATES = {
    ("exercise_tests.ch02_gradient_sync", "DataParallel._all_reduce"),
    ("exercise_tests.ch04", "functional._all_reduce"),
    ("exercise_tests.ch04_vocab_parallel", "vocab_parallel._cross_entropy"),
    ("exercise_tests.ch05", "functional._all_gather"),
    ("exercise_tests.ch05", "functional._reduce_scatter"),
    ("exercise_tests.ch06", "library._heads_to_sequence"),
    ("exercise_tests.ch06", "library._sequence_to_heads"),
    ("exercise_tests.ch08_expert_parallel", "ep._reduce"),
    ("exercise_tests.cha2", "_ffn_params"),
    ("exercise_tests.cha2", "_llama_matmul_params_per_layer"),
    ("exercise_tests.cha4_atomic_save", "store._commit"),
}


def test_no_private_name_crosses_a_module_of_the_grader():
    course = {**MODULES, **GRADER_MODULES}  # the library's modules and the grader's own
    found = set()
    for name, path in GRADER_MODULES.items():
        for where in private_crossings(name, path, modules=course):
            what = where.split(": ", 1)[1].split(" (")[0].rsplit(" import ", 1)[-1]  # the private name as written
            found.add((name.removeprefix(GRADER + "."), what))
    assert_only_the_exceptions(
        found,
        REFUSED_PRIVATES,
        "the grader names a library private only to refuse it; what its modules share is public",
    )


def test_the_grader_finder_sees_every_form():
    source = (
        "import ultrascale_grading\nfrom ultrascale_grading.check import check\nimport ultrascale_grading.cli as cli\n"
        "def f():\n    from ultrascale_grading import exercise\n"
        "importlib.import_module('ultrascale_grading.registry')\n__import__('ultrascale_grading.guards')\n"
        "from ultrascale import grading_cluster\nimport ultrascale_gradingx\nfrom . import workspace\n"
    )
    found = found_in(grader_imports, source)
    assert found == {
        "1: ultrascale_grading",
        "2: ultrascale_grading.check",
        "3: ultrascale_grading.cli",
        "5: ultrascale_grading",
        "6: ultrascale_grading.registry",
        "7: ultrascale_grading.guards",
    }, found


def test_the_library_never_imports_the_grader():
    # The library a learner reads holds the course's techniques only; the grader is built on it.
    found = across_the_library(grader_imports)
    assert found == [], f"the library imports the grader ({GRADER}); move what it needs into the library: {found}"


def test_precision_does_not_import_the_techniques():
    assert violations(("precision",), ("parallel",)) == set(), "precision must not import parallel"


def test_the_circle_finder_finds_a_circle():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_circle():
    circle = find_circle(GRAPH)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_techniques_do_not_import_the_checks():
    assert_only_the_exceptions(
        violations(TECHNIQUES, ("parity",)), CHECKING, "techniques import data and train, never parity"
    )


def test_parallel_never_imports_parity():
    # No exceptions here: a check of a technique lives in parity and imports the technique,
    # never the other way round.
    assert violations(("parallel",), ("parity",)) == set(), "parallel must not import parity"


def test_comm_does_not_import_the_model():
    assert violations(("comm",), ("model",)) == set(), "comm's cost models take numbers, not a model"


def test_pure_packages_import_neither_runtime_nor_viz():
    assert_only_the_exceptions(
        violations(PURE, NOTEBOOK_SIDE), PURE_EXCEPTIONS, "the pure packages import neither runtime nor viz"
    )


def test_the_planner_uses_the_techniques_only_to_calibrate():
    assert_only_the_exceptions(
        violations(("plan",), ("parallel", "runtime")),
        PLANNER_RUNS,
        "the planner is arithmetic: it never runs the techniques",
    )


# --------------------------------------------------------------------------- a technique's basic form
# Issue 56, item 1: a learner follows a technique from its apply_* through what its module
# imports. What every technique shares is read once and not counted against any of them: the
# collectives (comm), the mesh, the timeline (disabled unless asked for), the gradient sum over a
# group (grad_sync), the plan matcher, and the model, its MoE layer and its data. A module of
# ``parallel`` or a top-level one is a file; a subpackage (schedule, kernels, precision) is one
# unit, as comm is. Refinements (SP, async TP, vocabulary parallelism, Ulysses, all-gathered K/V,
# ZeRO-3) are not imported by the basic form: they register themselves with it when the package
# imports them.
SHARED = {
    "ultrascale.comm",
    "ultrascale.parallel.mesh",
    "ultrascale.parallel.timeline",
    "ultrascale.parallel.grad_sync",
    "ultrascale.matching",
    "ultrascale.model",
    "ultrascale.moe",
    "ultrascale.data",
}
BASIC_FORMS = ("tensor_parallel", "context_parallel", "pipeline_parallel", "expert_parallel", "zero")
MOST_FILES = 3


def unit(module: str) -> str:
    """The file or package a reader opens for ``module``: a subpackage of ``ultrascale`` other
    than ``parallel`` is one unit."""
    parts = module.split(".")
    return module if len(parts) <= 2 or parts[1] == "parallel" else ".".join(parts[:2])


def basic_form(technique: str) -> set[str]:
    """The units a reader opens from ``parallel/<technique>.py``, following its imports and
    theirs, not counting the shared ones (nor following them: their own imports are theirs)."""
    start = f"ultrascale.parallel.{technique}"
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen or unit(module) in SHARED:
            continue
        seen.add(module)
        todo.extend(GRAPH[module])
    return {unit(m) for m in seen}


def reading_list(technique: str) -> str:
    """The paragraph of the module's opening comment that names its basic form's files."""
    doc = ast.get_docstring(ast.parse(MODULES[f"ultrascale.parallel.{technique}"].read_text())) or ""
    for paragraph in doc.split("\n\n"):
        if "Files for the basic form" in paragraph:
            return " ".join(paragraph.split())
    return ""


def file_name(unit_name: str) -> str:
    """How an opening comment names a unit: ``flat.py``, ``schedule/``, ``comm/``."""
    last = unit_name.rpartition(".")[2]
    return f"{last}.py" if unit_name in MODULES and not MODULES[unit_name].name == "__init__.py" else f"{last}/"


def test_the_basic_form_finder_follows_imports_and_stops_at_the_shared_files():
    assert unit("ultrascale.schedule.generators") == "ultrascale.schedule"
    assert unit("ultrascale.parallel.flat") == "ultrascale.parallel.flat"
    assert file_name("ultrascale.schedule") == "schedule/" and file_name("ultrascale.parallel.flat") == "flat.py"
    form = basic_form("pipeline_parallel")
    assert "ultrascale.schedule" in form and form.isdisjoint(SHARED), form


def test_each_technique_reads_in_its_module_and_at_most_two_more_files():
    too_many = {}
    for technique in BASIC_FORMS:
        form = basic_form(technique)
        if len(form) > MOST_FILES:
            too_many[technique] = sorted(form)
    assert too_many == {}, (
        f"a technique's basic form opens more than {MOST_FILES} files besides the shared ones; "
        f"layer the refinements on from their own modules (they register with the basic form): {too_many}"
    )


def test_each_opening_comment_names_its_basic_forms_files():
    unnamed = {}
    for technique in BASIC_FORMS:
        paragraph = reading_list(technique)
        names = [file_name(u) for u in sorted(basic_form(technique)) if u != f"ultrascale.parallel.{technique}"]
        missing = [n for n in names + ["comm/", "mesh.py"] if f"``{n}" not in paragraph]
        if not paragraph or missing:
            unnamed[technique] = missing or "no paragraph starting 'Files for the basic form'"
    assert unnamed == {}, f"the opening comment's reading list misses files the basic form opens: {unnamed}"
