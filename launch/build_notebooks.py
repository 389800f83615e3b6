"""Build the chapter notebooks from their sources and execute them.

Each chapter is written as a jupytext "percent" script, chapters/NAME.py (easy to
review in a diff); this turns it into chapters/NAME.ipynb, executes it with
papermill at its default parameters and saves the outputs, which are the
reference `pytest --nbval` compares later runs against.

    python launch/build_notebooks.py                 # every chapter
    python launch/build_notebooks.py 00_orientation  # one chapter
"""

import argparse
import pathlib
import sys
import time

import jupytext
import nbformat
import papermill
from ultrascale.headless import kernel_options

CHAPTERS = pathlib.Path(__file__).resolve().parent.parent / "chapters"


def build(source: pathlib.Path) -> pathlib.Path:
    target = source.with_suffix(".ipynb")
    notebook = jupytext.read(source)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.metadata.pop("jupytext", None)
    nbformat.write(notebook, target)
    papermill.execute_notebook(
        str(target), str(target), cwd=str(CHAPTERS), kernel_name="python3", progress_bar=False, **kernel_options()
    )
    clean(target)
    return target


def clean(path: pathlib.Path) -> None:
    """Drop run-specific metadata (durations, timestamps) so diffs show real changes."""
    notebook = nbformat.read(path, as_version=4)
    notebook.metadata.pop("papermill", None)
    for cell in notebook.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
    nbformat.write(notebook, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="chapter names (default: all)")
    args = parser.parse_args(argv)
    sources = sorted(CHAPTERS.glob("*.py"))
    if args.names:
        sources = [s for s in sources if s.stem in args.names]
        if not sources:
            parser.error(f"no chapter source matches {args.names}")
    for source in sources:
        start = time.monotonic()
        print(f"building {source.name} ...", flush=True)
        build(source)
        print(f"  done in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
