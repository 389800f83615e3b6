"""Pictures of collectives: who holds which values before and after, drawn from the real
per-rank tensors that ``cluster.run`` returns.

* ``collective_figure(before, after)``: two grids side by side, one row per buffer of
  each rank and one column per element, every cell annotated with its value.
* ``ring_steps_figure(frames)``: the chunk states of a ring collective after each step,
  one grid (ranks x chunks) per step, each cell listing which ranks' inputs it holds.
* ``contributors(value)``: decode a sum of ``2**rank`` terms back into the set of
  ranks that contributed (the trick behind the ring pictures).

A rank's state may be a tensor (0-D, 1-D or 2-D: one row per row), a list of tensors
(one row each, as in a ``gather_list``), a dict of named buffers, or ``None`` (nothing
to show). Figures are plain ``matplotlib.figure.Figure`` objects: a notebook shows one
when it is the value of a cell, and nothing is left open in pyplot.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

Row = tuple[str, Any]  # (label, 1-D numpy array, or None for "no buffer")


# ---- a rank's state as labelled rows ---------------------------------------------------
def _as_array(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.is_floating_point() and value.dtype not in (torch.float32, torch.float64):
            value = value.float()  # numpy has no bfloat16
        return value.numpy()
    return np.asarray(value)


def buffer_rows(state, name: str = "") -> list[Row]:
    """Flatten one rank's state into ``(label, values)`` rows, in display order.

    >>> buffer_rows({"tensor": torch.ones(3), "gather_list": None})
    [('tensor', array([1., 1., 1.], dtype=float32)), ('gather_list', None)]
    """
    if state is None:
        return [(name, None)] if name else []
    if isinstance(state, dict):
        rows = []
        for key, value in state.items():
            rows += buffer_rows(value, f"{name}.{key}" if name else str(key))
        return rows
    if isinstance(state, (list, tuple)) and state and not np.isscalar(state[0]):
        rows = []
        for i, item in enumerate(state):
            rows += buffer_rows(item, f"{name}[{i}]")
        return rows
    array = _as_array(state)
    if array.ndim == 0:
        return [(name, array.reshape(1))]
    if array.ndim == 1:
        return [(name, array)]
    if array.ndim == 2:
        return [(f"{name}[{i}]", row) for i, row in enumerate(array)]
    raise ValueError(
        f"cannot draw a {array.ndim}-D buffer ({name or 'unnamed'}): pass 1-D or 2-D tensors, or flatten it first"
    )


def _format(values: np.ndarray) -> str:
    """'{:g}' when every value is a whole number (most course examples), else 3 digits."""
    finite = values[np.isfinite(values)] if values.size else values
    if values.dtype.kind in "iub" or (finite.size and np.all(finite == np.round(finite))):
        return "{:g}"
    return "{:.3g}"


def _text_colour(rgba) -> str:
    r, g, b = rgba[:3]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


# ---- before / after grids ----------------------------------------------------------------
def _draw_grid(ax, per_rank_rows, norm, cmap, fmt, title, height) -> None:
    """One panel: every rank's rows stacked top to bottom, a line between ranks.

    ``height`` (in rows) is the same for both panels, so rows line up in size.
    """
    width = max([len(v) for rows in per_rank_rows for _, v in rows if v is not None] + [1])
    y, ticks, labels, separators = 0, [], [], []
    for rank, rows in enumerate(per_rank_rows):
        if rank:
            separators.append(y)
        if not rows:
            rows = [("", None)]
        for i, (label, values) in enumerate(rows):
            head = f"rank {rank}" if i == 0 else ""
            ticks.append(y + 0.5)
            labels.append(f"{head}  {label}".strip() if label else head)
            if values is None:
                ax.add_patch(Rectangle((0, y), width, 1, facecolor="#f0f0f0", edgecolor="white"))
                ax.text(
                    width / 2,
                    y + 0.5,
                    "(no buffer)",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="#808080",
                    style="italic",
                )
            else:
                for j, v in enumerate(values):
                    colour = cmap(norm(float(v)))
                    ax.add_patch(Rectangle((j, y), 1, 1, facecolor=colour, edgecolor="white"))
                    ax.text(
                        j + 0.5,
                        y + 0.5,
                        fmt.format(v),
                        ha="center",
                        va="center",
                        fontsize=8,
                        color=_text_colour(colour),
                    )
            y += 1
    for s in separators:
        ax.axhline(s, color="black", linewidth=1.5)
    ax.set_xlim(0, width)
    ax.set_ylim(max(y, height), 0)  # rank 0 at the top
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xticks([j + 0.5 for j in range(width)], [str(j) for j in range(width)], fontsize=7)
    ax.set_xlabel("element", fontsize=8)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(title, fontsize=10)


def collective_figure(
    before: Sequence,
    after: Sequence,
    title: str = "",
    *,
    labels=("before", "after"),
    cmap: str = "Blues",
    fmt: str | None = None,
) -> Figure:
    """Draw each rank's buffers before and after a collective.

    ``before`` and ``after`` hold one state per rank (see the module docstring), e.g.
    the two lists a ``cluster.run`` returns. Both panels share one colour scale, so a
    value has the same colour on the left and on the right.
    """
    if len(before) != len(after):
        raise ValueError(f"before has {len(before)} ranks but after has {len(after)}")
    panels = [[buffer_rows(s) for s in states] for states in (before, after)]
    values = [v.astype(float) for p in panels for rows in p for _, v in rows if v is not None and v.size]
    flat = np.concatenate(values) if values else np.zeros(1)
    flat = flat[np.isfinite(flat)] if np.isfinite(flat).any() else np.zeros(1)
    # Start the scale a little below the smallest value so that it is not white.
    low, high = float(flat.min()), float(flat.max())
    norm = Normalize(low - 0.25 * (high - low or 1), high)
    fmt = fmt or _format(flat)
    heights = [sum(max(len(rows), 1) for rows in p) for p in panels]
    widths = [max([len(v) for rows in p for _, v in rows if v is not None] + [1]) for p in panels]
    fig = Figure(figsize=(1.6 + 0.45 * sum(widths) + 1.6, 0.6 + 0.3 * max(heights)), layout="constrained")
    axes = fig.subplots(1, 2, width_ratios=[w + 2.5 for w in widths])
    colour_map = _cmap(cmap)
    for ax, rows, label in zip(axes, panels, labels):
        _draw_grid(ax, rows, norm, colour_map, fmt, label, max(heights))
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def _cmap(name):
    from matplotlib import colormaps

    return colormaps[name]


# ---- ring steps ------------------------------------------------------------------------
def contributors(value) -> frozenset:
    """The ranks whose ``2**rank`` inputs add up to ``value`` (a whole number)."""
    number = int(round(float(value)))
    if number < 0 or abs(float(value) - number) > 1e-6:
        raise ValueError(f"{value!r} is not a sum of distinct powers of two")
    return frozenset(bit for bit in range(number.bit_length()) if number >> bit & 1)


def _set_label(ranks) -> str:
    ranks = sorted(ranks)
    if not ranks:
        return "-"
    sep = "" if ranks[-1] < 10 else ","
    return sep.join(str(r) for r in ranks)


def ring_steps_figure(
    frames: Sequence, titles: Sequence[str], sends: Sequence | None = None, ncols: int | None = None, title: str = ""
) -> Figure:
    """One grid per step of a ring collective: ranks down, chunks across.

    ``frames[f][r][c]`` is the set of ranks whose inputs chunk ``c`` on rank ``r``
    holds after step ``f`` (frame 0: the start). The colour darkens with the number of
    contributors and a complete chunk is drawn bold. ``sends[f][r]``, when given, is the
    chunk rank ``r`` sends in the step that leads from frame ``f`` to ``f + 1``; it is
    outlined in red (it goes to the right neighbour, rank ``r + 1``).
    """
    if len(frames) != len(titles):
        raise ValueError(f"{len(frames)} frames but {len(titles)} titles")
    n_frames = len(frames)
    ncols = ncols or n_frames
    nrows = -(-n_frames // ncols)
    world = len(frames[0])
    chunks = len(frames[0][0])
    fig = Figure(
        figsize=(0.5 + ncols * (0.42 * chunks + 0.9), 0.8 + nrows * (0.36 * world + 0.7)), layout="constrained"
    )
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    cmap = _cmap("Oranges")
    for f, ax in enumerate(axes):
        if f >= n_frames:
            ax.set_visible(False)
            continue
        for r in range(world):
            for c in range(chunks):
                held = frames[f][r][c]
                share = len(held) / world
                colour = cmap(0.1 + 0.75 * share)
                ax.add_patch(Rectangle((c, r), 1, 1, facecolor=colour, edgecolor="white"))
                ax.text(
                    c + 0.5,
                    r + 0.5,
                    _set_label(held),
                    ha="center",
                    va="center",
                    fontsize=7 if world <= 5 else 5,
                    color=_text_colour(colour),
                    fontweight="bold" if len(held) == world else "normal",
                )
            if sends is not None and f < len(sends) and sends[f] is not None:
                c = sends[f][r]
                ax.add_patch(Rectangle((c + 0.04, r + 0.04), 0.92, 0.92, fill=False, edgecolor="red", linewidth=1.6))
        ax.set_xlim(0, chunks)
        ax.set_ylim(world, 0)
        ax.set_xticks([c + 0.5 for c in range(chunks)], [f"c{c}" for c in range(chunks)], fontsize=7)
        ax.set_yticks([r + 0.5 for r in range(world)], [f"rank {r}" for r in range(world)], fontsize=7)
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title(titles[f], fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
