"""viz.live.ProgressBar: the bar, and beside it the count and the time so far."""

import pytest

pytest.importorskip("ipywidgets")

from ultrascale.viz import live  # noqa: E402


def test_the_bar_shows_the_count_and_the_time(monkeypatch):
    clock = iter([100.0, 107.4, 112.0, 230.0])
    monkeypatch.setattr(live.time, "monotonic", lambda: next(clock))
    bar = live.ProgressBar("training", total=8)  # made at t = 100 s, first label at 107.4 s
    assert bar.label.value == "0/8, 7 s"
    bar.update(3)  # t = 112 s
    assert (bar.bar.value, bar.label.value) == (3, "3/8, 12 s")
    bar.update(8)  # t = 230 s
    assert bar.label.value == "8/8 in 2 min 10 s" and bar.bar.bar_style == "success"


def test_what_a_saved_notebook_shows_is_the_same_on_every_run(monkeypatch):
    shown = []
    monkeypatch.setattr(live, "_display", shown.append)
    bar = live.ProgressBar("schedules", total=3)
    for _ in bar.iterate(range(3)):
        pass
    (box,) = shown
    assert repr(box) == "[progress bar: schedules]" and bar.bar in box.children and bar.label in box.children
    assert bar.label.value.startswith("3/3 in ")
