# %% [markdown]
# # A3 · The arithmetic of overlapping communication with computation
#
# Data parallelism, ZeRO-3, tensor and pipeline parallelism all move data while the GPUs compute.
# Whether that data movement costs anything depends on one comparison: does the transfer take
# longer than the computation it runs beside? If not, a good schedule hides it completely; if it
# does, part of it shows in every step, however clever the schedule. This appendix of the book
# writes that comparison down for each technique as a ratio,
#
# $$\frac{t_\text{comm}}{t_\text{compute}} \le 1 \quad\Longrightarrow\quad \text{the communication can be hidden},$$
#
# using the counts of appendix A2 for the bytes and the FLOPs, and two hardware numbers,
# `peak_flops` and `peak_bw`.
#
# In this notebook you will
# 1. derive every ratio (DP, ZeRO-3, TP, PP) symbolically with sympy from its $t_\text{comm}$ and
#    $t_\text{compute}$, and see what each depends on, and what it does not;
# 2. find that the data-parallel ratio printed in the book does not follow from its own two lines,
#    and derive the one that does;
# 3. move sliders over `h`, TP, DP, `seq`, `mbs`, layers per stage, `peak_flops` and `peak_bw`
#    and watch where communication starts to show;
# 4. measure this machine's matmul FLOP/s and gloo bus bandwidth, predict whether chapter 02's
#    bucketed DP and chapter 03's prefetched ZeRO-3 can hide their communication, and hold the
#    prediction against timelines of those very steps.
#
# The formulas live in `lib/ultrascale/overlap.py` as plain functions. They are written once and
# used three ways: with sympy symbols here, with numbers by the configuration planner of
# chapter 10, and with numpy arrays by the sliders.

# %% tags=["parameters"]
WORLD_SIZE = 4  # ranks for the calibration and the timelines (chapters 02 and 03 use 4 too)
QUICK = True  # True: 3 repeats in the measurements, about 10 s on 2 CPU cores; False: 15 repeats (longer)
SEED = 0

# %%
# %matplotlib inline
from ultrascale.runtime import Cluster  # first: the ranks' fork server loads torch meanwhile
import io
import statistics
import time

import numpy as np
import sympy as sp
import torch
import torch.distributed as dist
from matplotlib.figure import Figure

from ultrascale import facts, overlap
from ultrascale.comm import CommLogger, bus_bandwidth_sweep, format_bytes, wait_for_device
from ultrascale.data import Batches
from ultrascale.model import GPT, GPTConfig, count_params, training_flops
from ultrascale.parallel import Timeline, apply_data_parallel, apply_zero, covered_seconds, overlap_seconds
from ultrascale.scales import block_params
from ultrascale.viz.gantt import plot_gantt
from ultrascale.viz.live import ProgressBar, with_text_repr

assert WORLD_SIZE >= 2, "the measurements need at least two ranks: set WORLD_SIZE >= 2"
torch.manual_seed(SEED)
torch.set_num_threads(1)

# %% [markdown]
# ## 1. The recipe, and the symbols
#
# For each technique the book takes the bytes a collective moves and the FLOPs of the work it
# should hide behind, and divides:
#
# - $t_\text{comm} = \text{bytes} / \texttt{peak\_bw}$, where `peak_bw` is a **bus bandwidth**
#   in the nccl-tests sense (appendix A0): an all-reduce of $K$ bytes over $N$ ranks takes
#   $\frac{2(N-1)}{N} K / \texttt{peak\_bw}$, an all-gather or a reduce-scatter
#   $\frac{N-1}{N} K / \texttt{peak\_bw}$;
# - $t_\text{compute} = \text{FLOPs} / \texttt{peak\_flops}$, with appendix A2's $2TN$ for a forward
#   and $4TN$ for a backward.
#
# Like the book, the formulas count one byte per element unless told otherwise (the library's
# functions take `bytes_per_element`: 2 for bf16). We hand the library's functions sympy
# symbols instead of numbers and let sympy simplify the quotient.

# %%
h, T, N, DP, TP, seq, mbs, L_stage = sp.symbols("h T N DP TP seq mbs L_stage", positive=True)
peak_flops, peak_bw, bucket = sp.symbols("peak_flops peak_bw bucket_size", positive=True)
block = block_params(h)  # A2's 16h² block
assert block == 16 * h**2


def derive(name, t_comm, t_compute):
    """Print both times and their simplified ratio; return the ratio."""
    ratio = sp.simplify(t_comm / t_compute)
    print(f"{name}\n  t_comm    = {sp.simplify(t_comm)}\n  t_compute = {sp.simplify(t_compute)}\n  ratio     = {ratio}")
    return ratio


def same(a, b):
    return sp.simplify(a - b) == 0


# %% [markdown]
# ### ZeRO-3
# ZeRO-3 gathers a block's parameters just before the block runs; with prefetching, the gather of
# block $i+1$ runs while block $i$ computes its forward. Each rank holds $1/DP$ of the block's
# $16h^2$ parameters, so the all-gather moves $16h^2 \cdot \frac{DP-1}{DP}$ per link. The forward of
# one block on a micro-batch is $2 \cdot seq \cdot mbs \cdot 16h^2 = 32\,seq\,mbs\,h^2$ FLOPs.

# %%
zero3 = derive(
    "ZeRO-3 (prefetch one block during the previous block's forward)",
    overlap.zero3_comm_time(block, DP, peak_bw),
    overlap.zero3_compute_time(block, seq, mbs, peak_flops),
)
book_zero3 = 1 / (2 * seq * mbs) * (DP - 1) / DP * peak_flops / peak_bw
assert same(zero3, book_zero3)
assert h not in zero3.free_symbols  # the block's size cancels
print("= the book's (1/(2·seq·mbs))·((DP-1)/DP)·(peak_flops/peak_bw)")

# %% [markdown]
# Per block and step, a rank takes part in three collectives of that size: an all-gather in
# forward, another in backward (the parameters were freed in between) and a reduce-scatter of the
# gradients, $3 \cdot 16h^2/DP$ from each rank, $3 \cdot L \cdot 16h^2/DP$ for the model.

# %%
L = sp.symbols("num_layers", positive=True)
assert same(overlap.zero3_bytes_per_block(block, DP), 3 * 16 * h**2 / DP)
assert same(overlap.zero3_bytes_per_step(block, L, DP), 3 * L * 16 * h**2 / DP)
print("ZeRO-3 bytes per rank and step:", sp.simplify(overlap.zero3_bytes_per_step(block, L, DP)))

# %% [markdown]
# ### Tensor parallelism
# A column-parallel linear all-gathers its `seq × mbs × h` input in forward (each rank holds
# $1/TP$ of it) and reduce-scatters the same size in backward; a row-parallel linear does the
# opposite. A block has two of each: $8\,seq\,mbs\,h/TP$ per block. The computation beside one such
# collective is an $h \times h$ matmul of the micro-batch, split $TP$ ways.

# %%
tp = derive(
    "TP (one all-gather or reduce-scatter against one h x h matmul shard)",
    overlap.tp_comm_time(seq, mbs, h, TP, peak_bw),
    overlap.tp_compute_time(seq, mbs, h, TP, peak_flops),
)
assert same(tp, (TP - 1) / (2 * h) * peak_flops / peak_bw)
assert tp.free_symbols.isdisjoint({seq, mbs})
assert same(overlap.tp_bytes_per_block(seq, mbs, h, TP) * L, 8 * L * seq * mbs * h / TP)
print("= the book's ((TP-1)/(2h))·(peak_flops/peak_bw): no seq, no mbs")

# %% [markdown]
# ### Pipeline parallelism
# A stage sends each micro-batch's activation, `seq · mbs · h` elements, to the next stage, and
# in backward receives the gradient of the same size: $4\,seq\,mbs\,h$ per micro-batch counting
# both ends, $4 \cdot gas \cdot seq\,mbs\,h$ per step. One send hides behind the next stage's forward
# of the previous micro-batch through its `L_stage` layers.

# %%
pp = derive(
    "PP (one activation send against the next stage's forward)",
    overlap.pp_comm_time(seq, mbs, h, peak_bw),
    overlap.pp_compute_time(seq, mbs, h, L_stage, peak_flops),
)
assert same(pp, peak_flops / (32 * h * L_stage * peak_bw))
assert pp.free_symbols.isdisjoint({seq, mbs})
gas = sp.symbols("gas", positive=True)
assert same(overlap.pp_bytes_per_step(seq, mbs, h, gas), 4 * gas * seq * mbs * h)
print("= the book's peak_flops/(32·h·num_layers_in_next_pp·peak_bw): no seq, no mbs")

# %% [markdown]
# ### Data parallelism, and a line that does not add up
# DP all-reduces the gradients in buckets (PyTorch's default cap is 25 MiB, the book's "25MB")
# while backward continues. The book gives
#
# - $t_\text{comm} = t_\text{comm\_bucket} = \dfrac{\text{bucket\_size} \cdot 2(DP-1)}{DP \cdot \texttt{peak\_bw}}$,
# - $t_\text{compute} = \dfrac{4 \cdot \text{num\_tokens} \cdot \text{num\_params}}{\texttt{peak\_flops}}$ (the whole backward),
#
# and then prints the condition
# $\frac{\text{num\_params}}{2 \cdot \text{num\_tokens}} \cdot \frac{DP-1}{DP} \cdot \frac{\texttt{peak\_flops}}{\texttt{peak\_bw}} \le 1$.
# Let us divide the two lines ourselves. One bucket against the whole backward compares unequal
# amounts of work; the comparison that decides whether *all* the gradient traffic hides is the whole
# gradient (`num_params` elements, every bucket together) against the whole backward:

# %%
T_tokens, N_params = sp.symbols("num_tokens num_params", positive=True)
per_bucket = derive(
    "DP, one bucket against the whole backward",
    overlap.dp_comm_time(bucket, DP, peak_bw),
    overlap.dp_compute_time(T_tokens, N_params, peak_flops),
)
print()
dp = derive(
    "DP, the whole gradient against the whole backward",
    overlap.dp_comm_time(N_params, DP, peak_bw),
    overlap.dp_compute_time(T_tokens, N_params, peak_flops),
)
assert same(dp, overlap.dp_ratio(T_tokens, N_params, DP, peak_flops, peak_bw))
assert same(dp, 1 / (2 * T_tokens) * (DP - 1) / DP * peak_flops / peak_bw)
assert N_params not in dp.free_symbols

printed = N_params / (2 * T_tokens) * (DP - 1) / DP * peak_flops / peak_bw
assert same(printed, overlap.dp_ratio_as_printed(T_tokens, N_params, DP, peak_flops, peak_bw))
print(f"\nthe book's printed ratio / the derived one = {sp.simplify(printed / dp)}")

# %% [markdown]
# The parameter count **cancels**: the gradient has as many elements as there are parameters, and
# the backward does $4T$ FLOPs for each of them. What is left is
#
# $$\frac{t_\text{comm}}{t_\text{compute}} = \frac{1}{2\,\text{num\_tokens}} \cdot \frac{DP-1}{DP} \cdot \frac{\texttt{peak\_flops}}{\texttt{peak\_bw}},$$
#
# the same shape as ZeRO-3's with `num_tokens` in place of `seq · mbs`. The printed form is this
# times `num_params`, which cannot be meant: for any real model it would be in the billions, and DP
# could never overlap anything. It is what you get if `num_params` is dropped from $t_\text{compute}$
# while the whole gradient stays in $t_\text{comm}$. We quote it and plan with the derived form
# (`overlap.dp_ratio`); `overlap.dp_ratio_as_printed` exists only for this comparison.
#
# With the derived form, what each ratio depends on is plain to see:

# %%
ratios = {"DP": dp, "ZeRO-3": zero3, "TP": tp, "PP": pp}
for name, ratio in ratios.items():
    print(f"{name:>7} depends on {', '.join(sorted(str(s) for s in ratio.free_symbols))}")
assert {str(s) for s in tp.free_symbols} == {"h", "TP", "peak_flops", "peak_bw"}
assert {str(s) for s in pp.free_symbols} == {"h", "L_stage", "peak_flops", "peak_bw"}

# %% [markdown]
# | technique | the communication hides more easily with | indifferent to |
# |---|---|---|
# | DP | more tokens in the backward it overlaps (longer sequences, larger micro-batches; with gradient accumulation only the last micro-batch's backward counts) | the model's size |
# | ZeRO-3 | more tokens per micro-batch, `seq · mbs` | the model's size |
# | TP | a wider model, `h` | `seq`, `mbs` |
# | PP | a wider model and more layers per stage | `seq`, `mbs` |
#
# In every ratio the hardware enters only as `peak_flops / peak_bw`, the FLOPs the GPU can do in the
# time one byte crosses the link. It grows with every GPU generation (compute improves faster than
# links), which is why overlap matters more every year.
#
# ## 2. Numbers, and sliders
#
# An H100 SXM does about 989 TFLOP/s of dense bf16 matmul (the spec sheet; chapter 01 measures what
# a real model reaches). Its NVLink moves about 450 GB/s each way inside a node, and a 400 Gb/s
# InfiniBand port gives about 50 GB/s per GPU between nodes. These are assumptions taken from
# spec sheets, not measurements. In bf16 (2 bytes per element), for Llama 3 70B's width
# `h = 8192` and a micro-batch of one 4096-token sequence:

# %%
H100_FLOPS, NVLINK_BW, IB_BW = 989e12, 450e9, 50e9  # assumptions (spec sheets), see above
setting = dict(h=8192, seq=4096, mbs=1, tp=8, dp=64, layers_per_stage=4, peak_flops=H100_FLOPS, bytes_per_element=2)
for link, bw in (("NVLink (in a node)", NVLINK_BW), ("InfiniBand (between nodes)", IB_BW)):
    values = overlap.overlap_ratios(**setting, peak_bw=bw)
    print(f"{link:>27}: " + ", ".join(f"{k} {v:.3g}" for k, v in values.items()))
in_node = overlap.overlap_ratios(**setting, peak_bw=NVLINK_BW)
across = overlap.overlap_ratios(**setting, peak_bw=IB_BW)
assert all(np.isclose(across[k], in_node[k] * NVLINK_BW / IB_BW) for k in in_node)  # every ratio scales with 1/peak_bw
assert in_node["TP"] > 1 and across["PP"] < 1 and in_node["DP"] < 1 < across["DP"]

# %% tags=["nbval-ignore-output"]
# (measured only on a GPU; the sliders start from the spec-sheet number either way)
if torch.cuda.is_available():
    bf16 = overlap.measure_matmul_flops(8192, dtype=torch.bfloat16, device="cuda", repeats=10)
    print(
        f"this GPU: {bf16 / 1e12:.0f} TFLOP/s for an 8192² bf16 matmul (spec-sheet H100 peak: {H100_FLOPS / 1e12:.0f})"
    )
else:
    print("no GPU here: a GPU would measure its bf16 matmul FLOP/s in this cell")

# %% [markdown]
# Every ratio grows by the same factor, 9, when the link changes from NVLink to InfiniBand.
# Tensor parallelism is the one in trouble: at TP = 8 its collectives take about twice as long as
# the matmuls beside them even on NVLink, and about 17 times as long between nodes. That is the
# arithmetic behind keeping TP inside a node. Pipeline sends are tiny next to a stage's work, even
# between nodes. DP and ZeRO-3 hide at NVLink speed with one 4096-token sequence per rank, but at
# InfiniBand speed they would need about five times as many tokens in the backward (or forward) they
# overlap.
#
# The sliders below redraw the ratios for any setting (run the cell in JupyterLab; a saved notebook
# shows the figure for the default setting underneath). Bars above the dashed line mark
# communication that shows; the right panel follows all four ratios across model widths, with the
# chosen `h` marked.

# %%
POW2 = {
    "h": [2**k for k in range(10, 16)],
    "tp": [2**k for k in range(0, 7)],
    "dp": [2**k for k in range(1, 11)],
    "seq": [2**k for k in range(9, 18)],
    "mbs": [2**k for k in range(0, 6)],
    "layers_per_stage": [1, 2, 4, 8, 16, 32],
}
COLOURS = {"DP": "#4c72b0", "ZeRO-3": "#da8bc3", "TP": "#dd8452", "PP": "#55a868"}


def overlap_figure(
    h=8192, tp=8, dp=64, seq=4096, mbs=1, layers_per_stage=4, peak_tflops=989.0, peak_gbs=450.0, bytes_per_element=2
):
    """The four overlap ratios for one setting (left) and across model widths (right)."""
    knobs = dict(
        seq=seq,
        mbs=mbs,
        tp=tp,
        dp=dp,
        layers_per_stage=layers_per_stage,
        peak_flops=peak_tflops * 1e12,
        peak_bw=peak_gbs * 1e9,
        bytes_per_element=bytes_per_element,
    )
    values = overlap.overlap_ratios(h=h, **knobs)
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    bars, sweep = fig.subplots(1, 2)
    bars.bar(list(values), list(values.values()), color=["#c44e52" if v > 1 else "#55a868" for v in values.values()])
    for i, v in enumerate(values.values()):
        bars.text(i, v, f"{v:.2g}", ha="center", va="bottom", fontsize=8)
    bars.axhline(1, color="black", ls="--", lw=1)
    bars.set(
        yscale="log",
        ylabel="t_comm / t_compute",
        title=f"h {h}, TP {tp}, DP {dp}, seq {seq}, mbs {mbs}, {layers_per_stage} layers/stage",
    )
    widths = np.array([2.0**k for k in np.arange(9, 16.01, 0.25)])
    for name, colour in COLOURS.items():
        sweep.plot(
            widths, overlap.overlap_ratios(h=widths, **knobs)[name] * np.ones_like(widths), color=colour, label=name
        )
    sweep.axhspan(1, 1e6, color="#c44e52", alpha=0.08, label="communication shows")
    sweep.axvline(h, color="black", lw=0.8, ls=":")
    sweep.set(
        xscale="log",
        yscale="log",
        xlabel="hidden size h",
        ylim=(1e-4, 1e3),
        title=f"{peak_tflops:g} TFLOP/s, {peak_gbs:g} GB/s, {bytes_per_element} bytes per element",
    )
    sweep.legend(fontsize=8, loc="upper right")
    return fig


def overlap_widget():
    import ipywidgets as w

    def stops(name, value):
        return w.SelectionSlider(options=POW2[name], value=value, description=name, continuous_update=False)

    controls = dict(
        h=stops("h", 8192),
        tp=stops("tp", 8),
        dp=stops("dp", 64),
        seq=stops("seq", 4096),
        mbs=stops("mbs", 1),
        layers_per_stage=stops("layers_per_stage", 4),
        peak_tflops=w.FloatLogSlider(value=989, base=10, min=0, max=4, description="TFLOP/s", continuous_update=False),
        peak_gbs=w.FloatLogSlider(value=450, base=10, min=0, max=3.5, description="GB/s", continuous_update=False),
        bytes_per_element=w.Dropdown(options=[1, 2, 4], value=2, description="bytes/elem"),
    )
    image = w.Image(format="png")

    def redraw(_=None):
        buffer = io.BytesIO()
        overlap_figure(**{k: c.value for k, c in controls.items()}).savefig(buffer, format="png", dpi=80)
        image.value = buffer.getvalue()

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    boxes = list(controls.values())
    # saved without a kernel, the widget's text is this line rather than the widget tree
    return with_text_repr(w.VBox, "[overlap sliders: run this cell in JupyterLab to move them]")(
        [w.HBox([w.VBox(boxes[:5]), w.VBox(boxes[5:])]), image]
    )


# %% tags=["nbval-ignore-output"]
# (a widget is an interactive view, different in every session: its output is not compared)
overlap_widget()

# %%
overlap_figure()

# %% [markdown]
# A few things to try with the sliders: halve `peak_gbs` and watch TP cross the line first; raise
# `seq` and see DP and ZeRO-3 fall while TP and PP stay put; set `tp` to 1 (TP then sends nothing)
# or `dp` to 2 (the factor $(DP-1)/DP$ is only 1/2 there).
#
# How wide a model must be for TP to hide at a given degree, and how many layers a pipeline stage
# needs, follow directly from the ratios. For the H100 numbers above, in bf16:

# %%
for degree in (2, 4, 8):
    # (TP-1)/(2h) · 2 · F/B <= 1  <=>  h >= (TP-1) · F/B
    min_h = (degree - 1) * H100_FLOPS / NVLINK_BW
    assert overlap.tp_ratio(min_h, degree, H100_FLOPS, NVLINK_BW, bytes_per_element=2) <= 1 + 1e-12
    print(f"TP {degree} over NVLink hides its collectives from h = {min_h:,.0f} on")
# 2 · F/(32 h L B) <= 1  <=>  L >= 2F/(32 h B)
min_layers = int(np.ceil(2 * H100_FLOPS / (32 * 8192 * IB_BW)))
assert overlap.pp_ratio(8192, min_layers, H100_FLOPS, IB_BW, bytes_per_element=2) <= 1
assert min_layers == 1 or overlap.pp_ratio(8192, min_layers - 1, H100_FLOPS, IB_BW, bytes_per_element=2) > 1
print(f"PP between nodes (h = 8192): {min_layers} layer(s) per stage already hide the sends")

# %% [markdown]
# ## 3. Calibrating on this machine
#
# Now the question the formulas are for: given *this* machine, will a given step hide its
# communication? We need its two numbers, measured on every rank at once (the ranks share this
# machine's cores, as they do in the training steps below), timed as appendix A1 teaches: warm-up
# calls, several repeats, the median.
#
# - `peak_flops`, two ways: the FLOP/s of a square 512 × 512 fp32 matmul
#   (`overlap.measure_matmul_flops`), the usual "peak"; and the FLOP/s the two small models of
#   chapters 02 and 03 *achieve* in a forward and backward without any communication
#   (`model.training_flops` over the measured time). Their matrices are a few dozen rows wide and
#   Python runs between every operator, so they reach only a fraction of the peak: their model
#   FLOPs utilisation (chapter 01).
# - `peak_bw`: gloo's bus bandwidth (`comm.bus_bandwidth_sweep`, nccl-tests conventions) for an
#   all-reduce and an all-gather, at the message sizes the two steps actually send. Small messages
#   do not reach the plateau of appendix A0's sweep, and what matters is the speed at the sizes in use.
#
# Both depend on this machine and on what else it is doing, so their outputs are not compared
# when the notebook is re-run.

# %%
DP_CONFIG = GPTConfig(vocab_size=256, hidden=64, layers=4, heads=4, seq_len=32)  # chapter 02 (QUICK)
DP_MBS, DP_BUCKET_MB = 2, 0.25
ZERO_CONFIG = GPTConfig(vocab_size=256, hidden=128, layers=6, heads=4, seq_len=64)  # chapter 03's timeline model
ZERO_MBS = 4
FP32 = 4  # bytes per element: these CPU runs train in fp32
dp_bytes = FP32 * count_params(DP_CONFIG)
zero_block_params = sum(p.numel() for p in GPT(ZERO_CONFIG).blocks[0].parameters())
print(
    f"chapter 02's DP: {format_bytes(dp_bytes)} of gradients in buckets closed at {DP_BUCKET_MB} MiB; "
    f"chapter 03's ZeRO-3: blocks of {format_bytes(FP32 * zero_block_params)}"
)

cluster = Cluster(WORLD_SIZE, backend="gloo")  # gloo and CPU tensors, on any machine
REPEATS = 3 if QUICK else 15


def achieved_flops(ctx, config, mbs, repeats):
    """FLOP/s of forward + backward of the course GPT on this rank, without communication."""
    torch.manual_seed(SEED)
    model = GPT(config).to(ctx.device)
    batch = Batches(config, mbs=mbs, seed=SEED).rank_batch(ctx.rank, ctx.world_size, 0).to(ctx.device)
    seconds = []
    for i in range(1 + repeats):  # one warm-up step
        wait_for_device(ctx.device)  # on a GPU: time the kernels, not their launch
        start = time.perf_counter()
        batch.loss(model).backward()
        wait_for_device(ctx.device)
        if i >= 1:
            seconds.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return training_flops(config, mbs * config.seq_len, config.seq_len) / statistics.median(seconds)


def calibrate(ctx, sizes, repeats):
    dist.barrier()
    flops = {
        "matmul 512": overlap.measure_matmul_flops(512, device=ctx.device, repeats=repeats),
        "chapter 02 model": achieved_flops(ctx, DP_CONFIG, DP_MBS, repeats),
        "chapter 03 model": achieved_flops(ctx, ZERO_CONFIG, ZERO_MBS, repeats),
    }
    bandwidth = {op: bus_bandwidth_sweep(ctx, sizes[op], op=op, iters=repeats) for op in sizes}
    return flops, bandwidth


sizes = {"all_reduce": [int(DP_BUCKET_MB * 2**20)], "all_gather": [FP32 * zero_block_params]}
calibration = cluster.run(calibrate, sizes, REPEATS)

# %% tags=["nbval-ignore-output"]
FLOPS = {name: statistics.median(flops[name] for flops, _ in calibration) for name in calibration[0][0]}
BW = {op: points[0]["busbw"] for op, points in calibration[0][1].items()}  # the same on every rank
for name, value in FLOPS.items():
    print(f"{name:>17}: {value / 1e9:6.2f} GFLOP/s per rank, {WORLD_SIZE} ranks busy at once")
for op, points in calibration[0][1].items():
    p = points[0]
    print(
        f"gloo {op:>10} of {format_bytes(p['size']):>10}: {1e3 * p['time_s']:.2f} ms, "
        f"bus bandwidth {p['busbw'] / 1e9:.3f} GB/s"
    )
print(
    f"peak_flops / peak_bw = {FLOPS['matmul 512'] / BW['all_reduce']:.0f} FLOPs per byte with the matmul peak "
    f"(an H100 over NVLink: {H100_FLOPS / NVLINK_BW:.0f})"
)

# %%
assert all(value > 0 for value in FLOPS.values()) and all(bw > 0 for bw in BW.values())

# %% [markdown]
# ## 4. Predictions for chapters 02 and 03
#
# **Chapter 02, bucketed DP**: each rank's backward runs `MBS · seq` tokens, and the whole fp32
# gradient is all-reduced in buckets during that backward. **Chapter 03, ZeRO-3 with prefetch**: each
# block's all-gather (fp32) runs during the previous block's forward of `mbs · seq` tokens. The
# derived ratios with this machine's numbers, once with the matmul peak and once with the FLOP/s
# each model achieves:

# %% tags=["nbval-ignore-output"]
dp_tokens = DP_MBS * DP_CONFIG.seq_len


def predict(name, flops):
    if name == "bucketed DP":
        return (
            overlap.dp_comm_time(dp_bytes, WORLD_SIZE, BW["all_reduce"]),
            overlap.dp_compute_time(dp_tokens, count_params(DP_CONFIG), flops),
        )
    return (
        overlap.zero3_comm_time(zero_block_params, WORLD_SIZE, BW["all_gather"], FP32),
        overlap.zero3_compute_time(zero_block_params, ZERO_CONFIG.seq_len, ZERO_MBS, flops),
    )


prediction = {}
for name, model_flops in (("bucketed DP", "chapter 02 model"), ("ZeRO-3 prefetch", "chapter 03 model")):
    for label, flops in (("matmul peak", FLOPS["matmul 512"]), ("achieved", FLOPS[model_flops])):
        t_comm, t_compute = predict(name, flops)
        prediction[name, label] = t_comm / t_compute
        print(
            f"{name:>16}, {label:>11} FLOP/s: t_comm {1e3 * t_comm:6.2f} ms, t_compute {1e3 * t_compute:6.2f} ms, "
            f"ratio {t_comm / t_compute:6.2f}: communication {'can hide' if t_comm <= t_compute else 'will show'}"
        )
# the library's closed forms give the same ratios
assert np.isclose(
    prediction["bucketed DP", "achieved"],
    overlap.dp_ratio(
        dp_tokens,
        count_params(DP_CONFIG),
        WORLD_SIZE,
        FLOPS["chapter 02 model"],
        BW["all_reduce"],
        bytes_per_element=FP32,
    ),
)
assert np.isclose(
    prediction["ZeRO-3 prefetch", "achieved"],
    overlap.zero3_ratio(
        ZERO_CONFIG.seq_len, ZERO_MBS, WORLD_SIZE, FLOPS["chapter 03 model"], BW["all_gather"], bytes_per_element=FP32
    ),
)

# %% [markdown]
# ## 5. ...and what the timelines say
#
# We run one step of each, from the library, as the chapters do: `apply_data_parallel(kind="bucketed")`
# on chapter 02's model and micro-batch, and `apply_zero(stage=3, prefetch=True)` on chapter 03's
# timeline model. A `Timeline` records every block's forward and backward (`instrument`) and every
# collective from launch to completion; a first step warms up, the second is kept.


# %%
def record_dp_step(ctx):
    torch.manual_seed(SEED)
    model = GPT(DP_CONFIG).to(ctx.device)
    timeline = Timeline(ctx.rank, device=ctx.device)
    dp_model = apply_data_parallel(model, None, kind="bucketed", bucket_cap_mb=DP_BUCKET_MB, timeline=timeline)
    timeline.instrument(model.blocks)
    data = Batches(DP_CONFIG, mbs=DP_MBS, seed=SEED)
    for step in range(2):
        timeline.clear()
        dist.barrier()
        with CommLogger() as log:
            data.rank_batch(ctx.rank, ctx.world_size, step).to(ctx.device).loss(dp_model).backward()
            dp_model.finish_gradient_synchronization()
        model.zero_grad(set_to_none=True)
    return timeline.rows(), log.collective_elements(), dp_model.bucket_sizes


def record_zero3_step(ctx):
    torch.manual_seed(SEED)
    model = GPT(ZERO_CONFIG).to(ctx.device)
    timeline = Timeline(ctx.rank, device=ctx.device)
    zero = apply_zero(model, None, stage=3, prefetch=True, timeline=timeline, lr=1e-3).zero_optimizer
    timeline.instrument(model.blocks)  # after ZeRO's hooks: waiting for a gather is not counted as compute
    data = Batches(ZERO_CONFIG, mbs=ZERO_MBS, seed=SEED)
    for step in range(2):
        timeline.clear()
        dist.barrier()
        data.rank_batch(ctx.rank, ctx.world_size, step).to(ctx.device).loss(model).backward()
        zero.step()
        zero.zero_grad()
    return timeline.rows(), [u.padded for u in zero.units]


runs = {}
for name in ProgressBar("recording one step of each").iterate(["bucketed DP", "ZeRO-3 prefetch"]):
    runs[name] = cluster.run(record_dp_step if name == "bucketed DP" else record_zero3_step)

# %% [markdown]
# First, the bytes. The prediction divided *these* bytes by the bandwidth, so they must be what the
# library moved, exactly. DP all-reduces every gradient element once (`CommLogger` counts the
# buckets' elements); ZeRO-3 moves each block three times (gather, gather again, reduce-scatter),
# except the last block, whose parameters backward finds still gathered (counted from the
# timeline's collective bars, which carry each buffer's bytes, padding included).

# %%
for rows, elements, buckets in runs["bucketed DP"]:
    assert elements["all_reduce elements"] == count_params(DP_CONFIG) == sum(buckets) // FP32
    assert elements["all_reduce"] == len(buckets)
print(
    f"bucketed DP: {len(buckets)} all-reduces of {', '.join(format_bytes(b) for b in buckets)} "
    f"= every gradient element once ({count_params(DP_CONFIG):,})"
)

for rows, padded in runs["ZeRO-3 prefetch"]:
    for i, numel in enumerate(padded):
        moved = sum(e["nbytes"] for e in rows if e["lane"] == "communication" and e["name"].endswith(f" unit {i}"))
        assert moved == (3 if i < len(padded) - 1 else 2) * FP32 * numel, (i, moved, numel)
print(
    f"ZeRO-3: each of the first {len(padded) - 1} blocks moved 3 x its {FP32 * padded[0]:,} bytes "
    f"(padded to a multiple of {WORLD_SIZE} elements), the last one 2 x"
)

# %% [markdown]
# Then the timelines, and the comparison. For each step: the time communication kept the link
# busy, the time the blocks computed, their quotient (the measured counterpart of the ratio), and
# the share of the communication that ran while a block was computing.


# %% tags=["nbval-ignore-output"]
def lane_seconds(rows, rank, lane, prefix=""):
    return covered_seconds(
        [
            (e["start"], e["end"])
            for e in rows
            if e["rank"] == rank and e["lane"] == lane and e["name"].startswith(prefix)
        ]
    )


fig = Figure(figsize=(11, 1.2 * WORLD_SIZE + 2.4))
axes = fig.subplots(2, 1)
measured = {}
for ax, (name, per_rank) in zip(axes, runs.items()):
    rows = [e for result in per_rank for e in result[0] if not e["name"].startswith(("grad ready", "step"))]
    plot_gantt(rows, ax=ax, title=f"{name}: one step")
    comm = [lane_seconds(rows, r, "communication") for r in range(WORLD_SIZE)]
    compute = [lane_seconds(rows, r, "compute") for r in range(WORLD_SIZE)]
    hidden = overlap_seconds(rows) / sum(comm)
    measured[name] = (statistics.median(c / p for c, p in zip(comm, compute)), hidden)
for name, (ratio, hidden) in measured.items():
    print(
        f"{name:>16}: predicted ratio {prediction[name, 'matmul peak']:.2f} (matmul peak), "
        f"{prediction[name, 'achieved']:.2f} (achieved FLOP/s); measured comm/compute {ratio:.2f}, "
        f"{hidden:.0%} of the communication overlapped a block"
    )
fig

# %% [markdown]
# How to read it. A prediction is a statement about the work and the hardware: with these bytes,
# this bandwidth and these FLOP/s, the transfer fits (or does not fit) in the time of the work. The
# timeline shows what one implementation achieved on one busy machine. On a CPU the two part ways for
# reasons worth knowing:
#
# - **which FLOP/s**: with the matmul peak, the predicted compute is far shorter than the real one,
#   because these tiny models achieve a small fraction of the peak. The ratio must use the FLOP/s
#   the work really runs at. (On GPUs, large models reach 30 to 50% of the peak, chapter 01's MFU.)
# - **what is compared**: the measured quotient is over the whole step, every collective against
#   every block's forward and backward; the ZeRO-3 ratio is about one gather against one forward.
#   They tell the same story only roughly.
# - **a shared "link"**: gloo moves the bytes with the same CPU cores that compute, so here a
#   transfer and a matmul compete for the same two cores, overlap buys less, and every measured bar
#   is stretched by the other ranks' work. A GPU differs in degree, not in kind (the fact printed
#   below): NCCL's collectives are kernels on the same SMs as the matmuls, so a hidden transfer
#   still slows the compute it hides behind. The ratios above say whether the transfer *can* hide;
#   what hiding costs is measured, never zero.
# - **latency**: the ratio is about bandwidth. Each all-reduce or all-gather also pays a fixed cost
#   per ring step (appendix A0's α), and these messages are small; measuring the bandwidth at their
#   real size folds that cost in, on average.
# - **the tail**: DP can start its last bucket only when backward is done, and ZeRO-3's first
#   gather has no earlier block to hide behind, so a little always shows, whatever the ratio.
#
# What carries over to GPUs is the method: count the bytes exactly (checked above), measure the
# bandwidth and the FLOP/s the work achieves, and divide. Chapter 10's planner does exactly this with `overlap.overlap_ratios`.

# %%
print(facts.OVERLAP_ON_GPUS)

# %% [markdown]
# ## Summary
#
# | technique | $t_\text{comm} / t_\text{compute}$ | grows with | shrinks with |
# |---|---|---|---|
# | DP (derived) | $\frac{1}{2\,T}\frac{DP-1}{DP}\frac{F}{B}$ | $F/B$ | tokens per rank $T$ |
# | ZeRO-3 | $\frac{1}{2\,seq\,mbs}\frac{DP-1}{DP}\frac{F}{B}$ | $F/B$ | $seq \cdot mbs$ |
# | TP | $\frac{TP-1}{2h}\frac{F}{B}$ | TP degree, $F/B$ | $h$ |
# | PP | $\frac{F}{32\,h\,L_\text{stage}\,B}$ | $F/B$ | $h$, layers per stage |
#
# with $F$ = `peak_flops` and $B$ = `peak_bw` (bus bandwidth); the book's printed DP ratio carries
# an extra factor `num_params` that its own two lines do not give.
#
# ## Your turn
# Open [exercises/a3_overlap_math_exercises.ipynb](../exercises/a3_overlap_math_exercises.ipynb): derive the DP ratio in code (and see the printed one
# rejected), then turn the TP and PP ratios into the largest TP degree and the smallest pipeline
# stage that still hide their communication, and compute how long a step still waits after its
# backward for bucketed all-reduces.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/a3_overlap_math_exercises.ipynb` grades
# the whole notebook from a terminal.

# %%
cluster.close()
