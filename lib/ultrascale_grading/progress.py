"""Your progress: per chapter, the exercises you passed and their points, from the grader's records.

    python -m ultrascale_grading.progress [--records FILE]      (make progress)

The command-line grader (``python -m ultrascale_grading.cli``, ``make grade``) appends one line per
graded notebook of ``work/exercises/`` to ``work/.progress/grades.jsonl``: the notebook, the hash
of its cells as graded, the time, and each exercise's status and points as the grader scored
them in its own process. The in-notebook ``check(...)`` writes no record: its verdict is feedback.

What "cannot forge" means here. Each line is signed (HMAC-SHA256) with a key the grader makes on
its first record, ``work/.progress/key`` (readable by you only). ``progress`` counts only lines
whose signature holds, so a line typed by hand, edited afterwards (a status or points changed),
copied from another learner's file (another key) or written by a notebook's cells without the
key counts for nothing; the table says how many lines it ignored. It is not a lock against you:
the key is your file, so code run with your rights (yours, or a notebook's that reads the key)
can sign a line. It keeps the table honest about what the grader saw, not a secret from its owner.
For the same reason each record carries the hash of the notebook's cells when it was graded, and
the table marks a chapter whose notebook changed since ("edited since graded": grade it again).

Each exercise counts as its latest grading says: a pass graded again and failed is no longer
passed. The totals per chapter are the registry's (every registered exercise and its points),
so a chapter you never graded shows 0 of its exercises.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import sys
import time
from pathlib import Path

from .registry import chapter_of, declared_points

COURSE = Path(__file__).resolve().parents[2]
WORK = "work"
PROGRESS_DIR = ".progress"
RECORDS_NAME = "grades.jsonl"
KEY_NAME = "key"
NONE_YET = "no exercise graded yet: run make grade (it grades your notebooks in work/exercises/)"


def default_records(root: Path = COURSE) -> Path:
    return Path(root) / WORK / PROGRESS_DIR / RECORDS_NAME


def records_for(nb_path: Path):
    """Where the grader records ``nb_path`` by default: a notebook of a course's ``work/exercises/``
    (the learner's copies) goes to that course's ``work/.progress/grades.jsonl``; others to none."""
    folder = Path(nb_path).resolve().parent
    if folder.name == "exercises" and folder.parent.name == WORK:
        return folder.parent / PROGRESS_DIR / RECORDS_NAME
    return None


def _key(records: Path, create: bool):
    path = records.parent / KEY_NAME
    if not path.is_file() and create:
        records.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _signature(record: dict, key: bytes) -> str:
    body = json.dumps({k: v for k, v in record.items() if k != "signature"}, sort_keys=True)
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def _course_relative(nb_path: Path, records: Path) -> str:
    """The notebook as the record names it: relative to the course (``work/..``'s parent) if inside."""
    nb_path = Path(nb_path).resolve()
    try:
        return nb_path.relative_to(records.resolve().parent.parent.parent).as_posix()
    except ValueError:
        return str(nb_path)


def record(
    records: Path, nb_path: Path, notebook_hash, status: str, exercises: list, when: float | None = None
) -> dict:
    """Append one signed record of a graded notebook (called by the grader, in its own process)."""
    records = Path(records)
    key = _key(records, create=True)
    entry = {
        "notebook": _course_relative(nb_path, records),
        "chapter": Path(nb_path).name.split("_", 1)[0],
        "sha256": notebook_hash,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(when)),
        "status": status,
        "exercises": [{k: e[k] for k in ("exercise", "status", "points", "max_points")} for e in exercises],
    }
    entry["signature"] = _signature(entry, key)
    with open(records, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
    return entry


def read_records(records: Path) -> tuple:
    """(the records whose signature holds, in file order; how many lines were ignored)."""
    records = Path(records)
    if not records.is_file():
        return [], 0
    key = _key(records, create=False)
    valid, ignored = [], 0
    for line in records.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            ok = (
                key is not None
                and isinstance(entry, dict)
                and isinstance(entry.get("signature"), str)
                and hmac.compare_digest(entry["signature"], _signature(entry, key))
                and isinstance(entry.get("exercises"), list)
            )
        except (ValueError, TypeError):
            ok = False
        if ok:
            valid.append(entry)
        else:
            ignored += 1
    return valid, ignored


def _registered() -> dict:
    """{chapter: {exercise id: points}} for every exercise the course's tests declare (read from
    their source: ``make progress`` need not import torch)."""
    chapters = {}
    for exercise_id, points in sorted(declared_points().items()):
        chapters.setdefault(chapter_of(exercise_id), {})[exercise_id] = points
    return chapters


def _notebook_hash(path: Path):
    from ultrascale.workspace import content_hash

    try:
        return content_hash(path)
    except Exception:  # noqa: BLE001 - gone or unreadable
        return None


def progress(records: Path | None = None, root: Path | None = None) -> dict:
    """Per chapter: passed / total exercises, points / max, last graded time, from the signed records.

    Returns {"chapters": [row, ...], "ignored": lines not signed by the grader, "graded": records counted}.
    """
    records = Path(records) if records is not None else default_records(root or COURSE)
    course = records.resolve().parent.parent.parent
    entries, ignored = read_records(records)
    latest, last_time, last_entry = {}, {}, {}
    for entry in entries:  # file order is time order: later lines replace earlier ones
        for e in entry["exercises"]:
            if isinstance(e, dict) and isinstance(e.get("exercise"), str):
                latest[e["exercise"]] = e
        chapter = str(entry.get("chapter", ""))
        last_time[chapter] = str(entry.get("time", ""))
        last_entry[chapter] = entry
    rows = []
    for chapter, exercises in _registered().items():
        passed = [e for e in exercises if latest.get(e, {}).get("status") == "pass"]
        graded = chapter in last_entry
        edited = False
        if graded:
            notebook = Path(last_entry[chapter].get("notebook", ""))
            current = _notebook_hash(notebook if notebook.is_absolute() else course / notebook)
            edited = current is not None and current != last_entry[chapter].get("sha256")
        rows.append(
            {
                "chapter": chapter,
                "passed": len(passed),
                "total": len(exercises),
                "points": sum(exercises[e] for e in passed),
                "max_points": sum(exercises.values()),
                "last_graded": last_time.get(chapter, ""),
                "edited_since": edited,
                "exercises": {e: latest.get(e, {}).get("status", "not graded") for e in exercises},
            }
        )
    return {"chapters": rows, "ignored": ignored, "graded": len(entries)}


def format_progress(result: dict) -> str:
    """The table ``make progress`` prints (or the line saying nothing was graded yet)."""
    lines = []
    if not result["graded"]:
        lines.append(NONE_YET)
    else:
        table = [("chapter", "passed", "points", "last graded")]
        for row in result["chapters"]:
            when = row["last_graded"][:16].replace("T", " ") or "-"
            if row["edited_since"]:
                when += "  (edited since graded)"
            table.append(
                (row["chapter"], f"{row['passed']}/{row['total']}", f"{row['points']:g}/{row['max_points']:g}", when)
            )
        passed = sum(r["passed"] for r in result["chapters"])
        total = sum(r["total"] for r in result["chapters"])
        points = sum(r["points"] for r in result["chapters"])
        most = sum(r["max_points"] for r in result["chapters"])
        table.append(("ALL", f"{passed}/{total}", f"{points:g}/{most:g}", ""))
        widths = [max(len(row[i]) for row in table) for i in range(4)]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
    if result["ignored"]:
        lines.append(
            f"{result['ignored']} line(s) of the records were ignored: not signed by the grader "
            "(written by hand, changed since, or by a notebook)"
        )
    return "\n".join(lines)


def show(records: Path | None = None) -> None:
    """Print your progress (chapter 00's last cell)."""
    print(format_progress(progress(records)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="ultrascale-progress", description="Your graded exercises per chapter, from the grader's records."
    )
    parser.add_argument(
        "--records",
        type=Path,
        default=None,
        help=f"the grader's records (default: {WORK}/{PROGRESS_DIR}/{RECORDS_NAME} of the course)",
    )
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args(argv)
    # The course is the folder it is run in when that holds learner copies (a clone or a copy of
    # the course next to the installed library: the grader recorded there), else the library's.
    here = default_records(Path.cwd())
    result = progress(args.records if args.records is not None else here if here.parent.parent.is_dir() else None)
    print(json.dumps(result, indent=1) if args.json else format_progress(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
