"""Build the course's website from the saved notebooks, without executing any (`make site`).

    python site_src/build.py                 # into site/: site/html/index.html
    python site_src/build.py --out /tmp/web  # elsewhere

Sphinx with MyST-NB renders the notebooks' saved outputs. Its source folder, OUT/src, is
assembled here from the repository, which is never written to:

* index.md: site_src/index.md followed by the table of contents. The chapters come in the
  course's reading order, read from the course map in chapters/00_orientation.ipynb (00, a0,
  01 ... 12, a1, a2, a3); a chapter notebook missing from that map stops the build;
* chapters/*.ipynb: copies, each with one markdown cell added under its title that links to
  its exercise notebook and to the README's grading command;
* exercises/*.ipynb, results/README.md, results' JSON and log files, README.md: copies;
* results/records.md: a table of the GPU records in results/*.json and their provenance.

Files are rewritten only when their content changes, so a second build reads only what
changed. The build runs with -W --keep-going: a broken internal link, a missing image or a
document outside the table of contents fails it, after every warning is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "site_src"
MAP_ROW = re.compile(r"^\|\s*\[(?P<label>[0-9a-z]+)\]\((?P<file>[0-9a-z_]+\.ipynb)\)\s*\|", re.M)


def reading_order(chapters: Path = ROOT / "chapters") -> list[str]:
    """Chapter stems in the course's order, from the map in chapter 00 (its table of links)."""
    orientation = json.loads((chapters / "00_orientation.ipynb").read_text())
    text = "\n".join("".join(cell["source"]) for cell in orientation["cells"] if cell["cell_type"] == "markdown")
    order = [Path(m["file"]).stem for m in MAP_ROW.finditer(text)]
    present = sorted(p.stem for p in chapters.glob("*.ipynb"))
    missing = [stem for stem in present if stem not in order]
    unknown = [stem for stem in order if stem not in present]
    if missing or unknown or len(set(order)) != len(order):
        raise SystemExit(f"chapter 00's course map and chapters/ disagree: not in the map {missing}, "
                         f"no notebook for {unknown}, map {order}")
    return order


def title(notebook: dict) -> str:
    """The notebook's first markdown heading."""
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    raise SystemExit("a notebook without a heading has no title")


def exercise_of(stem: str) -> Path:
    return ROOT / "exercises" / f"{stem}_exercises.ipynb"


def chapter_page(stem: str) -> str:
    """chapters/STEM.ipynb with a cell under its title linking to its exercises and grading."""
    notebook = json.loads((ROOT / "chapters" / f"{stem}.ipynb").read_text())
    exercise = exercise_of(stem)
    if exercise.exists():
        command = f"make grade NB=work/exercises/{exercise.name}"
        text = (f"```{{admonition}} Exercises\n:class: tip\n"
                f"**[This chapter's exercises](../exercises/{exercise.name})**, with a hint in each: fill them "
                f"in your copy, `work/exercises/{exercise.name}`, in JupyterLab (`make lab`), where each "
                f"`check(...)` cell grades its exercise on the spot. Grade the notebook with `{command}` "
                f"(`make grade` grades all of `work/exercises/`; [how grading works](../README.md#Exercises)).\n```")
    else:
        text = "```{admonition} Exercises\n:class: tip\nThis chapter has no exercise notebook yet.\n```"
    cell = {"cell_type": "markdown", "id": "site-exercises", "metadata": {}, "source": text}
    notebook["cells"].insert(1, cell)
    return json.dumps(notebook, indent=1, ensure_ascii=False)


def records_page() -> str:
    """results/records.md: every GPU record with its provenance, and a link to its file."""
    rows = []
    for path in sorted((ROOT / "results").glob("*.json")):
        record = json.loads(path.read_text())
        date = str(record.get("date", ""))[:19].replace("T", " ")
        commit = str(record.get("commit", ""))[:12]
        rows.append(f"| [{path.name}]({path.name}) | {record.get('device', '')} | {record.get('torch', '')} "
                    f"| {record.get('triton', '')} | {record.get('cuda', '')} | {record.get('python', '')} "
                    f"| `{commit}` | {date} |")
    logs = [f"- [{p.name}]({p.name})" for p in sorted((ROOT / "results").glob("*.log"))]
    return "\n".join([
        "# The records and their provenance",
        "",
        "Generated from `results/*.json` when the site is built: which GPU each record was measured",
        "on, with which versions, at which commit and when (UTC). [What the fields mean](README.md)",
        "says how they are made; the files themselves hold the measurements.",
        "",
        "| record | device | torch | triton | CUDA | Python | commit | date |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *(["The logs of the runs that made them:", "", *logs, ""] if logs else []),
    ])


def index_page(order: list[str]) -> str:
    intro = (CONF / "index.md").read_text().rstrip()
    chapters = "\n".join(f"chapters/{stem}" for stem in order)
    exercises = "\n".join(f"exercises/{exercise_of(stem).stem}" for stem in order if exercise_of(stem).exists())
    return (f"{intro}\n\n"
            f"```{{toctree}}\n:caption: Chapters\n:maxdepth: 1\n\n{chapters}\n```\n\n"
            f"```{{toctree}}\n:caption: Exercises\n:maxdepth: 1\n\n{exercises}\n```\n\n"
            f"```{{toctree}}\n:caption: Reference\n:maxdepth: 1\n\n"
            f"results/README\nresults/records\nThe course's README <README>\n```\n")


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or not path.exists() or path.read_text() != text:
        path.unlink(missing_ok=True)
        path.write_text(text)


def copy(path: Path, source: Path) -> None:
    """A copy (Sphinx names a symlinked document by the file it points to, outside src)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = source.read_bytes()
    if path.is_symlink() or not path.exists() or path.read_bytes() != data:
        path.unlink(missing_ok=True)
        path.write_bytes(data)


def assemble(src: Path) -> list[str]:
    """Fill src with the site's sources; remove what an earlier build left and this one does not."""
    order = reading_order()
    wanted: set[Path] = set()

    def keep(path: Path) -> Path:
        wanted.add(path)
        return path

    write(keep(src / "index.md"), index_page(order))
    for stem in order:
        write(keep(src / "chapters" / f"{stem}.ipynb"), chapter_page(stem))
    for notebook in sorted((ROOT / "exercises").glob("*_exercises.ipynb")):
        copy(keep(src / "exercises" / notebook.name), notebook)
    for path in sorted((ROOT / "results").iterdir()):
        if path.suffix in (".md", ".json", ".log"):
            copy(keep(src / "results" / path.name), path)
    write(keep(src / "results" / "records.md"), records_page())
    copy(keep(src / "README.md"), ROOT / "README.md")
    for path in sorted(src.rglob("*"), reverse=True):
        if path.is_symlink() or path.is_file():
            if path not in wanted:
                path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return order


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "site", help="build folder (default: site/)")
    parser.add_argument("--jobs", default="auto", help="Sphinx's -j (default: auto)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    start = time.monotonic()
    assemble(out / "src")
    from sphinx.cmd.build import build_main

    status = build_main(["-b", "html", "-c", str(CONF), "-d", str(out / "doctrees"), "-j", str(args.jobs),
                         "-W", "--keep-going", "-q", str(out / "src"), str(out / "html")])
    if status == 0:
        print(f"site built in {time.monotonic() - start:.0f} s: {out / 'html' / 'index.html'}\n"
              f"serve it with: python -m http.server -d {os.path.relpath(out / 'html')}")
    return status


if __name__ == "__main__":
    sys.exit(main())
