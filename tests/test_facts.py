"""The facts several chapters state (``ultrascale.facts``) are stated once: the chapters that
need them print them from the module, their saved outputs show today's wording, no chapter's
prose says otherwise, and the planner's published layout agrees. Reads files only: a second."""

import json
import re
from pathlib import Path

import pytest

from ultrascale import facts
from ultrascale.plan import published

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"

# Which chapter prints which fact (it must read it from the module, and show it in its output).
PRINTED_BY = {
    "LLAMA3_405B": ("09_5d_parallelism", "10_best_configuration"),
    "TORCHTITAN_ORDER": ("09_5d_parallelism",),
    "OVERLAP_ON_GPUS": ("10_best_configuration", "a3_overlap_math"),
    "PP_WITH_ZERO": ("09_5d_parallelism", "10_best_configuration"),
}

# What contradicted the facts before they were written once (case-insensitive, over a chapter's
# source with the comment marks and line breaks folded into spaces).
CONTRADICTIONS = {
    "405B with ZeRO-3": r"405B[^.]{0,200}\bFSDP \(ZeRO-3\)",
    "PP goes with plain DP or ZeRO-1, said to be the book's": r"(book says|the book)[^.]{0,80}PP goes with plain DP or ZeRO-1",
    "torchtitan applies TP before the PP split": r"torchtitan[^#]{0,40}: 1\. \*\*TP",
    "overlap for free on a GPU": r"overlap[^.]{0,60}(?<!not )\b(is|comes|for) free\b",
}


def _prose(name: str) -> str:
    text = (CHAPTERS / f"{name}.py").read_text()
    return re.sub(r"\s+", " ", re.sub(r"^#+ ?", "", text, flags=re.M))


def _outputs(name: str) -> str:
    cells = json.loads((CHAPTERS / f"{name}.ipynb").read_text())["cells"]
    return "".join("".join(out.get("text", "")) for c in cells for out in c.get("outputs", []))


@pytest.mark.parametrize("fact,chapter", [(f, c) for f, chapters in PRINTED_BY.items() for c in chapters])
def test_chapter_prints_the_fact(fact, chapter):
    assert f"facts.{fact}" in (CHAPTERS / f"{chapter}.py").read_text(), f"{chapter} does not read facts.{fact}"
    statement = getattr(facts, fact).statement
    assert statement in re.sub(r"\s+", " ", _outputs(chapter)), (
        f"{chapter}.ipynb's saved output does not show today's facts.{fact}: rebuild it"
    )


@pytest.mark.parametrize("what,pattern", CONTRADICTIONS.items())
def test_no_chapter_contradicts(what, pattern):
    offenders = [p.stem for p in sorted(CHAPTERS.glob("*.py")) if re.search(pattern, _prose(p.stem), re.I)]
    assert not offenders, f"{what}: {offenders}"


def test_contradiction_patterns_can_fail():
    """Each pattern catches the sentence it was written for (else the test above passes vacuously)."""
    old = {
        "405B with ZeRO-3": "Llama 3 405B trained with TP 8, PP 16, and FSDP (ZeRO-3) over the replicas.",
        "PP goes with plain DP or ZeRO-1, said to be the book's": "adds two things the book says elsewhere: PP goes with plain DP or ZeRO-1, rarely with ZeRO-3",
        "torchtitan applies TP before the PP split": "in the order torchtitan uses: 1. **TP/SP** first",
        "overlap for free on a GPU": "so the overlap is free on a GPU.",
    }
    for what, pattern in CONTRADICTIONS.items():
        assert re.search(pattern, old[what], re.I), what


def test_planner_agrees_with_the_facts():
    for setup, layout in (
        (published.LLAMA3_405B_PRETRAIN, facts.LLAMA3_405B_LAYOUT),
        (published.LLAMA3_405B_LONG, facts.LLAMA3_405B_LONG_LAYOUT),
    ):
        assert setup.gpus == layout["gpus"] and setup.seq == layout["seq"]
        for axis in ("tp", "cp", "pp", "dp", "zero"):
            assert setup.layout[axis] == layout[axis], (setup.name, axis)
        assert layout["tp"] * layout["cp"] * layout["pp"] * layout["dp"] == layout["gpus"]
