"""Every chapter runs headless through its `parameters` cell at a WORLD_SIZE other than
the one its committed outputs were made with (nbval re-runs it at the default).

A chapter must be right for any sensible world size, so this is where an assumption
like "the world size divides 4" gets caught. Set ULTRASCALE_NB_WORLD_SIZES=2,3,5 to
try several.
"""

import os
import pathlib

import papermill
import pytest

CHAPTERS = pathlib.Path(__file__).resolve().parent.parent / "chapters"
WORLD_SIZES = [int(w) for w in os.environ.get("ULTRASCALE_NB_WORLD_SIZES", "3").split(",")]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("notebook", sorted(p.name for p in CHAPTERS.glob("*.ipynb")))
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
