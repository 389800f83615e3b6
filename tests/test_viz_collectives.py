"""ultrascale.viz.collectives: the before/after grids and the ring-step pictures.

The figures are checked through what they contain (the annotated values, the colours,
the outlined cells), not by comparing images.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ultrascale.runtime import Cluster
from ultrascale.viz.collectives import buffer_rows, collective_figure, contributors, ring_steps_figure


def _texts(ax):
    return [t.get_text() for t in ax.texts]


def _cells(ax):
    """Filled rectangles (the grid cells) of one panel."""
    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_fill()]


# ---- buffer_rows -----------------------------------------------------------------------
def test_buffer_rows_flattens_every_kind_of_state():
    assert buffer_rows(None) == []
    ((label, values),) = buffer_rows(torch.tensor([1.0, 2.0]))
    assert label == "" and values.tolist() == [1.0, 2.0]
    assert [v.tolist() for _, v in buffer_rows(torch.tensor(3.0))] == [[3.0]]  # 0-D: one cell
    rows = buffer_rows(torch.arange(6.0).reshape(2, 3))
    assert [label for label, _ in rows] == ["[0]", "[1]"]
    rows = buffer_rows(
        {"tensor": torch.ones(2), "gather_list": [torch.zeros(2), torch.full((2,), 2.0)], "missing": None}
    )
    assert [label for label, _ in rows] == ["tensor", "gather_list[0]", "gather_list[1]", "missing"]
    assert rows[-1][1] is None and rows[2][1].tolist() == [2.0, 2.0]
    assert buffer_rows([1, 2, 3])[0][1].tolist() == [1, 2, 3]  # a plain list of numbers is one row
    assert buffer_rows(torch.ones(2, dtype=torch.bfloat16))[0][1].dtype == np.float32
    with pytest.raises(ValueError, match="3-D"):
        buffer_rows(torch.zeros(2, 2, 2))


# ---- collective_figure -------------------------------------------------------------------
def test_collective_figure_annotates_every_value_with_one_colour_scale():
    before = [torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3)]
    after = [{"tensor": torch.tensor([1.0, 2.0, 3.0])}, {"tensor": torch.tensor([1.0, 2.0, 3.0]), "extra": None}]
    fig = collective_figure(before, after, "broadcast")
    assert isinstance(fig, Figure) and fig._suptitle.get_text() == "broadcast"
    left, right = fig.axes
    assert (left.get_title(), right.get_title()) == ("before", "after")
    assert _texts(left) == ["1", "2", "3", "0", "0", "0"]
    assert _texts(right) == ["1", "2", "3", "1", "2", "3", "(no buffer)"]
    # The same value has the same colour in both panels.
    colour = {t.get_text(): to_hex(c.get_facecolor()) for t, c in zip(left.texts, _cells(left))}
    for t, c in zip(right.texts[:6], _cells(right)[:6]):
        assert to_hex(c.get_facecolor()) == colour[t.get_text()]
    assert [t.get_text() for t in right.get_yticklabels()][:3] == ["rank 0  tensor", "rank 1  tensor", "extra"]


def test_collective_figure_formats_fractions_and_refuses_mismatched_ranks():
    fig = collective_figure([torch.tensor([0.5, 1 / 3])], [torch.tensor([0.25, 2.0])])
    assert _texts(fig.axes[0]) == ["0.5", "0.333"]
    with pytest.raises(ValueError, match="ranks"):
        collective_figure([torch.ones(1)], [torch.ones(1), torch.ones(1)])


def _broadcast_on_rank(ctx):
    tensor = torch.arange(1.0, 4.0) if ctx.rank == 0 else torch.zeros(3)
    before = tensor.clone()
    dist.broadcast(tensor, src=0)
    return before, tensor


def test_collective_figure_from_a_real_cluster():
    with Cluster(2, backend="gloo") as cluster:
        before, after = zip(*cluster.run(_broadcast_on_rank))
    fig = collective_figure(before, after)
    assert _texts(fig.axes[0]) == ["1", "2", "3", "0", "0", "0"]
    assert _texts(fig.axes[1]) == ["1", "2", "3"] * 2


# ---- ring pictures -----------------------------------------------------------------------
def test_contributors_decodes_sums_of_powers_of_two():
    assert contributors(0) == frozenset()
    assert contributors(torch.tensor(7.0)) == {0, 1, 2}
    assert contributors(2.0**4 + 1) == {0, 4}
    for bad in (2.5, -1):
        with pytest.raises(ValueError, match="powers of two"):
            contributors(bad)


def test_ring_steps_figure_marks_sends_and_complete_chunks():
    n = 3
    start = [[{r} for _ in range(n)] for r in range(n)]
    done = [[set(range(n)) for _ in range(n)] for _ in range(n)]
    fig = ring_steps_figure(
        [start, done, done], ["start", "middle", "end"], sends=[[2, 0, 1], [0, 1, 2]], ncols=2, title="ring"
    )
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["start", "middle", "end"]
    assert len(fig.axes) == 4 and not fig.axes[3].get_visible()  # 2 x 2 grid, one unused
    assert _texts(visible[0]) == ["0", "0", "0", "1", "1", "1", "2", "2", "2"]
    assert _texts(visible[1]) == ["012"] * 9
    assert all(t.get_fontweight() == "bold" for t in visible[1].texts)
    assert all(t.get_fontweight() == "normal" for t in visible[0].texts)
    outlines = [p for p in visible[0].patches if not p.get_fill()]
    assert sorted((int(p.get_x()), int(p.get_y())) for p in outlines) == [(0, 1), (1, 2), (2, 0)]
    assert not [p for p in visible[2].patches if not p.get_fill()]  # no send after the last frame
    with pytest.raises(ValueError, match="titles"):
        ring_steps_figure([start], ["a", "b"])
