"""Generate exercises/ from solutions/: solution regions become stubs.

In a code cell of a solution notebook, the lines between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` are the learner's part::

    def mean_across_ranks(ctx, tensor):
        # BEGIN SOLUTION hint: all_reduce, then divide
        dist.all_reduce(tensor)
        return tensor / ctx.world_size
        # END SOLUTION

The exercise notebook gets, at the marker's indentation::

    def mean_across_ranks(ctx, tensor):
        raise NotImplementedError("exercise: all_reduce, then divide")

Safety rules, each of which makes the command refuse to write anything:

* unbalanced or nested markers, or markers outside code cells;
* a generated cell that is no longer valid Python;
* any non-trivial solution line still present in the output (leak check);
* cells tagged ``solution-only`` are dropped, and a leak check backs that up.

A learner's work is never overwritten: exercises/.generated.json records a hash
of each notebook as generated. If the file on disk no longer matches it, the
learner has edited it, so the new version goes to ``<name>.updated.ipynb`` instead,
once per new version of the solution (the manifest records which version it holds),
and never over an ``.updated.ipynb`` the learner has edited in turn.
The hash covers cell types and sources only, so running a notebook (which adds
outputs) does not count as an edit, while changing any code does.

Usage: ``python -m ultrascale_grading.generate [--check] [--solutions DIR] [--exercises DIR]``
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from ultrascale.workspace import content_hash

BEGIN_RE = re.compile(r"^(?P<indent>[ \t]*)#\s*BEGIN SOLUTION\b(?:\s*hint:\s*(?P<hint>.*?))?\s*$")
END_RE = re.compile(r"^[ \t]*#\s*END SOLUTION\b")
MARKER_WORDS = ("BEGIN SOLUTION", "END SOLUTION")
SOLUTION_ONLY_TAG = "solution-only"
MANIFEST_NAME = ".generated.json"
DEFAULT_HINT = "write your code here"
# Solution lines shorter than this (ignoring spaces) are too generic to count as a
# leak: ``return out`` or ``else:`` may well appear elsewhere in a notebook.
MIN_LEAK_CHARS = 12
# Notebook-level metadata worth keeping; the rest (papermill runs, widget state)
# is noise in a learner's copy.
KEEP_NOTEBOOK_METADATA = ("kernelspec", "language_info")

REPO_ROOT = Path(__file__).resolve().parents[2]


class GenerateError(Exception):
    """The solution notebook cannot be turned into an exercise safely."""


# ---- one cell -----------------------------------------------------------------------


@dataclass
class Stubbed:
    source: str
    solution_lines: list = field(default_factory=list)


def stub_source(source: str, where: str = "cell") -> Stubbed:
    """Replace every solution region of one code cell's source by a stub."""
    out, solution, region_start, region_indent, region_hint = [], [], None, "", None
    for number, line in enumerate(source.splitlines(), start=1):
        begin, end = BEGIN_RE.match(line), END_RE.match(line)
        if begin:
            if region_start is not None:
                raise GenerateError(
                    f"{where}, line {number}: BEGIN SOLUTION inside the region opened on line {region_start}"
                )
            region_start, region_indent = number, begin.group("indent")
            region_hint = (begin.group("hint") or "").strip() or DEFAULT_HINT
        elif end:
            if region_start is None:
                raise GenerateError(f"{where}, line {number}: END SOLUTION without a BEGIN SOLUTION")
            # json.dumps writes a valid Python string literal, in double quotes.
            message = json.dumps(f"exercise: {region_hint}", ensure_ascii=False)
            out.append(f"{region_indent}raise NotImplementedError({message})")
            region_start = None
        elif region_start is not None:
            solution.append(line)
        elif any(word in line for word in MARKER_WORDS):
            raise GenerateError(f"{where}, line {number}: malformed solution marker: {line.strip()!r}")
        else:
            out.append(line)
    if region_start is not None:
        raise GenerateError(f"{where}: BEGIN SOLUTION on line {region_start} has no END SOLUTION")
    return Stubbed("\n".join(out), solution)


def _check_python(source: str, where: str) -> None:
    """A stub must leave valid Python behind (e.g. a region was not the whole body)."""
    if source.lstrip().startswith("%%"):
        return  # a cell magic: not Python
    # Line magics and shell escapes are IPython, not Python: blank them out.
    python = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    try:
        ast.parse(python)
    except SyntaxError as err:
        raise GenerateError(f"{where}: the generated code is not valid Python ({err.msg}, line {err.lineno})") from None


# ---- one notebook -------------------------------------------------------------------


def make_exercise(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The exercise version of a solution notebook (in memory; refuses to leak)."""
    nb = copy.deepcopy(solution)
    cells, solution_lines = [], []
    for index, cell in enumerate(nb.cells):
        where = f"{name}, cell {index}"
        tags = cell.get("metadata", {}).get("tags", [])
        if SOLUTION_ONLY_TAG in tags:
            solution_lines += cell.source.splitlines()
            continue
        if cell.cell_type == "code":
            stubbed = stub_source(cell.source, where)
            if stubbed.solution_lines:
                _check_python(stubbed.source, where)
            cell.source = stubbed.source
            solution_lines += stubbed.solution_lines
            cell.outputs = []
            cell.execution_count = None
        elif any(word in cell.source for word in MARKER_WORDS):
            raise GenerateError(f"{where}: solution markers are only allowed in code cells")
        for key in ("execution", "papermill", "collapsed", "scrolled"):
            cell.metadata.pop(key, None)
        cells.append(cell)
    nb.cells = cells
    nb.metadata = {k: v for k, v in nb.metadata.items() if k in KEEP_NOTEBOOK_METADATA}
    _leak_check(nb, solution_lines, name)
    return nb


def _leak_check(nb, solution_lines: list, name: str) -> None:
    secret = {s.strip() for s in solution_lines if _non_trivial(s)}
    if not secret:
        return
    for index, cell in enumerate(nb.cells):
        for line in cell.source.splitlines():
            if line.strip() in secret:
                raise GenerateError(
                    f"{name}, cell {index}: refusing to write, a solution line would appear in the exercise: "
                    f"{line.strip()!r}. Put it inside the solution region, or reword the line outside it."
                )
            if any(word in line for word in MARKER_WORDS):
                raise GenerateError(f"{name}, cell {index}: a solution marker survived: {line.strip()!r}")


def _non_trivial(line: str) -> bool:
    text = line.strip()
    return bool(text) and not text.startswith("#") and len(text.replace(" ", "")) >= MIN_LEAK_CHARS


def notebook_text(nb) -> str:
    return nbformat.writes(nb, version=4)


# ---- the whole directory --------------------------------------------------------------


def solution_notebooks(solutions_dir: Path) -> list:
    return sorted(p for p in Path(solutions_dir).glob("*.ipynb") if not p.name.endswith(".updated.ipynb"))


def _load_manifest(exercises_dir: Path) -> dict:
    path = exercises_dir / MANIFEST_NAME
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get("notebooks", {})


def _write_atomic(path: Path, text: str) -> None:
    # Write beside the target and rename, so an interrupted run never leaves half a notebook.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; use the usual mode
    os.replace(tmp, path)


def build_all(solutions_dir: Path) -> dict:
    """Generate every exercise in memory first, so one bad notebook blocks all writes."""
    built = {}
    for src in solution_notebooks(solutions_dir):
        nb = nbformat.read(src, as_version=4)
        built[src.name] = make_exercise(nb, name=f"solutions/{src.name}")
    return built


def generate(solutions_dir: Path, exercises_dir: Path, log=print) -> dict:
    """Write exercises/; returns {name: what happened} ('written', 'unchanged', 'updated-copy')."""
    solutions_dir, exercises_dir = Path(solutions_dir), Path(exercises_dir)
    built = build_all(solutions_dir)
    exercises_dir.mkdir(parents=True, exist_ok=True)
    manifest = _load_manifest(exercises_dir)
    outcome = {}
    for name, nb in built.items():
        target = exercises_dir / name
        new_hash = content_hash(nb)
        recorded = manifest.get(name, {}).get("sha256")
        on_disk = content_hash(target) if target.exists() else None
        if on_disk == new_hash:
            outcome[name] = "unchanged"
        elif on_disk is None or on_disk == recorded:
            _write_atomic(target, notebook_text(nb))  # absent, or untouched since generated
            outcome[name] = "written"
        elif recorded == new_hash:
            # The learner changed it, and the solution did not change since: nothing new to offer.
            outcome[name] = "kept (edited by you)"
            continue
        else:
            entry = manifest.setdefault(name, {"source": f"solutions/{name}"})
            outcome[name] = _offer_update(target, nb, new_hash, entry, log)
            continue  # keep the old hash: the on-disk file still descends from it
        manifest[name] = {"sha256": new_hash, "source": f"solutions/{name}"}
    manifest = {k: v for k, v in manifest.items() if k in built}
    _write_atomic(
        exercises_dir / MANIFEST_NAME,
        json.dumps({"generated_by": "ultrascale-exercises", "notebooks": manifest}, indent=1, sort_keys=True) + "\n",
    )
    return outcome


def _offer_update(target: Path, nb, new_hash: str, entry: dict, log) -> str:
    """The learner changed ``target`` and the solution changed since it was generated: write
    the new version beside it, once per version, and never over a copy the learner edited."""
    updated = target.with_name(target.stem + ".updated.ipynb")
    on_disk = content_hash(updated) if updated.exists() else None
    written = entry.get("updated_sha256")  # the version last written there
    if new_hash in (on_disk, written):
        return "kept (updated copy already written)"  # deleted since, perhaps: as the message asked
    if on_disk is not None and on_disk != written:
        log(
            f"exercises/{updated.name} has your changes, so the newer version of the exercise was not "
            "written; move that file aside and run again to get it."
        )
        return "kept (updated copy edited by you)"
    _write_atomic(updated, notebook_text(nb))
    entry["updated_sha256"] = new_hash
    log(
        f"exercises/{target.name} has your changes, so it was left alone; the new version of the "
        f"exercise is in exercises/{updated.name}. Copy what you need across, then delete it."
    )
    return "updated-copy"


def check_in_sync(solutions_dir: Path, exercises_dir: Path) -> list:
    """Problems that make exercises/ differ from what solutions/ would generate (empty: in sync)."""
    solutions_dir, exercises_dir = Path(solutions_dir), Path(exercises_dir)
    built = build_all(solutions_dir)
    manifest = _load_manifest(exercises_dir)
    problems = []
    for name, nb in built.items():
        target = exercises_dir / name
        if not target.exists():
            problems.append(f"exercises/{name} is missing")
        elif content_hash(target) != content_hash(nb):
            problems.append(f"exercises/{name} differs from what solutions/{name} generates")
        elif manifest.get(name, {}).get("sha256") != content_hash(nb):
            problems.append(f"exercises/{MANIFEST_NAME} does not record the current exercises/{name}")
    for extra in sorted(exercises_dir.glob("*.ipynb")):
        if extra.name not in built and not extra.name.endswith(".updated.ipynb"):
            problems.append(f"exercises/{extra.name} has no solutions/{extra.name}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="ultrascale-exercises",
        description="Generate exercises/ from solutions/ (solution regions become stubs).",
    )
    parser.add_argument("--solutions", type=Path, default=REPO_ROOT / "solutions")
    parser.add_argument("--exercises", type=Path, default=REPO_ROOT / "exercises")
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when exercises/ is out of sync with solutions/ (for CI)",
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = check_in_sync(args.solutions, args.exercises)
            for p in problems:
                print(f"out of sync: {p}")
            if problems:
                print("run `ultrascale-exercises` (python -m ultrascale_grading.generate) and commit exercises/")
                return 1
            print(f"exercises/ is in sync with solutions/ (notebooks: {len(solution_notebooks(args.solutions))})")
            return 0
        for name, what in generate(args.solutions, args.exercises).items():
            print(f"{what:>22}: exercises/{name}")
        return 0
    except GenerateError as err:
        print(f"ultrascale-exercises: refusing to write: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
