"""Interactive memory breakdown of one GPU: parameters, gradients, optimizer states, activations.

``memory_figure(**inputs)`` draws a static matplotlib Figure (works headless, in CI and
papermill); ``memory_widget()`` wraps it in ipywidgets controls that redraw on change:
a preset menu and number boxes for the model's shape, sliders for the sequence length,
the micro-batch and the TP, DP and PP degrees, menus and checkboxes for the rest.
Both take the same input names, and both draw ``ultrascale.memory.breakdown``.
"""

from __future__ import annotations

import io

from matplotlib.figure import Figure

from ..memory import GB, breakdown
from ..model import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, LlamaConfig
from .live import with_text_repr

PRESETS = {"Llama 3 8B": LLAMA3_8B, "Llama 3 70B": LLAMA3_70B, "Llama 3 405B": LLAMA3_405B}
# the model's shape: set by a preset, editable one by one
SHAPE = {
    "heads": "heads",
    "kv_heads": "kv_heads",
    "hidden": "hidden",
    "ffn": "ffn",
    "layers": "layers",
    "vocab": "vocab_size",
}
DEFAULTS = dict(
    seq=4096,
    micro_batch=1,
    mixed_precision=True,
    fp32_grad_accum=False,
    recompute="none",
    zero_stage=0,
    tp=1,
    dp=1,
    pp=1,
    k=12,
)
COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer states": "#55A868", "activations": "#C44E52"}
GPU_GB = 80  # an H100's memory, the line a configuration must stay under
# Slider stops: powers of two, the values these settings take in practice.
SEQ_STOPS = [2**n for n in range(8, 18)]  # 256 ... 131,072 tokens
MICRO_BATCH_STOPS = [2**n for n in range(0, 7)]  # 1 ... 64
DEGREE_STOPS = [2**n for n in range(0, 10)]  # 1 ... 512 GPUs along one axis
PLACEHOLDER = "[memory widget: run this cell in JupyterLab for its sliders and menus]"


def resolve_inputs(preset="Llama 3 8B", **inputs) -> dict:
    """The preset's shape and the defaults, overridden by whatever the caller passes."""
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: choose one of {list(PRESETS)}")
    unknown = set(inputs) - set(SHAPE) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown inputs {sorted(unknown)}; known: {sorted(SHAPE) + sorted(DEFAULTS)}")
    config = PRESETS[preset]
    values = {name: getattr(config, field) for name, field in SHAPE.items()}
    values.update(DEFAULTS)
    values.update(inputs)
    return values


def per_rank_bytes(values: dict, **changes) -> dict:
    """breakdown() for a dict of widget inputs, optionally with some of them changed."""
    v = {**values, **changes}
    config = LlamaConfig(**{field: v[name] for name, field in SHAPE.items()}, seq_len=v["seq"])
    return breakdown(
        config,
        seq=v["seq"],
        micro_batch=v["micro_batch"],
        mixed_precision=v["mixed_precision"],
        fp32_grad_accum=v["fp32_grad_accum"],
        recompute=v["recompute"],
        zero_stage=v["zero_stage"],
        tp=v["tp"],
        dp=v["dp"],
        pp=v["pp"],
        optimizer_bytes=v["k"],
    )


def _stacked_bars(ax, labels, parts_list, title):
    bottoms = [0.0] * len(labels)
    for name, color in COLORS.items():
        heights = [parts[name] / GB for parts in parts_list]
        ax.bar(labels, heights, bottom=bottoms, color=color, label=name)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.axhline(GPU_GB, color="black", linestyle="--", linewidth=1)
    ax.text(len(labels) - 0.5, GPU_GB, f"{GPU_GB} GB (H100)", ha="right", va="bottom", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("GB per GPU")
    for i, total in enumerate(bottoms):
        ax.text(i, total, f"{total:,.1f}", ha="center", va="bottom", fontsize=8)


def memory_figure(preset="Llama 3 8B", **inputs) -> Figure:
    """Stacked bars of per-GPU memory: the chosen setting, then each recomputation mode and
    each ZeRO stage with everything else unchanged."""
    values = resolve_inputs(preset, **inputs)
    fig = Figure(figsize=(12, 4), layout="constrained")
    left, middle, right = fig.subplots(1, 3, sharey=True)
    _stacked_bars(
        left,
        ["this setting"],
        [per_rank_bytes(values)],
        f"seq {values['seq']}, mbs {values['micro_batch']}, TP {values['tp']} DP {values['dp']} PP {values['pp']}",
    )
    modes = ["none", "selective", "full"]
    _stacked_bars(middle, modes, [per_rank_bytes(values, recompute=m) for m in modes], "activation recomputation")
    _stacked_bars(
        right,
        [f"ZeRO-{s}" for s in range(4)],
        [per_rank_bytes(values, zero_stage=s) for s in range(4)],
        f"ZeRO stage (DP = {values['dp']})",
    )
    fig.legend(*left.get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=8)
    return fig


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def memory_widget():
    """Controls for every input of memory_figure, redrawing the figure on each change."""
    import ipywidgets as w

    values = resolve_inputs()
    preset = w.Dropdown(options=list(PRESETS), value="Llama 3 8B", description="preset")
    controls = {name: w.IntText(value=values[name], description=name) for name in SHAPE}

    def slider(stops, value, description):
        # redraw when the slider is let go, not at every stop it passes on the way
        return w.SelectionSlider(options=stops, value=value, description=description, continuous_update=False)

    controls.update(
        seq=slider(SEQ_STOPS, values["seq"], "seq"),
        micro_batch=slider(MICRO_BATCH_STOPS, values["micro_batch"], "micro-batch"),
        mixed_precision=w.Checkbox(value=True, description="BF16 mixed precision"),
        fp32_grad_accum=w.Checkbox(value=False, description="FP32 grad accumulation"),
        recompute=w.Dropdown(options=["none", "selective", "full"], description="recompute"),
        zero_stage=w.Dropdown(options=[0, 1, 2, 3], description="ZeRO stage"),
        tp=slider(DEGREE_STOPS, 1, "TP"),
        dp=slider(DEGREE_STOPS, 1, "DP"),
        pp=slider(DEGREE_STOPS, 1, "PP"),
        k=w.FloatText(value=12, description="optimizer k"),
    )
    image = w.Image(format="png")
    message = w.HTML()
    loading_preset = [False]  # set while a preset fills the shape boxes: redraw once, not six times

    def redraw(_=None):
        if loading_preset[0]:
            return
        try:
            image.value = _png(memory_figure(preset.value, **{n: c.value for n, c in controls.items()}))
            message.value = ""
        except (ValueError, TypeError) as error:  # e.g. hidden not divisible by heads
            message.value = f"<b style='color:#C44E52'>Cannot draw: {error}</b>"
        except Exception as error:  # a bug of ours: say so beside the plot, and let Jupyter log it too
            message.value = (
                f"<b style='color:#C44E52'>Cannot draw ({type(error).__name__}): {error}. "
                f"This is a bug in the course; the log console has the traceback.</b>"
            )
            raise

    def apply_preset(change):
        loading_preset[0] = True
        for name, field in SHAPE.items():
            controls[name].value = getattr(PRESETS[change["new"]], field)
        loading_preset[0] = False
        redraw()

    def default_k(change):  # Adam keeps m and v (8 bytes); mixed precision adds fp32 master weights
        controls["k"].value = 12 if change["new"] else 8

    preset.observe(apply_preset, names="value")
    controls["mixed_precision"].observe(default_k, names="value")
    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    names = list(controls)
    shape_box = w.VBox([preset] + [controls[n] for n in names[:6]])
    training_box = w.VBox([controls[n] for n in names[6:]])
    # Saved without a kernel, the widget's text is this line, not VBox(children=(HBox(...
    return with_text_repr(w.VBox, PLACEHOLDER)([w.HBox([shape_box, training_box]), message, image])
