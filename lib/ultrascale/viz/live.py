"""Live views of a running ``Cluster.run`` call: a plot and a progress bar.

Both are callables with the ``on_log(rank, metrics)`` signature, so they plug into
``cluster.run(fn, on_log=...)``; ``fan_out`` sends the same metrics to several.
In a notebook they update in place (one display, redrawn at most a few times a
second so the ranks never wait on matplotlib); the last frame stays in the
notebook, which is what papermill and nbval see when run headless.

The progress bar is an ipywidgets widget. A saved notebook keeps, beside the widget,
a plain-text form for whatever cannot draw it (GitHub, a notebook opened without
its kernel, nbval's comparison of outputs); ``with_text_repr`` makes that text say
what the widget is, the same on every run, instead of its internal state.
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

    def __init__(
        self, *metrics: str, x: str = "step", ranks="all", title: str = "", logy: bool = False, every: float = 0.25
    ):
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
    """A progress bar for long work, fed by the ranks or by a loop in the notebook.

        bar = ProgressBar("training", total=steps)
        cluster.run(train, on_log=bar)     # rank 0 calls ctx.log(done=step + 1)
        for x in bar.iterate(items): ...   # or: one step per item of a loop here
        bar.advance()                      # or: one step, wherever the work is

    From the ranks it reads ``done`` (and ``total``, if the ranks know it better)
    in the metrics of ``ctx.log``, from rank ``rank`` only. Beside the bar: the count
    and the time so far ("3/8, 12 s"; "8/8 in 45 s" once full). Its saved plain text is
    ``[progress bar: <description>]``, the same on every run (the time is in the widget only).
    """

    def __init__(self, description: str = "", total: int = 1, rank: int = 0):
        self.rank, self.description = rank, description
        self.done, self.total = 0, max(int(total), 1)
        self.started = time.monotonic()
        self.bar = self.label = None
        try:
            import ipywidgets
        except ImportError:
            return  # no widgets: the work runs without a bar
        # description_width "initial": the whole description shows, not the first few letters.
        self.bar = ipywidgets.IntProgress(
            value=0, min=0, max=self.total, description=description, style={"description_width": "initial"}
        )
        self.label = ipywidgets.Label(self.status())  # "3/8, 12 s": how far, and how long so far
        box_class = with_text_repr(ipywidgets.HBox, f"[progress bar: {description}]")
        _display(box_class([self.bar, self.label]))

    def status(self) -> str:
        """``done/total`` and the time since the bar was made ("in ..." once it is full)."""
        seconds = time.monotonic() - self.started
        elapsed = f"{seconds:.0f} s" if seconds < 60 else f"{int(seconds // 60)} min {seconds % 60:02.0f} s"
        done = min(self.done, self.total)
        return f"{done}/{self.total} in {elapsed}" if done >= self.total else f"{done}/{self.total}, {elapsed}"

    def __call__(self, rank: int, metrics: dict) -> None:
        if rank != self.rank or "done" not in metrics:
            return
        self.update(int(metrics["done"]), metrics.get("total"))

    def update(self, done: int, total: int | None = None) -> None:
        """Show ``done`` of ``total`` (the total given before, if None)."""
        if total is not None:
            self.total = max(int(total), 1)
        self.done = done
        if self.bar is not None:
            self.bar.max = self.total
            self.bar.value = min(done, self.total)
            self.label.value = self.status()
            if done >= self.total:
                self.bar.bar_style = "success"

    def advance(self, steps: int = 1) -> None:
        """Move the bar ``steps`` forward (for loops that ``iterate`` does not fit)."""
        self.update(self.done + steps)

    def iterate(self, items):
        """Yield ``items`` one by one, moving the bar one step after each."""
        items = list(items)
        self.update(0, len(items))
        for i, item in enumerate(items, start=1):
            yield item
            self.update(i)


def with_text_repr(widget_class, text: str):
    """A subclass of an ipywidgets class whose plain-text form is ``text``.

    A widget's plain text is its repr, e.g. ``IntProgress(value=0, max=1)`` or, for a
    container, ``VBox(children=(HBox(children=...`` cut at 110 characters: what a saved
    notebook shows where the widget cannot be drawn. ``text`` should say what is there.
    """

    class Labelled(widget_class):
        def __repr__(self):
            return text

    Labelled.__name__ = Labelled.__qualname__ = widget_class.__name__
    return Labelled


def fan_out(*callbacks):
    """One ``on_log`` that feeds every callback (e.g. a plot and a progress bar)."""

    def on_log(rank, metrics):
        for cb in callbacks:
            cb(rank, metrics)

    return on_log
