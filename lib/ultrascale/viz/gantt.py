"""Per-rank Gantt charts from recorded timelines.

Each rank gets two lanes, compute and communication, so overlap shows as bars
stacked on top of each other and idle time as gaps::

    rows = cluster.run(train_step_with_timeline)      # each rank returns Timeline.rows()
    fig = plot_gantt(rows, title="bucketed DP")

``rows`` may be one flat list of event dicts or one list per rank (what
``cluster.run`` returns). Times are shown in milliseconds from the earliest event.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..comm.logger import base_op

LANES = ("compute", "communication")
# Colour by the first word of an event's name: forward, backward, all_reduce, ...
COLOURS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "optimizer": "#8172b2",
    "step": "#8172b2",
    "all_reduce": "#dd8452",
    "reduce_scatter": "#c44e52",
    "all_gather": "#da8bc3",
    "broadcast": "#937860",
    "copy": "#8c8c8c",
}


def _flatten(rows) -> list[dict]:
    if rows and isinstance(rows[0], (list, tuple)):
        return [e for per_rank in rows for e in per_rank]
    return list(rows)


def _kind(name: str) -> str:
    """The colour key: the first word, with a torch function named by its collective
    (``all_gather_single`` -> ``all_gather``, as ``CommLogger`` logs it)."""
    return base_op(name.split()[0]) if name else ""


def plot_gantt(
    rows,
    title: str = "",
    ax=None,
    lanes=LANES,
    min_width_ms: float = 0.05,
    show_marks: bool = False,
    label_bars: bool = False,
):
    """Draw one horizontal bar per event: y = (rank, lane), x = time in ms.

    Zero-length events (``Timeline.mark``) are drawn as ticks when ``show_marks``.
    ``label_bars``: write each event's name (without "forward"/"backward") inside its bar
    where it fits. Returns the figure.
    """
    events = _flatten(rows)
    if not events:
        raise ValueError("no events to draw: was the Timeline enabled on the ranks?")
    t0 = min(e["start"] for e in events)
    ranks = sorted({e["rank"] for e in events})
    rows_y = {(r, lane): i for i, (r, lane) in enumerate((r, lane) for r in ranks for lane in lanes)}
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows_y) + 1.2))
        plt.close(fig)  # the caller displays it; keeps notebooks from showing it twice
    else:
        fig = ax.figure
    seen, bars, spans = set(), [], {}
    for e in events:
        y = rows_y.get((e["rank"], e["lane"]))
        if y is None:
            continue
        start, width = 1e3 * (e["start"] - t0), 1e3 * (e["end"] - e["start"])
        kind = _kind(e["name"])
        colour = COLOURS.get(kind, "#999999")
        if width == 0:
            if show_marks:
                ax.plot([start, start], [y - 0.4, y + 0.4], color=colour, lw=0.8)
            continue
        spans.setdefault((y, colour), []).append((start, max(width, min_width_ms)))
        seen.add(kind)
        if label_bars:
            bars.append(
                (start, width, y, e["name"].split(" ", 1)[-1] if kind in ("forward", "backward") else e["name"])
            )
    # One artist per lane and colour, not per event: a step's timeline has hundreds of events, and
    # matplotlib's cost is per artist (a chart of 600 bars took 0.72 s of CPU to draw and save as a
    # PNG, 0.10 s this way).
    for (y, colour), lane_spans in spans.items():
        ax.broken_barh(lane_spans, (y - 0.4, 0.8), facecolors=colour, edgecolors="white", linewidth=0.3)
    span = max(1e3 * (e["end"] - t0) for e in events)
    for start, width, y, text in bars:  # only where the text fits (about 1.2% of the axis per letter)
        if width > 0.012 * span * len(text):
            ax.text(start + width / 2, y, text, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows_y)))
    ax.set_yticklabels([f"rank {r} {lane[:4]}" for (r, lane) in rows_y])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title)
    handles = [Patch(color=COLOURS.get(k, "#999999"), label=k) for k in sorted(seen)]
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def lane_summary(rows) -> dict:
    """Per rank: busy ms of each lane, and how much of the communication hid behind compute."""
    from ..parallel.timeline import covered_seconds, overlap_seconds

    events = _flatten(rows)
    out = {}
    for r in sorted({e["rank"] for e in events}):
        mine = [e for e in events if e["rank"] == r]
        busy = {
            lane: 1e3 * covered_seconds([(e["start"], e["end"]) for e in mine if e["lane"] == lane]) for lane in LANES
        }
        busy["overlapped"] = 1e3 * overlap_seconds(mine, rank=r)
        out[r] = busy
    return out
