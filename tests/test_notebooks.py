"""Every chapter runs headless through its `parameters` cell at a WORLD_SIZE other than
the one its committed outputs were made with (nbval re-runs it at the default).

A chapter must be right for any sensible world size, so this is where an assumption
like "the world size divides 4" gets caught. Which other size, and which chapters:

* 3 ranks for a chapter whose default is 2 or 4: odd, so it divides neither (uneven
  shards, ZeRO's padding, a TP degree below the world size), and on 2 cores cheaper
  than a chapter's usual 4. A chapter whose default is already 3 runs at 2 instead:
  the smallest group, where a ring's previous and next rank are the same rank.
* A chapter whose code never reads WORLD_SIZE (outside its parameters cell and its
  asserts) gets no second run: it starts no ranks, so the run would repeat nbval's to
  the bit. Which chapters those are is read from the notebooks (``reads_world_size``),
  so a chapter that starts using WORLD_SIZE gets its run back by itself.

Set ULTRASCALE_NB_WORLD_SIZES=2,3,5 to run every chapter at each of those sizes instead.
"""

import ast
import os
import pathlib

import nbformat
import papermill
import pytest
from IPython.core.inputtransformer2 import TransformerManager

CHAPTERS = pathlib.Path(__file__).resolve().parent.parent / "chapters"
NOTEBOOKS = sorted(p.name for p in CHAPTERS.glob("*.ipynb"))


def _code_cells(notebook: str):
    """(is the parameters cell, the cell's code as Python: magics turned into calls)."""
    to_python = TransformerManager().transform_cell
    for cell in nbformat.read(CHAPTERS / notebook, as_version=4).cells:
        if cell.cell_type == "code":
            yield "parameters" in cell.metadata.get("tags", []), ast.parse(to_python(cell.source))


def default_world_size(notebook: str):
    for is_parameters, tree in _code_cells(notebook):
        for node in tree.body if is_parameters else ():
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "WORLD_SIZE" for t in node.targets):
                return ast.literal_eval(node.value)
    return None


def reads_world_size(notebook: str) -> bool:
    """Does any code cell but the parameters cell read WORLD_SIZE, outside an assert?"""
    for is_parameters, tree in _code_cells(notebook):
        if is_parameters:
            continue
        in_asserts = {id(n) for a in ast.walk(tree) if isinstance(a, ast.Assert) for n in ast.walk(a)}
        if any(isinstance(n, ast.Name) and n.id == "WORLD_SIZE" and id(n) not in in_asserts for n in ast.walk(tree)):
            return True
    return False


def _runs():
    override = os.environ.get("ULTRASCALE_NB_WORLD_SIZES")
    for notebook in NOTEBOOKS:
        if override:
            yield from ((notebook, int(w)) for w in override.split(","))
        elif reads_world_size(notebook):
            yield notebook, 2 if default_world_size(notebook) == 3 else 3


@pytest.mark.parametrize("notebook, world_size", list(_runs()))
def test_chapter_runs_with_papermill(notebook, world_size, tmp_path):
    papermill.execute_notebook(
        str(CHAPTERS / notebook), str(tmp_path / notebook),
        parameters={"WORLD_SIZE": world_size, "QUICK": True, "SEED": 0},
        cwd=str(CHAPTERS), kernel_name="python3", progress_bar=False,
    )


def test_every_chapter_source_has_its_notebook():
    sources = {p.stem for p in CHAPTERS.glob("*.py")}
    notebooks = {p.stem for p in CHAPTERS.glob("*.ipynb")}
    assert sources == notebooks, "run `make notebooks` after adding or removing a chapter source"


def test_the_chapters_left_out_start_no_ranks():
    """The static reading above, on what it must find: every chapter has a default, and those
    it leaves out start no cluster."""
    for notebook in NOTEBOOKS:
        assert isinstance(default_world_size(notebook), int), f"{notebook}: no WORLD_SIZE in its parameters cell"
        if not reads_world_size(notebook):
            code = "\n".join(ast.unparse(tree) for _, tree in _code_cells(notebook))
            assert "Cluster(" not in code and "shared_cluster(" not in code, notebook
