"""The simulator as an interactive view: pick a schedule, p, m and v, see its timeline.

``schedule_figure(name, p, m, v)`` is the static drawing (headless, CI); ``schedule_widget()``
wraps it in ipywidgets controls that redraw on change, with the numbers the book reasons
with underneath: the simulated bubble against the formula, and the activations each rank
holds at once. A choice the schedules refuse (DualPipeV with m < 2p, interleaving with
fewer micro-batches than ranks, ...) shows the generator's message instead of a figure.
"""

from __future__ import annotations

import io

from ..schedule.generators import CHUNKS, SCHEDULES, make_schedule
from ..schedule.simulate import predicted_bubble_fraction, simulate
from .live import with_text_repr
from .schedule import draw

PLACEHOLDER = "[pipeline simulator: run this cell in JupyterLab for its menus and sliders]"
ONE_CHUNK = ("naive", "afab", "1f1b", "zb-h1")  # schedules with one stage per rank


def schedule_figure(name: str = "1f1b", p: int = 4, m: int = 8, v: int | None = None, t_b: float = 2.0):
    """The simulated timeline of a schedule by name (``generators.SCHEDULES``), and its summary."""
    v = 1 if name in ONE_CHUNK else (CHUNKS.get(name, 1) if v is None else v)
    sim = simulate(make_schedule(name, p, m, v), t_f=1.0, t_b=t_b)
    return draw(sim), summary(sim)


def summary(sim) -> str:
    """One line of what the figure shows, with the book's formula beside the simulated bubble."""
    s = sim.schedule
    formula = predicted_bubble_fraction(s.ranks, s.microbatches, s.chunks)
    return (
        f"{s.name}: bubble {sim.bubble_fraction:.3f} (formula (p-1)/(v m) = {formula:.3f}); "
        f"activations held at once per rank {sim.peak_activations} (micro-batch x chunk pairs)"
    )


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    return buffer.getvalue()


def schedule_widget(name: str = "1f1b", p: int = 4, m: int = 8, v: int = 2):
    """Menus and sliders for ``schedule_figure``; redraws when a control is let go."""
    import ipywidgets as w

    controls = {
        "name": w.Dropdown(options=list(SCHEDULES), value=name, description="schedule"),
        "p": w.IntSlider(value=p, min=1, max=8, description="p (ranks)", continuous_update=False),
        "m": w.IntSlider(value=m, min=1, max=32, description="m (micro)", continuous_update=False),
        "v": w.IntSlider(value=v, min=1, max=4, description="v (chunks)", continuous_update=False),
    }
    image, message = w.Image(format="png"), w.HTML()

    def redraw(_=None):
        values = {key: c.value for key, c in controls.items()}
        if values["name"] == "naive":  # the whole batch at once: m is 1 by definition
            values["m"] = 1
        try:
            fig, text = schedule_figure(**values)
            image.value, message.value = _png(fig), text
        except ValueError as error:  # the generators' own explanation of what cannot be built
            message.value = f"<b style='color:#C44E52'>Cannot build: {error}</b>"

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return with_text_repr(w.VBox, PLACEHOLDER)([w.HBox(list(controls.values())), message, image])
