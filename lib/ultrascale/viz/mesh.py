"""A picture of a process mesh: one cell per rank, coloured by its group along an axis.

    from ultrascale.parallel.mesh import Mesh
    draw_mesh(Mesh(dp=2, tp=4), color_by="tp")   # two tp groups, one colour each
    draw_mesh_groups(Mesh(dp=2, pp=2, tp=2))      # one panel per axis: the rank-to-group map

The figure is a plain ``matplotlib.figure.Figure``: a notebook shows it when it is the
value of a cell, and nothing is left open in pyplot.
"""

from __future__ import annotations

import math

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle


def _mixed_radix(coords: dict, axes: tuple, sizes: dict) -> int:
    """Flatten the coordinates along ``axes`` into one index (the last axis fastest)."""
    index = 0
    for axis in axes:
        index = index * sizes[axis] + coords[axis]
    return index


def draw_mesh(mesh, color_by: str | tuple = "tp", cols: tuple | None = None) -> Figure:
    """Draw every rank of ``mesh`` as a labelled cell; ranks of one group share a colour.

    ``cols`` are the axes laid out left to right (default: the innermost axis, so the
    grid reads in rank order); the other axes go top to bottom.
    """
    n_rows, n_cols = _grid_size(mesh, cols)
    fig = Figure(figsize=(max(4.5, 1.4 * n_cols + 1), 0.9 * n_rows + 1), layout="constrained")
    _draw_on(fig.add_subplot(), mesh, color_by, cols)
    return fig


def draw_mesh_groups(mesh, axes=None, cols: tuple | None = None) -> Figure:
    """The rank-to-group map as pictures: one panel per axis (default: those of size > 1),
    the same grid of ranks in each, coloured by its groups along that axis."""
    axes = [a for a in mesh.axes if mesh.sizes[a] > 1] if axes is None else list(axes)
    n_rows, n_cols = _grid_size(mesh, cols)
    fig = Figure(figsize=(len(axes) * max(3.2, 1.3 * n_cols + 0.6), 0.9 * n_rows + 1.2), layout="constrained")
    for ax, axis in zip(fig.subplots(1, len(axes), squeeze=False)[0], axes):
        _draw_on(ax, mesh, axis, cols, title=f"{axis if isinstance(axis, str) else '×'.join(axis)} groups")
    return fig


def _grid_size(mesh, cols) -> tuple[int, int]:
    cols = tuple(cols) if cols is not None else mesh.axes[-1:]
    rows = tuple(a for a in mesh.axes if a not in cols)
    return math.prod(mesh.size(a) for a in rows), math.prod(mesh.size(a) for a in cols)


def _draw_on(ax, mesh, color_by, cols, title=None) -> None:
    cols = tuple(cols) if cols is not None else mesh.axes[-1:]
    rows = tuple(a for a in mesh.axes if a not in cols)
    n_rows, n_cols = _grid_size(mesh, cols)
    group_of = {r: i for i, g in enumerate(mesh.group_ranks(color_by)) for r in g}
    palette = colormaps["tab20" if len(set(group_of.values())) > 10 else "tab10"]
    for rank in range(mesh.world_size):
        coords = mesh.coordinate(rank)
        x, y = _mixed_radix(coords, cols, mesh.sizes), _mixed_radix(coords, rows, mesh.sizes)
        ax.add_patch(_cell(x, y, palette(group_of[rank] % palette.N)))
        label = " ".join(f"{a}{c}" for a, c in coords.items())
        ax.text(x + 0.5, y + 0.5, f"rank {rank}\n{label}", ha="center", va="center", fontsize=9)
    ax.set_xlim(0, n_cols)
    ax.set_ylim(n_rows, 0)  # rank 0 at the top left
    ax.set_aspect("auto")
    ax.axis("off")
    name = color_by if isinstance(color_by, str) else "×".join(color_by)
    ax.set_title(title or f"{mesh!r}: one colour per {name} group", fontsize=10)


def _cell(x: int, y: int, color) -> Rectangle:
    return Rectangle((x + 0.04, y + 0.06), 0.92, 0.88, facecolor=color, edgecolor="black", alpha=0.8)
