"""Diagrams of three layers split over ranks, drawn from their sizes (no run needed).

    moe_layer_figure(chosen, weights, 8, experts_per_rank=2)  # chapter 08: router, top-k, dispatch, combine
    tp_split_figure(tp=2, heads=4)                          # chapter 04: the MLP and attention under TP
    cp_ring_figure(cp=4)                                    # chapter 06: sequence chunks and the K/V ring

Each returns a plain ``matplotlib.figure.Figure`` made of boxes, arrows and labels only, so
it is the same picture on every run; a notebook shows it when it is a cell's value. The
labels say what each box holds, and ``tests/test_viz_diagrams.py`` checks them.
"""

from __future__ import annotations

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

_RANK_COLOURS = colormaps["tab10"]
_GREY = "#d9d9d9"


def _box(ax, x, y, w, h, text, colour=_GREY, fontsize=8, **kwargs):
    """A filled, outlined rectangle with centred text; (x, y) is its lower-left corner."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor="black", lw=0.8, alpha=0.85))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, **kwargs)


def _arrow(ax, start, end, colour="black", style="-|>", lw=0.9, **kwargs):
    ax.add_patch(
        FancyArrowPatch(
            start, end, arrowstyle=style, mutation_scale=9, color=colour, lw=lw, shrinkA=0, shrinkB=0, **kwargs
        )
    )


def _frame(ax, width, height, title):
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.set_title(title, fontsize=9)


# ---- chapter 08: a mixture-of-experts layer ----------------------------------------------
def moe_layer_figure(chosen, weights, experts: int | None = None, experts_per_rank: int | None = None) -> Figure:
    """One MoE layer on a few tokens: the router scores every expert, keeps the top k, each
    token is dispatched to its k experts (across ranks when ``experts_per_rank`` is given:
    the all-to-all), and the experts' outputs are combined, weighted, back on the token.

    ``chosen`` and ``weights`` are (tokens, k) nested lists or tensors: the router's choice;
    ``experts``: how many to draw (default: enough for every expert chosen).
    """
    if hasattr(weights, "detach"):  # a router's weights carry autograd: read plain numbers
        weights = weights.detach()
    chosen = [[int(e) for e in row] for row in chosen]
    weights = [[float(w) for w in row] for row in weights]
    tokens, k = len(chosen), len(chosen[0])
    experts = max(experts or 0, max(max(row) for row in chosen) + 1)
    if experts_per_rank:
        experts = -(-experts // experts_per_rank) * experts_per_rank
    fig = Figure(figsize=(8.4, 0.45 * max(tokens, experts) + 1.0), layout="constrained")
    ax = fig.add_subplot()
    height = max(tokens, experts) + 0.6
    _frame(ax, 10, height, f"a mixture-of-experts layer: {tokens} tokens, {experts} experts, top-{k}")

    def row_y(i, n):  # rows centred vertically, first at the top
        return height - 0.3 - (height - 0.6 - n) / 2 - (i + 1)

    token_colours = colormaps["Set2"]
    for t in range(tokens):
        y = row_y(t, tokens)
        _box(ax, 0.1, y + 0.1, 1.2, 0.8, f"token {t}", token_colours(t % 8))
        ranked = ", ".join(f"E{e} {w:.2f}" for e, w in zip(chosen[t], weights[t]))
        _box(ax, 2.0, y + 0.1, 2.0, 0.8, f"top-{k}: {ranked}", "white", fontsize=7)
        _arrow(ax, (1.3, y + 0.5), (2.0, y + 0.5))
    ax.text(3.0, height - 0.15, "router: softmax(x W), keep top k", ha="center", va="top", fontsize=7)

    for e in range(experts):
        y = row_y(e, experts)
        rank = e // experts_per_rank if experts_per_rank else None
        colour = _RANK_COLOURS(rank % 10) if rank is not None else _GREY
        label = f"expert {e}" + (f" (rank {rank})" if rank is not None else "")
        _box(ax, 5.6, y + 0.1, 1.7, 0.8, label, colour)
    for t in range(tokens):  # dispatch: token -> each of its experts; combine: expert -> the sum
        for e, w in zip(chosen[t], weights[t]):
            y_t, y_e = row_y(t, tokens) + 0.5, row_y(e, experts) + 0.5
            _arrow(ax, (4.0, y_t), (5.6, y_e), token_colours(t % 8), lw=0.6 + 1.6 * w)
            _arrow(ax, (7.3, y_e), (8.4, y_t), token_colours(t % 8), lw=0.6 + 1.6 * w, linestyle="--")
    for t in range(tokens):
        y = row_y(t, tokens)
        _box(ax, 8.4, y + 0.1, 1.5, 0.8, f"y{t} = Σ w·E(x{t})", token_colours(t % 8), fontsize=7)
    dispatch = "dispatch (all-to-all)" if experts_per_rank else "dispatch"
    combine = "combine (all-to-all back)" if experts_per_rank else "combine"
    ax.text(4.8, 0.05, dispatch, ha="center", va="bottom", fontsize=7)
    ax.text(7.85, 0.05, combine, ha="center", va="bottom", fontsize=7)
    return fig


# ---- chapter 04: tensor parallelism's two splits ------------------------------------------
def _tp_row(ax, y: float, height: float, colour, first: str, second: str) -> None:
    """One rank's row: X, its column-parallel piece, its row-parallel piece, an arrow to the sum."""
    _box(ax, 0.1, y, 1.0, 0.8, "X")
    _box(ax, 1.6, y, 2.2, 0.8, first, colour, fontsize=7)
    _box(ax, 4.3, y, 2.2, 0.8, second, colour, fontsize=7)
    _arrow(ax, (1.1, y + 0.4), (1.6, y + 0.4))
    _arrow(ax, (3.8, y + 0.4), (4.3, y + 0.4))
    _arrow(ax, (6.5, y + 0.4), (7.2, height / 2))


def tp_split_figure(tp: int = 2, heads: int = 4) -> Figure:
    """The MLP and attention of one block under TP: which slice of each weight every rank
    holds, and where the one all-reduce of each sits (forward)."""
    if heads % tp:
        raise ValueError(f"tp={tp} must divide heads={heads}")
    fig = Figure(figsize=(9, 0.9 + 0.65 * tp), layout="constrained")
    mlp_ax, attn_ax = fig.subplots(1, 2)
    height = tp + 0.7
    _frame(mlp_ax, 10, height, f"MLP, tp = {tp}: A split by columns, B by rows")
    _frame(attn_ax, 10, height, f"attention, tp = {tp}: {heads} heads, {heads // tp} per rank")
    per_rank = heads // tp
    for r in range(tp):
        y = height - 0.2 - (r + 1) + 0.1
        colour = _RANK_COLOURS(r % 10)
        # MLP: X (whole, on every rank) -> X A_r (h x 4h/tp) -> GeLU -> Z_r B_r (4h/tp x h) -> partial Y_r
        _tp_row(mlp_ax, y, height, colour, f"GeLU(X A{r})\nA{r}: h × 4h/tp", f"Z{r} B{r}\nB{r}: 4h/tp × h")
        # attention: X -> q, k, v of this rank's heads -> attention per head -> out-projection rows
        names = ",".join(str(i) for i in range(r * per_rank, (r + 1) * per_rank))
        _tp_row(attn_ax, y, height, colour, f"q, k, v of\nheads {names}", f"attention\n→ O{r} W_out,{r}")
    for ax, first, second in (
        (mlp_ax, "column-parallel", "row-parallel"),
        (attn_ax, "heads split (columns)", "out-proj rows"),
    ):
        ax.text(0.6, 0.0, "X: whole\non every rank", ha="center", va="bottom", fontsize=6)
        ax.text(2.7, 0.0, first, ha="center", va="bottom", fontsize=6)
        ax.text(5.4, 0.0, second, ha="center", va="bottom", fontsize=6)
        _box(ax, 7.2, height / 2 - 0.45, 1.4, 0.9, "all-reduce\n(sum)", "white", fontsize=7)
        _arrow(ax, (8.6, height / 2), (9.1, height / 2))
        ax.text(9.2, height / 2, "Y", ha="left", va="center", fontsize=9)
    return fig


# ---- chapter 06: context parallelism --------------------------------------------------------
def cp_ring_figure(cp: int = 4) -> Figure:
    """Context parallelism at a glance: the sequence cut into ``cp`` chunks, one per rank,
    each rank keeping its queries while the K/V chunks travel one hop round the ring per
    step; the table says whose K/V each rank attends to at each step."""
    fig = Figure(figsize=(9, 1.2 + 0.45 * cp), layout="constrained")
    seq_ax, ring_ax = fig.subplots(1, 2, width_ratios=(1, 1.1))
    _frame(seq_ax, 10, 5, f"the sequence cut into {cp} chunks, one per rank")
    width = 9.6 / cp
    top, mid = 4.8, 2.3
    for r in range(cp):
        x = 0.2 + r * width
        colour = _RANK_COLOURS(r % 10)
        _box(seq_ax, x + 0.05, top - 0.8, width - 0.1, 0.8, f"tokens\nchunk {r}", colour, fontsize=7)
        _arrow(seq_ax, (x + width / 2, top - 0.8), (x + width / 2, mid + 1.1), colour)
        _box(seq_ax, x + 0.2, mid, width - 0.4, 1.1, f"rank {r}\nQ{r}\nK{r}/V{r}", colour, fontsize=7)
        if r + 1 < cp:  # one hop right per step ...
            _arrow(seq_ax, (x + width - 0.2, mid + 0.3), (x + width + 0.2, mid + 0.3))
    # ... and the last rank's K/V go back round to rank 0
    _arrow(seq_ax, (0.2 + (cp - 0.5) * width, mid), (0.2 + 0.5 * width, mid), connectionstyle="arc3,rad=-0.25")
    seq_ax.text(
        5, 0.15, "queries stay; K/V move one rank along the ring per step", ha="center", va="bottom", fontsize=7
    )

    steps = cp
    _frame(ring_ax, steps + 1, cp + 1, "whose K/V each rank attends to, step by step")
    for t in range(steps):
        ring_ax.text(t + 1.5, cp + 0.5, f"step {t}", ha="center", va="center", fontsize=7)
    for r in range(cp):
        y = cp - 1 - r
        ring_ax.text(0.5, y + 0.5, f"rank {r}", ha="center", va="center", fontsize=7)
        for t in range(steps):
            owner = (r - t) % cp  # one hop per step: rank r holds what rank r - t started with
            _box(ring_ax, t + 1.05, y + 0.08, 0.9, 0.84, f"K{owner}/V{owner}", _RANK_COLOURS(owner % 10), fontsize=7)
    return fig
