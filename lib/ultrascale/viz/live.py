"""Live views of a running ``Cluster.run`` call: a plot and a progress bar.

Both are callables with the ``on_log(rank, metrics)`` signature, so they plug into
``cluster.run(fn, on_log=...)``; ``fan_out`` sends the same metrics to several.
In a notebook they update in place (one display, redrawn at most a few times a
second so the ranks never wait on matplotlib); the last frame stays in the
notebook, which is what papermill and nbval see when run headless.
"""

from __future__ import annotations

import time
from collections import defaultdict

import matplotlib.pyplot as plt


def _display(obj, display_id=None, update=False):
    try:
        from IPython.display import display, update_display
    except ImportError:
        return None
    if update:
        update_display(obj, display_id=display_id)
        return display_id
    return display(obj, display_id=True)


class LivePlot:
    """Plot metrics against a step, one line per rank, redrawn while the call runs.

        plot = LivePlot("loss", x="step")
        cluster.run(train, on_log=plot)
        plot.finish()          # draw the final frame (also returned for saving)
    """

    def __init__(self, *metrics: str, x: str = "step", ranks="all", title: str = "",
                 logy: bool = False, every: float = 0.25):
        self.metrics, self.x, self.ranks = metrics, x, ranks
        self.title, self.logy, self.every = title, logy, every
        self.data = defaultdict(lambda: defaultdict(list))  # (metric) -> rank -> [(x, y)]
        self._last_draw = 0.0
        self._handle = None
        self.fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.2), squeeze=False)
        self.axes = axes[0]
        plt.close(self.fig)  # we display it ourselves; keep pyplot from showing it twice

    def __call__(self, rank: int, metrics: dict) -> None:
        if self.ranks != "all" and rank not in self.ranks:
            return
        if self.x not in metrics:
            return
        for name in self.metrics:
            if name in metrics:
                self.data[name][rank].append((metrics[self.x], metrics[name]))
        if time.monotonic() - self._last_draw > self.every:
            self._draw()

    def _draw(self) -> None:
        for ax, name in zip(self.axes, self.metrics):
            ax.clear()
            for rank in sorted(self.data[name]):
                xs, ys = zip(*self.data[name][rank])
                ax.plot(xs, ys, marker=".", label=f"rank {rank}")
            ax.set_xlabel(self.x)
            ax.set_ylabel(name)
            if self.logy:
                ax.set_yscale("log")
            if self.data[name]:
                ax.legend(fontsize="small")
        if self.title:
            self.fig.suptitle(self.title)
        self.fig.tight_layout()
        if self._handle is None:
            self._handle = _display(self.fig)
        else:
            _display(self.fig, display_id=self._handle.display_id, update=True)
        self._last_draw = time.monotonic()

    def finish(self):
        """Draw the final frame and return the figure."""
        self._draw()
        return self.fig


class ProgressBar:
    """A progress bar fed by ``ctx.log(done=..., total=...)`` from one rank (rank 0)."""

    def __init__(self, description: str = "", rank: int = 0):
        self.rank = rank
        self.bar = None
        try:
            import ipywidgets

            self.bar = ipywidgets.IntProgress(value=0, min=0, max=1, description=description)
            _display(self.bar)
        except ImportError:
            pass

    def __call__(self, rank: int, metrics: dict) -> None:
        if rank != self.rank or "done" not in metrics:
            return
        if self.bar is not None:
            self.bar.max = max(int(metrics.get("total", self.bar.max)), 1)
            self.bar.value = int(metrics["done"])


def fan_out(*callbacks):
    """One ``on_log`` that feeds every callback (e.g. a plot and a progress bar)."""

    def on_log(rank, metrics):
        for cb in callbacks:
            cb(rank, metrics)

    return on_log

