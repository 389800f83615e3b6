"""Hints teach without giving the answer, and chapters and exercises link both ways (issue 41).

Every exercise has two tiers of help, both written in solutions/ and generated into exercises/:

* the nudge: the text after ``# BEGIN SOLUTION hint:``, which the stub's NotImplementedError
  carries and ``check(...)`` shows ("not implemented yet");
* the idea: a markdown cell right under the exercise's ``check(...)`` cell, with the idea folded
  in ``<details><summary>The idea ...</summary>``, and a link to the chapter section it practises.

Neither tier may hold the solution's code. The rule (``leaks``): a hint leaks when, with all
whitespace removed (and quotes unified), it contains

* a line of a solution region of 25 characters or more (its trailing comment left out), or
* a call with arguments written in a solution region (as ``ast.unparse`` writes it, 12 characters
  or more), e.g. ``torch.autograd.grad(output, stage_input, grad_output, retain_graph=True)``.

Naming a function (``torch.autograd.grad``, ``dist.all_reduce``) is allowed; writing the call
the solution makes is not.

The same rule holds for the third kind of help, the failure messages of the exercise tests
(``lib/ultrascale_grading/exercise_tests/chNN.py``, issue 54): a message points at the idea the code
missed, and may repeat what the exercise's own text shows, but never writes the solution's code
beyond it, nor computes the answer of the case that failed (chapter 06's zig-zag feedback named
the chunks a rank should hold).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from ultrascale_grading.generate import BEGIN_RE, END_RE

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
MIN_LINE_CHARS = 25
MIN_CALL_CHARS = 12
MIN_INSTRUCTION_CHARS = 30  # instructions may show a short API call ("tl.program_id(0)"), not an answer
IDEA_MARK = "<summary>The idea"
CHECK_RE = re.compile(r'check\("([^"]+)"')
LINK_RE = re.compile(r"\]\(\.\./chapters/([a-z0-9_]+)\.ipynb(?:#([^)]*))?\)")


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text).replace('"', "'")


def _python(source: str) -> str:
    """The cell as Python: magics blanked, as the generator does."""
    if source.lstrip().startswith("%%"):
        return ""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def solution_secrets(source: str) -> set:
    """What no hint may contain, from the solution regions of one code cell."""
    lines = source.splitlines()
    region_lines, inside = set(), False
    for number, line in enumerate(lines, start=1):
        if BEGIN_RE.match(line):
            inside = True
        elif END_RE.match(line):
            inside = False
        elif inside:
            region_lines.add(number)
    secrets = set()
    for number in region_lines:
        code = re.sub(r"\s+#.*$", "", lines[number - 1]).strip()
        if not code.startswith("#") and len(squash(code)) >= MIN_LINE_CHARS:
            secrets.add(squash(code))
    try:
        tree = ast.parse(_python(source))
    except SyntaxError:
        tree = None
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Call) and (node.args or node.keywords) and node.lineno in region_lines:
            call = squash(ast.unparse(node))
            if len(call) >= MIN_CALL_CHARS:
                secrets.add(call)
    return secrets


def nudges(source: str) -> list:
    return [(m.group("hint") or "").strip() for m in map(BEGIN_RE.match, source.splitlines()) if m]


def hints_and_secrets(nb) -> tuple:
    """({exercise id: [nudge, ..., idea]}, secrets of the whole notebook)."""
    hints, secrets, pending, last = {}, set(), [], None
    for cell in nb.cells:
        if cell.cell_type == "code":
            pending += nudges(cell.source)
            secrets |= solution_secrets(cell.source)
            found = CHECK_RE.search(cell.source)
            if found:
                last = found.group(1)
                hints[last], pending = pending, []
        elif IDEA_MARK in cell.source:
            assert last is not None, "an idea cell above every check cell"
            hints[last].append(cell.source)
    return hints, secrets


def leaks(nb) -> list:
    """(exercise id, the solution's code found in one of its hints) for every leak."""
    hints, secrets = hints_and_secrets(nb)
    return [
        (ex, secret)
        for ex, texts in hints.items()
        for text in texts
        for secret in sorted(secrets)
        if secret in squash(text)
    ]


def registered_exercises() -> set:
    found = set()
    for path in (ROOT / "lib/ultrascale_grading/exercise_tests").glob("*.py"):
        found |= set(re.findall(r'@exercise\("([0-9a][0-9]\.\w+)"', path.read_text()))
    return found


NOTEBOOKS = sorted(SOLUTIONS.glob("*_exercises.ipynb"))


def _cell(source: str):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])


# ---- the rule, on the hint issue 41 reported --------------------------------------------------

OLD_SPLIT_BACKWARD = """def backward_input(output, stage_input, grad_output):
    # BEGIN SOLUTION hint: {hint}
    return torch.autograd.grad(output, stage_input, grad_output, retain_graph=True)[0]
    # END SOLUTION
check("07.split_backward", backward_input)
"""


@pytest.mark.parametrize(
    "hint",
    [
        "torch.autograd.grad(output, stage_input, grad_output, retain_graph=True)[0]",  # the old hint
        "call torch.autograd.grad(output,stage_input,grad_output, retain_graph=True)",  # respaced
    ],
)
def test_the_rule_catches_the_old_split_backward_hint(hint):
    found = leaks(_cell(OLD_SPLIT_BACKWARD.format(hint=hint)))
    assert found and all(ex == "07.split_backward" for ex, _ in found)


def test_the_rule_allows_naming_a_function():
    hint = "ask torch.autograd.grad for the input's gradient only, and keep the graph for W"
    assert leaks(_cell(OLD_SPLIT_BACKWARD.format(hint=hint))) == []


def test_the_rule_reads_idea_cells_too():
    nb = _cell(OLD_SPLIT_BACKWARD.format(hint="a nudge"))
    nb.cells.append(
        nbformat.v4.new_markdown_cell(
            f"<details>{IDEA_MARK}</summary>\n\n`torch.autograd.grad(output, stage_input, grad_output, retain_graph=True)`"
            "\n\n</details>"
        )
    )
    assert leaks(nb)


def test_the_rule_catches_a_long_solution_line():
    source = (
        "def f(x):\n    # BEGIN SOLUTION hint: x\n    total = some_tensor + other_tensor * 2\n"
        '    return total\n    # END SOLUTION\ncheck("00.f", f)\n'
    )
    assert leaks(_cell(source.replace("hint: x", "hint: total = some_tensor + other_tensor * 2")))
    assert not leaks(_cell(source.replace("hint: x", "hint: add the two tensors")))


# ---- the course's notebooks ---------------------------------------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_hint_gives_the_solution(path):
    assert leaks(nbformat.read(path, as_version=4)) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_exercise_has_two_tiers(path):
    hints, _ = hints_and_secrets(nbformat.read(path, as_version=4))
    for ex, texts in hints.items():
        *region_nudges, idea = texts
        assert region_nudges and all(region_nudges), f"{ex}: a region without a nudge"
        assert IDEA_MARK in idea, f"{ex}: no idea cell under its check cell"
        assert sum(IDEA_MARK in t for t in texts) == 1, f"{ex}: more than one idea cell"


def test_every_registered_exercise_has_its_hints():
    graded = set()
    for path in NOTEBOOKS:
        graded |= set(hints_and_secrets(nbformat.read(path, as_version=4))[0])
    assert graded == registered_exercises()


def _anchors(chapter: str) -> set:
    """JupyterLab's heading anchors: the heading's text, spaces as '-'."""
    text = (ROOT / "chapters" / f"{chapter}.py").read_text()
    return {h.replace("`", "").strip().replace(" ", "-") for h in re.findall(r"^# #+ (.+)$", text, re.M)}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_exercises_link_back_to_their_chapter(path):
    chapter = path.name.replace("_exercises.ipynb", "")
    nb = nbformat.read(path, as_version=4)
    assert f"(../chapters/{chapter}.ipynb)" in nb.cells[0].source
    ideas = [c.source for c in nb.cells if IDEA_MARK in c.source]
    assert ideas
    for idea in ideas:
        links = LINK_RE.findall(idea)
        assert links, f"no chapter link in {idea[:80]!r}"
        for linked, anchor in links:
            assert linked == chapter
            assert anchor in _anchors(chapter), f"{chapter}.ipynb has no heading #{anchor}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_chapters_end_with_your_turn(path):
    chapter = path.name.replace("_exercises.ipynb", "")
    text = (ROOT / "chapters" / f"{chapter}.py").read_text()
    assert "# ## Your turn" in text
    turn = text.split("# ## Your turn", 1)[1]
    assert "# ## " not in turn, "Your turn is the last section"
    assert f"[exercises/{path.name}](../exercises/{path.name})" in turn
    assert f"make grade NB=work/exercises/{path.name}" in turn


READING_ORDER = [
    "00",
    "a0",
    "01",
    "02",
    "03",
    "04",
    "05",
    "06",
    "07",
    "08",
    "09",
    "10",
    "11",
    "12",
    "a1",
    "a2",
    "a3",
    "a4",
]


def test_the_course_map_links_every_chapter_in_reading_order():
    text = (ROOT / "chapters" / "00_orientation.py").read_text()
    course_map = text.split("# ## 6. The map of the course", 1)[1].split("\n# ## ", 1)[0]
    linked = re.findall(r"\]\(([a-z0-9_]+)\.ipynb\)", course_map)
    assert [stem.split("_")[0] for stem in linked] == READING_ORDER
    assert sorted(linked) == sorted(p.stem for p in (ROOT / "chapters").glob("*.py"))


def signatures(nb) -> set:
    """``name(arg, ...)`` of every function the notebook defines: the task may state what to write."""
    found = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(_python(cell.source))
        except SyntaxError:
            continue
        found |= {
            squash(f"{f.name}({', '.join(a.arg for a in f.args.args)})")
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef)
        }
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_instruction_spells_out_the_solution(path):
    """The task's own text (every markdown cell but the ideas) may name the functions to use and
    show a short call, but not write the solution's lines: the 19 instruction cells of issue 41
    that did (e.g. 10's whole breakdown(...) call, 07's two torch.autograd.grad calls) no longer do."""
    nb = nbformat.read(path, as_version=4)
    _, secrets = hints_and_secrets(nb)
    long = {s for s in secrets if len(s) >= MIN_INSTRUCTION_CHARS} - signatures(nb)
    found = [
        (i, s)
        for i, c in enumerate(nb.cells)
        if c.cell_type == "markdown" and IDEA_MARK not in c.source
        for s in sorted(long)
        if s in squash(c.source)
    ]
    assert found == [], f"instruction cells holding solution code: {found}"


# ---- failure messages --------------------------------------------------------------------------

EXERCISE_TESTS = ROOT / "lib" / "ultrascale_grading" / "exercise_tests"


def messages(source: str) -> list:
    """(line, text) of every string a test module can put in a message: its string constants and
    f-strings (as written, with their {fields}), docstrings left out (they document the test)."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    inside_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            found.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and id(node) not in inside_fstrings
        ):
            found.append((node.lineno, node.value))
    return found


def instructions(nb) -> str:
    """The exercise's own text (every markdown cell but the ideas), squashed: what it already shows."""
    return "".join(squash(c.source) for c in nb.cells if c.cell_type == "markdown" and IDEA_MARK not in c.source)


def message_leaks(nb, module_source: str) -> list:
    """(line, the solution's code) for every message of the test module that writes code of the
    notebook's solution regions that the exercise's text does not show already."""
    _, secrets = hints_and_secrets(nb)
    shown = instructions(nb)
    return [
        (line, secret)
        for line, text in messages(module_source)
        for secret in sorted(secrets)
        if secret in squash(text) and secret not in shown
    ]


def _test_modules(path: Path) -> list:
    """The test modules of a notebook's chapter: ``chNN.py`` and its parts ``chNN_*.py``."""
    prefix = path.name.split("_")[0]
    return [EXERCISE_TESTS / f"ch{prefix}.py", *sorted(EXERCISE_TESTS.glob(f"ch{prefix}_*.py"))]


def test_the_message_rule_catches_a_message_that_writes_the_call():
    nb = _cell(OLD_SPLIT_BACKWARD.format(hint="a nudge"))
    leaking = (
        'def test(fn):\n    """Docstrings may say torch.autograd.grad(output, stage_input, grad_output, '
        'retain_graph=True)."""\n    raise AssertionError(f"B of micro-batch {i}: use '
        'torch.autograd.grad(output, stage_input, grad_output, retain_graph=True)")\n'
    )
    assert [line for line, _ in message_leaks(nb, leaking)] == [3]
    pointing = leaking.replace(
        "use torch.autograd.grad(output, stage_input, grad_output, retain_graph=True)",
        "ask torch.autograd.grad for the input's gradient only",
    )
    assert message_leaks(nb, pointing) == []
    # what the exercise's own text shows already, a message may repeat
    nb.cells.insert(
        0,
        nbformat.v4.new_markdown_cell(
            "Call `torch.autograd.grad(output, stage_input, grad_output, retain_graph=True)`."
        ),
    )
    assert message_leaks(nb, leaking) == []


SHARED_TEST_MODULES = sorted(EXERCISE_TESTS.glob("_*.py"))  # helpers whose messages every chapter's tests give


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_failure_message_writes_the_solution(path):
    nb = nbformat.read(path, as_version=4)
    modules = _test_modules(path)
    assert modules[0].is_file(), modules[0]
    for source in (*modules, *SHARED_TEST_MODULES):
        found = message_leaks(nb, source.read_text())
        assert found == [], f"messages of {source.name} that write the solution's code (line, code): {found}"


def _zigzag_feedback(zigzag_positions) -> str:
    """Chapter 06's zig-zag test's message for a wrong ``zigzag_positions`` (the library's counts)."""
    from ultrascale_grading.exercise_tests import ch06
    from ultrascale.parallel.context_parallel import causal_tile_counts

    def tile_counts(positions, tile):  # right, so that only the positions can fail
        return int((positions.view(-1, tile)[:, -1] // tile + 1).sum())

    assert causal_tile_counts  # the counts the test compares with come from the library
    with pytest.raises(AssertionError) as failed:
        ch06.test_zigzag_chunks(zigzag_positions, tile_counts)
    return str(failed.value)


@pytest.mark.parametrize("mistake", ["contiguous", "wrong mirror", "scattered"])
def test_the_zigzag_feedback_names_the_idea_not_the_chunks(mistake):
    """The feedback on a wrong layout says what is wrong with the chunks it got, and which idea
    places them, but neither the chunks nor the positions the rank should hold."""
    import torch

    from ultrascale import data

    def wrong(seq, rank, cp):
        if seq % (2 * cp):
            raise ValueError("does not cut")
        size = seq // (2 * cp)
        chunks = {
            "contiguous": [2 * rank, 2 * rank + 1],
            "wrong mirror": [rank, 2 * cp - 2 - rank if rank < cp - 1 else 2 * cp - 1],
            "scattered": [rank],
        }[mistake]
        positions = torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])
        return positions if mistake != "scattered" else torch.arange(rank, seq, cp)

    message = _zigzag_feedback(wrong)
    seq, rank, cp = (int(n) for n in re.search(r"zigzag_positions\((\d+), (\d+), (\d+)\)", message).groups())
    right = data.sequence_positions(seq, rank, cp, "zigzag")
    assert wrong(seq, rank, cp).tolist() != right.tolist()  # the case that failed is a wrong one
    assert str(right.tolist()) not in message, message
    assert not re.search(rf"chunks? {rank}\b[^.]*\b{2 * cp - 1 - rank}\b", message), message
    assert "mirror" in message or "early" in message, message  # the idea, named
