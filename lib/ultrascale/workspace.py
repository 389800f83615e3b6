"""The learner's own copies of the notebooks, in ``work/`` (git-ignored), so that working in the
lab never changes a file of the course and ``git pull`` never meets a conflict.

    python -m ultrascale.workspace [--root COURSE] [--quiet]

``work/chapters/*.ipynb`` are copies of ``chapters/*.ipynb`` and ``work/exercises/*.ipynb`` of
``exercises/*.ipynb`` (the generated exercises). The links ``work/results``, ``work/lib`` and
``work/benchmarks`` point at the course's folders, so the notebooks' relative paths
(``../results``, ``../exercises/...``, ``../chapters/...``, chapter 11's ``ROOT / "lib"``) mean
from a copy what they mean from the course.

Each run (``launch/lab.sh`` before the lab starts, ``make exercises``, ``make grade``):

* a copy that is missing is made;
* a copy you have not edited (its cells' types and sources are still those it was copied with,
  ``work/.copies.json`` records their hash) is refreshed when the course's notebook changed,
  e.g. after a ``git pull``; running it (outputs) is not an edit, so its outputs go with it;
* a copy you have edited is never touched: when the course's notebook changed since, this
  says so and names the course's new version, to compare and copy from by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat

COURSE = Path(__file__).resolve().parents[2]
WORK = "work"
COPIED = ("chapters", "exercises")  # copied notebook by notebook
LINKED = ("results", "lib", "benchmarks")  # linked: the notebooks only read them
MANIFEST = ".copies.json"

MADE, REFRESHED, UNCHANGED, KEPT, KEPT_NEWER = (
    "made",
    "refreshed",
    "unchanged",
    "kept (edited by you)",
    "kept (edited by you; the course's version changed)",
)


def sources(root: Path) -> list:
    """The course's notebooks that get a copy, as paths relative to ``root``."""
    found = []
    for folder in COPIED:
        found += sorted(
            p.relative_to(root) for p in (root / folder).glob("*.ipynb") if not p.name.endswith(".updated.ipynb")
        )
    return found


def content_hash(nb) -> str:
    """Hash of what a learner can change: each cell's type and source (a notebook or its path).

    Running a notebook (outputs) is no edit. The exercise generator (``make exercises``) records the
    same hash of each notebook it writes."""
    if isinstance(nb, (str, os.PathLike)):
        nb = nbformat.read(nb, as_version=4)
    canonical = [[c.cell_type, c.source] for c in nb.cells]
    return hashlib.sha256(json.dumps(canonical).encode()).hexdigest()


def _hash(path: Path):
    try:
        return content_hash(path)
    except Exception:  # noqa: BLE001 - unreadable: treat as the learner's own, never overwrite it
        return "unreadable"


def _copy_atomic(source: Path, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    shutil.copyfile(source, tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, target)


def refresh(root: Path = COURSE, log=print) -> dict:
    """Make or refresh the copies under ``root/work``; returns {relative path: what happened}."""
    root = Path(root).resolve()
    work = root / WORK
    work.mkdir(exist_ok=True)
    for name in LINKED:
        link = work / name
        if (root / name).exists() and not link.exists() and not link.is_symlink():
            link.symlink_to(Path("..") / name)
    manifest_path = work / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text()).get("copies", {})
    except (OSError, ValueError, AttributeError):
        manifest = {}
    outcome = {}
    for relative in sources(root):
        key = relative.as_posix()
        source, target = root / relative, work / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        new = _hash(source)
        recorded = manifest.get(key, {}).get("sha256")
        on_disk = _hash(target) if target.exists() else None
        if on_disk is None or (on_disk == recorded and on_disk != new):
            _copy_atomic(source, target)
            outcome[key] = MADE if on_disk is None else REFRESHED
            manifest[key] = {"sha256": new}
        elif on_disk == new:
            outcome[key] = UNCHANGED
            manifest[key] = {"sha256": new}
        elif recorded == new:
            outcome[key] = KEPT  # edited; the course has nothing newer
        else:
            outcome[key] = KEPT_NEWER
            log(
                f"{WORK}/{key} has your changes, so it was left as it is; the course's new version is {key}: "
                f"compare them and copy what you need across (or delete {WORK}/{key} to get a fresh copy)."
            )
    text = json.dumps({"written_by": "ultrascale.workspace", "copies": manifest}, indent=1, sort_keys=True) + "\n"
    fd, tmp = tempfile.mkstemp(dir=work, prefix=f".{MANIFEST}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, manifest_path)
    return outcome


def summary(outcome: dict) -> str:
    counts = {}
    for what in outcome.values():
        counts[what] = counts.get(what, 0) + 1
    order = (MADE, REFRESHED, UNCHANGED, KEPT, KEPT_NEWER)
    return f"your copies in {WORK}/: " + ", ".join(f"{counts[w]} {w}" for w in order if w in counts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="ultrascale-workspace", description="Make or refresh your own copies of the notebooks in work/."
    )
    parser.add_argument("--root", type=Path, default=COURSE, help="the course's folder (default: this library's)")
    parser.add_argument("--quiet", action="store_true", help="only the lines about copies you edited")
    args = parser.parse_args(argv)
    outcome = refresh(args.root)
    if not args.quiet:
        for key, what in outcome.items():
            if what in (MADE, REFRESHED):
                print(f"{what:>10}: {WORK}/{key}")
    print(summary(outcome))
    return 0


if __name__ == "__main__":
    sys.exit(main())
