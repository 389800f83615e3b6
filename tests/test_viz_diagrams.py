"""ultrascale.viz.diagrams: the three layer diagrams say what they draw.

Checked through their labels, not their pixels: which expert each token reaches, which
heads each TP rank holds, whose K/V each CP rank attends to at each step.
"""

import pytest
from matplotlib.figure import Figure

from ultrascale.viz.diagrams import cp_ring_figure, moe_layer_figure, tp_split_figure


def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_moe_layer_names_every_choice_and_the_rank_of_every_expert():
    fig = moe_layer_figure([[0, 1], [3, 0]], [[0.6, 0.4], [0.7, 0.3]], experts_per_rank=2)
    texts = _texts(fig)
    assert isinstance(fig, Figure)
    assert "top-2: E0 0.60, E1 0.40" in texts and "top-2: E3 0.70, E0 0.30" in texts
    assert [t for t in texts if t.startswith("expert")] == [
        "expert 0 (rank 0)",
        "expert 1 (rank 0)",
        "expert 2 (rank 1)",
        "expert 3 (rank 1)",
    ]
    assert "dispatch (all-to-all)" in texts
    # one process: no ranks, no all-to-all
    assert "dispatch" in _texts(moe_layer_figure([[1]], [[1.0]]))
    # every expert drawn, chosen or not
    assert "expert 7" in _texts(moe_layer_figure([[1]], [[1.0]], experts=8))


def test_tp_split_gives_each_rank_whole_heads_and_one_all_reduce_per_layer():
    texts = _texts(tp_split_figure(tp=2, heads=4))
    assert "q, k, v of\nheads 0,1" in texts and "q, k, v of\nheads 2,3" in texts
    assert texts.count("all-reduce\n(sum)") == 2  # one after the MLP, one after attention
    with pytest.raises(ValueError, match="divide"):
        tp_split_figure(tp=3, heads=4)


def test_cp_ring_moves_kv_one_rank_per_step():
    cp = 3
    texts = _texts(cp_ring_figure(cp))
    ring_ax = cp_ring_figure(cp).axes[1]
    cells = [t.get_text() for t in ring_ax.texts if t.get_text().startswith("K")]
    # row r, column t: rank r holds the K/V rank (r - t) mod cp started with
    assert cells == [f"K{(r - t) % cp}/V{(r - t) % cp}" for r in range(cp) for t in range(cp)]
    assert all(f"rank {r}\nQ{r}\nK{r}/V{r}" in texts for r in range(cp))
