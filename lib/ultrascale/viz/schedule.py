"""Pipeline timelines drawn as in the book: one row per rank, micro-batch ids in the boxes.

    fig = draw(simulate(one_f_one_b(p=4, m=8)))           # a simulated schedule
    fig = draw(per_rank_rows, title="1F1B, measured")      # Timeline rows from real ranks

Forwards are blue, backwards green, weight-gradient passes (W) purple; a rank's later chunks
(interleaving, V schedules) are drawn in lighter shades of the same colours. The grey behind
the boxes is the bubble: time in the step a rank spends waiting.
"""

from __future__ import annotations

from ..schedule.simulate import Simulation, action_of, bubble_fraction

# (first chunk, later chunks) for each op.
COLOURS = {"F": ("#4c72b0", "#a9bfe3"), "B": ("#55a868", "#b1dcbc"), "W": ("#8172b2", "#c9c0e6")}
LABELS = {"F": "forward (F)", "B": "backward (B)", "W": "weight gradients (W)"}


def _spans(timelines):
    """(rank, action, start, end, chunk) tuples, time unit, and the schedule if known."""
    if isinstance(timelines, Simulation):
        s = timelines.schedule
        return [(x.rank, x.action, x.start, x.end, s.chunk_of(x.action.stage)) for x in timelines.spans], "t_f", s
    rows = (
        [e for per_rank in timelines for e in per_rank]
        if timelines and isinstance(timelines[0], list)
        else list(timelines)
    )
    rows = [(e, action_of(e["name"])) for e in rows if e.get("lane", "compute") == "compute"]
    rows = [(e, a) for e, a in rows if a is not None]
    if not rows:
        raise ValueError("no pipeline compute events to draw (names such as 'forward 3 stage 1')")
    t0 = min(e["start"] for e, _ in rows)
    ranks = {}
    for e, a in rows:  # measured rows do not say which chunk a stage is: order the rank's stages
        ranks.setdefault(e["rank"], set()).add(a.stage)
    chunk = {(r, s): sorted(stages).index(s) for r, stages in ranks.items() for s in stages}
    return (
        [(e["rank"], a, 1e3 * (e["start"] - t0), 1e3 * (e["end"] - t0), chunk[e["rank"], a.stage]) for e, a in rows],
        "ms",
        None,
    )


def draw(timelines, ax=None, title: str | None = None, number_from: int = 0):
    """Draw a :class:`Simulation` or measured Timeline rows; returns the matplotlib Figure.

    ``number_from=1`` numbers the micro-batches from 1 as the book's figures do (the action
    lists count from 0).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    spans, unit, schedule = _spans(timelines)
    ranks = sorted({r for r, *_ in spans})
    end = max(e for *_, e, _ in spans)
    if ax is None:
        fig, ax = plt.subplots(
            figsize=(min(14.0, max(6.0, 0.35 * end if unit == "t_f" else 12.0)), 0.5 * len(ranks) + 1.3)
        )
        plt.close(fig)  # the caller shows it; a notebook would otherwise draw it twice
    else:
        fig = ax.figure
    for r in ranks:  # the bubble: a grey lane behind each rank's boxes
        ax.add_patch(Rectangle((0, r - 0.4), end, 0.8, facecolor="#eeeeee", edgecolor="none"))
    smallest = min(e - s for _, _, s, e, _ in spans)
    for rank, a, start, stop, chunk in spans:
        colour = COLOURS[a.op][min(chunk, 1)]
        ax.add_patch(
            Rectangle((start, rank - 0.4), stop - start, 0.8, facecolor=colour, edgecolor="white", linewidth=0.6)
        )
        text = str(a.microbatch + number_from)
        if (stop - start) / end > 0.006 * len(text):  # only where the number fits
            size = 8 if smallest / end > 0.02 else 6
            ax.text(
                (start + stop) / 2,
                rank,
                text,
                ha="center",
                va="center",
                fontsize=size,
                color="white" if chunk == 0 else "#222222",
            )
    ax.set_xlim(0, end)
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_xlabel("time (units of t_f)" if unit == "t_f" else "time (ms)")
    ops = [op for op in COLOURS if any(a.op == op for _, a, *_ in spans)]
    handles = [Patch(color=COLOURS[op][0], label=LABELS[op]) for op in ops]
    if any(c > 0 for *_, c in spans):
        handles.append(Patch(facecolor=COLOURS["F"][1], label="later chunks: lighter"))
    handles.append(Patch(color="#eeeeee", label="bubble (idle)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title is None:
        title = (
            "measured"
            if schedule is None
            else f"{schedule.name}: p={schedule.ranks}, m={schedule.microbatches}, v={schedule.chunks}"
        )
        title += f"; bubble fraction {bubble_fraction(timelines):.3f}"
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
