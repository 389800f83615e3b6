"""Reading what ``torch.profiler`` recorded: the memory timeline by category, step spans.

The profiler already knows, for every allocation it saw, what the tensor was: a parameter,
a gradient, an optimizer state, an activation saved for backward, a temporary... (its
memory profiler infers this from the autograd graph and the optimizer's state). PyTorch
exposes that through ``prof.export_memory_timeline``, which writes a file and is marked
deprecated in favour of the CUDA-only allocator snapshots. On a CPU the profiler is still
the only way to get the categories, so ``memory_timeline`` reads the same data directly,
as arrays, without writing a file.

    with torch.profiler.profile(record_shapes=True, profile_memory=True, with_stack=True) as prof:
        for i in range(3):
            with torch.profiler.record_function(f"step {i}"):
                train_step()
    times, sizes = memory_timeline(prof)
    plot_memory_timeline(times, sizes, step_spans(prof, "step "))
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np


@contextlib.contextmanager
def quiet_native_stderr():
    """Silence what C++ code writes to stderr inside the block (the profiler's library,
    Kineto, prints a "USDT: ... profiler_start" line on every start and stop). Python's
    own warnings and exceptions are not affected: only file descriptor 2 is redirected."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# The profiler's categories, in the order its timeline stores them, with friendlier names.
CATEGORY_NAMES = {
    "PARAMETER": "parameters",
    "OPTIMIZER_STATE": "optimizer states",
    "INPUT": "inputs",
    "TEMPORARY": "temporaries",
    "ACTIVATION": "activations",
    "GRADIENT": "gradients",
    "AUTOGRAD_DETAIL": "autograd detail",
    None: "unknown",
}
COLORS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer states": "#55A868",
    "activations": "#C44E52",
    "inputs": "#8172B3",
    "temporaries": "#937860",
    "autograd detail": "#DA8BC3",
    "unknown": "#8C8C8C",
}


def _trace_start_us(prof) -> float:
    return prof.profiler.kineto_results.trace_start_ns() / 1000


def memory_timeline(prof, device: str = "cpu"):
    """Bytes alive on ``device`` over time, split by what the profiler says each tensor is.

    Returns ``(times_ms, sizes)``: times in milliseconds since the profiler started, and a
    dict {category name: bytes alive at each time}. The profile must have been recorded with
    ``record_shapes=True, profile_memory=True, with_stack=True`` (the profiler needs all
    three to categorise tensors). Tensors that existed before profiling started (the
    parameters, say) count from the first time point.
    """
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    timeline = MemoryProfileTimeline(prof._memory_profile())  # what export_memory_timeline uses
    times_us, sizes = timeline._coalesce_timeline(device)
    sizes = np.asarray(sizes, dtype=np.int64)
    names = [CATEGORY_NAMES[None if c is None else c.name] for c in _CATEGORY_TO_INDEX]
    # column 0 of the timeline is unused; the categories follow in _CATEGORY_TO_INDEX order
    by_category = {name: sizes[:, i + 1] for i, name in enumerate(names)}
    times_ms = (np.asarray(times_us, dtype=np.float64) - _trace_start_us(prof)) / 1000
    return times_ms, by_category


def step_spans(prof, prefix: str) -> list:
    """``[(name, start_ms, end_ms)]`` of the ``record_function`` ranges whose name starts with
    ``prefix``, on the same clock as ``memory_timeline``, in order."""
    spans = [
        (e.name, e.time_range.start / 1000, e.time_range.end / 1000) for e in prof.events() if e.name.startswith(prefix)
    ]
    return sorted(spans, key=lambda span: span[1])


def bytes_at(times_ms, series, t_ms) -> int:
    """The value of a timeline series at time ``t_ms`` (the last point at or before it)."""
    i = int(np.searchsorted(times_ms, t_ms, side="right")) - 1
    return int(series[max(i, 0)])


def peak_within(times_ms, series, start_ms, end_ms) -> int:
    """The largest value of a timeline series between two times."""
    inside = (times_ms >= start_ms) & (times_ms <= end_ms)
    return int(series[inside].max()) if inside.any() else bytes_at(times_ms, series, start_ms)


def plot_memory_timeline(times_ms, sizes: dict, spans=(), ax=None, unit: float = 2**20):
    """Stacked areas of bytes alive by category (MiB by default), with step spans shaded."""
    if ax is None:  # a Figure outside pyplot: shown where a notebook cell returns it, also headless
        from matplotlib.figure import Figure

        ax = Figure(figsize=(10, 3.5), layout="constrained").subplots()
    shown = {name: series / unit for name, series in sizes.items() if series.any()}
    ax.stackplot(
        times_ms,
        *shown.values(),
        labels=list(shown),
        colors=[COLORS.get(name, "#8C8C8C") for name in shown],
        step="post",
    )
    for i, (name, start, end) in enumerate(spans):
        if i % 2 == 0:
            ax.axvspan(start, end, color="black", alpha=0.06, linewidth=0)
        ax.text((start + end) / 2, ax.get_ylim()[1], name, ha="center", va="top", fontsize=8)
    ax.set_xlabel("time since the profiler started (ms)")
    ax.set_ylabel("MiB alive" if unit == 2**20 else f"bytes / {unit:g}")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    return ax


def chrome_trace_events(path) -> list:
    """The events of a Chrome trace written by the profiler (``prof.export_chrome_trace`` or
    ``tensorboard_trace_handler``); open the same file in https://ui.perfetto.dev or
    chrome://tracing to see it drawn."""
    import gzip
    import json

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]
