"""Tensor parallelism (Megatron-LM), applied from outside.

Files for the basic form, in reading order: this module (:func:`apply_tp`, then the two
layers), ``comm/functional.py`` (``f``, ``f*``) and ``mesh.py`` (the tp group).

Tensor parallelism (TP) splits every large matrix multiply over the ``tp`` ranks with a
**column-parallel** linear (a slice of the output features; its input enters through ``f``,
the identity forward and an all-reduce backward) followed by a **row-parallel** one (a slice
of the input features; ``f*`` sums the ranks' partial results). Attention is column-parallel
q, k, v then row-parallel ``out``: a rank holds whole heads and the course model reads the
head count from the shapes, so it runs unchanged. The MLP is column-parallel fc (gate and up
for SwiGLU), then row-parallel proj (down). A plan names each module's style,
:func:`checked_tp_plan` checks everything before anything is swapped, and :func:`apply_tp`
swaps the layers.

The refinements each live in a module of their own, which registers its layers in
:data:`FORMS` (or :data:`VOCABULARY`) when the package imports it, so this module imports none
of them and ``apply_tp`` only looks its choice up:

* ``vocab_parallel.py``: the embedding, LM head and cross-entropy split over the vocabulary
  (plan styles "vocab_embedding" and "vocab_head");
* ``sequence_parallel.py``: ``sequence_parallel=True``, the activations between the TP
  regions split along the sequence (``g``/``g*``, regathering in backward, norm gradients,
  RoPE positions);
* ``async_tp.py``: ``async_tp=True``, SP's all-gather and reduce-scatter cut into pieces
  that overlap the matmuls of the linears beside them.

The course models have no dropout, so there is no random state to seed per rank.
Parameters sharded by TP carry ``tp_shard_dim`` and ``tp_group``; :func:`full_weights` and
:func:`full_gradients` gather them to full shapes, named as in the unsharded model.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm.functional import f, f_star, gather_along_dim, rank_and_size
from ..matching import match_plan
from .mesh import axis_group

__all__ = [
    "apply_tp",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "shard_parameter",
    "enter_region_with_f",
    "TPLayers",
    "FORMS",
    "VOCABULARY",
    "checked_tp_plan",
    "full_weights",
    "full_gradients",
    "tp_degrees",
    "choose_tp",
    "GPT_PLAN",
    "LLAMA_PLAN",
    "STYLES",
]


# Styles: "colwise" / "rowwise" linears; "parallel_region": a module whose input enters a TP
# region, f (g with SP) applied once for all the column-parallel layers inside it (q, k and v
# read the same input: one all-reduce in backward, not three; and with SP attention must see
# the whole sequence, since it reads the length from its input); "vocab_embedding" /
# "vocab_head"; "sequence_norm": a module run on this rank's slice of the sequence under SP
# (its gradients all-reduced), an ordinary replicated module without SP.
STYLES = ("colwise", "rowwise", "parallel_region", "vocab_embedding", "vocab_head", "sequence_norm")
_NORMS = {"blocks.*.norm1": "sequence_norm", "blocks.*.norm2": "sequence_norm", "norm": "sequence_norm"}
_ATTENTION = {
    "blocks.*.attn": "parallel_region",
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.out": "rowwise",
}
_VOCAB = {"embed": "vocab_embedding", "head": "vocab_head"}
GPT_PLAN = {
    **_VOCAB,
    **_NORMS,
    **_ATTENTION,
    "blocks.*.mlp": "parallel_region",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
}
LLAMA_PLAN = {
    **_VOCAB,
    **_NORMS,
    **_ATTENTION,
    "blocks.*.mlp": "parallel_region",
    "blocks.*.mlp.gate": "colwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
}


# --------------------------------------------------------------------------- apply_tp
def apply_tp(
    model,
    mesh_or_group=None,
    *,
    sequence_parallel: bool = False,
    plan: dict | None = None,
    regather_in_backward: bool = True,
    async_tp: bool = False,
    timeline=None,
) -> nn.Module:
    """Tensor-parallel ``model`` over the ``tp`` axis of a mesh (or a group; None: all ranks).

    Swaps the layers ``plan`` names (``{module-name pattern: style}``, default ``GPT_PLAN`` or
    ``LLAMA_PLAN``) for their parallel versions, sliced for this rank from the existing
    weights, and returns the model (changed in place). Everything is checked before anything
    is swapped. With ``sequence_parallel`` the activations outside the TP regions stay split
    along the sequence; see the module docstring for positions and norm gradients.
    ``regather_in_backward`` (SP only): the layers of a TP region save this rank's slice of
    their gathered input and all-gather it again in backward (as Megatron-LM does; see
    :class:`RegatherInBackward`); False saves the whole gathered input instead.
    ``async_tp`` (SP only): the linears of the TP regions overlap their all-gather and
    reduce-scatter with their matmuls, piece by piece (``async_tp.py``); their gathered input is
    kept for backward, not regathered. The vocabulary-parallel embedding and head keep theirs whole.
    ``timeline``: per-block compute bars (``Timeline.instrument(model.blocks)``); with
    ``async_tp``, the pieces instead: each matmul piece and each ring step (block bars would
    cover them).
    """
    group = axis_group(mesh_or_group, "tp")
    _, n = rank_and_size(group, "tensor-parallel layers")
    chosen = checked_tp_plan(model, plan, n, sequence_parallel=sequence_parallel, async_tp=async_tp)
    form = "async_tp" if async_tp else "sequence_parallel" if sequence_parallel else "plain"
    layers = FORMS[form](group, regather_in_backward, timeline)
    shared = {}  # original parameter -> its shard: keeps tied weights tied
    for name, style in chosen.items():  # named_modules order: embed before head
        module = model.get_submodule(name)
        if style == "colwise":
            entered = chosen.get(name.rpartition(".")[0]) == "parallel_region"  # the parent applied f / g
            model.set_submodule(name, layers.column(module, group, not entered, shared))
        elif style == "rowwise":
            model.set_submodule(name, layers.row(module, group, shared))
        elif style == "parallel_region":
            layers.enter_region(module)
        elif style == "vocab_embedding":
            model.set_submodule(name, layers.embedding(module, group, shared))
        elif style == "vocab_head":
            model.set_submodule(name, layers.head(module, group, True, shared))
        else:  # sequence_norm: replicated in plain TP; SP runs it on a slice of the tokens
            layers.sequence_norm(module, group)
    layers.finish(model, n)
    if timeline is not None and layers.block_bars and hasattr(model, "blocks"):  # no hooks unless asked
        timeline.instrument(model.blocks)
    return model


class TPLayers(NamedTuple):
    """What :func:`apply_tp` builds for each style in one form of TP: the layers
    (``from_linear`` / ``from_embedding``), what makes a module a TP region, what a
    "sequence_norm" module needs, what the model needs once every layer is in place, and
    whether the timeline gets a bar per block."""

    column: Callable
    row: Callable
    embedding: Callable
    head: Callable
    enter_region: Callable
    sequence_norm: Callable = lambda module, group: None
    finish: Callable = lambda model, tp: None
    block_bars: bool = True


# The forms of TP by name, each a function (group, regather_in_backward, timeline) -> TPLayers.
# "plain" is below; sequence_parallel.py adds "sequence_parallel" and async_tp.py "async_tp".
# vocab_parallel.py fills VOCABULARY with the vocabulary-parallel "embedding" and "head" that
# plain TP uses. Registries, not imports: the refinements build on this module's layers, so
# importing them here would make an import circle. ultrascale/parallel/__init__.py imports
# every refinement, so both are full whenever anything of ultrascale.parallel is imported.
FORMS: dict[str, Callable[..., TPLayers]] = {}
VOCABULARY: dict[str, Callable] = {}


def plain_layers(group, regather_in_backward, timeline) -> TPLayers:
    """Plain TP: the column- and row-parallel linears below, ``f`` once at each region's
    entrance, and the vocabulary-parallel embedding and head."""
    return TPLayers(
        ColumnParallelLinear.from_linear,
        RowParallelLinear.from_linear,
        VOCABULARY["embedding"],
        VOCABULARY["head"],
        partial(enter_region_with_f, group=group),
    )


FORMS["plain"] = plain_layers


# --------------------------------------------------------------------------- the two layers
# Megatron-LM's column- and row-parallel linears, and slicing a weight for this rank. These
# are plain TP only: sequence parallelism's versions (g/g* in place of f/f*) are subclasses in
# sequence_parallel.py, async TP's in async_tp.py.
def shard_parameter(tensor, dim, group, shared=None) -> nn.Parameter:
    """This rank's slice of ``tensor`` along ``dim`` as a new Parameter. ``shared`` maps an
    original parameter to its shard, so weights tied in the model stay tied (GPT's embedding)."""
    if shared is not None and id(tensor) in shared:
        return shared[id(tensor)]
    rank, n = rank_and_size(group, "tensor-parallel layers")
    if tensor.shape[dim] % n:
        raise ValueError(
            f"tp={n} does not divide the {tensor.shape[dim]} rows/columns (dim {dim}) of a "
            f"{tuple(tensor.shape)} weight: choose a tp that divides it"
        )
    piece = tensor.shape[dim] // n
    local = nn.Parameter(tensor.detach().narrow(dim, rank * piece, piece).clone(), requires_grad=tensor.requires_grad)
    local.tp_shard_dim, local.tp_group = dim, group
    if shared is not None:
        shared[id(tensor)] = local
    return local


class ColumnParallelLinear(nn.Module):
    """y_r = f(x) W_r^T + b_r: this rank's slice of the output features.

    The output stays split along the features. ``enter_region=False``: the module around
    this layer already applied f, once for all its column-parallel layers
    (:func:`enter_region_with_f`, ``apply_tp``'s "parallel_region" style)."""

    def __init__(self, weight, bias=None, group=None, enter_region=True):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.enter_region = group, enter_region

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, enter_region=True, shared=None, **options):
        """Slice an existing ``nn.Linear`` (rows of its weight, its bias) for this rank;
        ``options`` go on to the constructor (a subclass's own arguments)."""
        bias = None if linear.bias is None else shard_parameter(linear.bias, 0, group, shared)
        return cls(shard_parameter(linear.weight, 0, group, shared), bias, group, enter_region, **options)

    def forward(self, x):
        if self.enter_region:
            x = f(x, self.group)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return (
            f"in_features={self.weight.shape[1]}, local out_features={self.weight.shape[0]}, "
            f"bias={self.bias is not None}, enter_region={self.enter_region}"
        )


class RowParallelLinear(nn.Module):
    """y = f*(x_r W_r^T) + b: this rank's input features; the partial products are summed.

    The bias is added after the sum: added on every rank before it, it would count tp times."""

    def __init__(self, weight, bias=None, group=None):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, shared=None, **options):
        """Slice an existing ``nn.Linear`` (columns of its weight) for this rank; the bias is kept whole."""
        bias = (
            None
            if linear.bias is None
            else nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        )
        return cls(shard_parameter(linear.weight, 1, group, shared), bias, group, **options)

    def forward(self, x):
        y = f_star(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (
            f"local in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, "
            f"bias={self.bias is not None}"
        )


def enter_region_with_f(module, group=None):
    """Make ``module`` a TP region: f once at its entrance for all the column-parallel layers
    inside (built with ``enter_region=False``). q, k and v read the same input, so backward
    all-reduces its gradient once, not three times."""
    module.register_forward_pre_hook(lambda mod, args: (f(args[0], group), *args[1:]))


# --------------------------------------------------------------------------- checking a plan
def _default_plan(model) -> dict:
    from ..model import GPT, Llama  # the plans are written for the course models

    if isinstance(model, GPT):
        return GPT_PLAN
    if isinstance(model, Llama):
        return LLAMA_PLAN
    raise ValueError(
        f"no default tensor-parallel plan for {type(model).__name__}: pass plan={{pattern: style}} "
        f"with styles from {STYLES}"
    )


def _match(model, plan) -> dict:
    """{module name: style} in the model's order (``match_plan``'s rules), each module of the
    kind its style needs."""
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan style {style!r} for {pattern!r}: choose one of {STYLES}")
    chosen = {}
    for name, module, style in match_plan(model, plan):
        kind = nn.Embedding if style == "vocab_embedding" else nn.Linear
        if style not in ("sequence_norm", "parallel_region") and not isinstance(module, kind):
            raise ValueError(f"{name} is a {type(module).__name__}; style {style!r} needs an nn.{kind.__name__}")
        chosen[name] = style
    return chosen


def _sharded_counts(model, chosen) -> list[tuple[str, int]]:
    """What each sharded layer splits over the ranks, in words and numbers (for the error)."""
    modules, counts = dict(model.named_modules()), []
    for name, style in chosen.items():
        module = modules[name]
        parent = modules[name.rpartition(".")[0]]
        if style in ("vocab_embedding", "vocab_head"):
            counts.append(("vocabulary entries (we do not pad it)", module.weight.shape[0]))
        elif style in ("colwise", "rowwise"):
            features = module.out_features if style == "colwise" else module.in_features
            head_dim = getattr(parent, "head_dim", None)
            if head_dim:  # attention: a rank must hold whole heads
                what = "K/V heads" if name.endswith((".k", ".v")) else "attention heads"
                counts.append((what, features // head_dim))
            else:
                counts.append((f"features of {name}", features))
    return counts


def tp_degrees(model, plan: dict | None = None) -> list[int]:
    """Every tp that ``apply_tp`` accepts for ``model``: those dividing all it shards
    (heads, K/V heads, features, vocabulary). Nothing is changed or communicated."""
    chosen = _match(model, _default_plan(model) if plan is None else plan)
    counts = [c for _, c in _sharded_counts(model, chosen)]
    return [t for t in range(1, max(counts) + 1) if all(c % t == 0 for c in counts)]


def choose_tp(model, world_size: int, seq: int | None = None, plan: dict | None = None) -> int:
    """The largest tp > 1 that divides ``world_size`` and that the model allows (and, for
    sequence parallelism, ``seq``), or a clear error naming the world sizes that work."""
    fits = [t for t in tp_degrees(model, plan) if t > 1 and (seq is None or seq % t == 0)]
    usable = [t for t in fits if world_size % t == 0]
    if not usable:
        raise ValueError(
            f"no tensor-parallel degree > 1 divides WORLD_SIZE={world_size} and fits this model "
            f"(its heads, features, vocabulary{' and sequence' if seq else ''} allow tp in "
            f"{fits}): use a WORLD_SIZE that one of them divides"
        )
    return max(usable)


def checked_tp_plan(
    model, plan: dict | None, n: int, *, sequence_parallel: bool = False, async_tp: bool = False
) -> dict:
    """``plan`` (None: the model's default) matched to ``model``: {module name: style}, once
    everything :func:`apply_tp` needs of it with ``tp = n`` is checked. Errors say what to change."""
    if async_tp and not sequence_parallel:
        raise ValueError(
            "async_tp=True overlaps sequence parallelism's all-gather and reduce-scatter with the "
            "matmuls beside them; plain TP has neither: pass sequence_parallel=True as well"
        )
    chosen = _match(model, _default_plan(model) if plan is None else plan)
    counts = _sharded_counts(model, chosen)
    for what, count in counts:
        if count % n:
            ok = tp_degrees(model, {name: style for name, style in chosen.items()})
            name = type(getattr(model, "config", model)).__name__.removesuffix("Config")
            raise ValueError(
                f"tp={n} does not divide the {count} {what} of this {name} config: "
                f"choose tp in {{{', '.join(map(str, ok))}}}"
            )
    styles = set(chosen.values())
    if sequence_parallel and not {"vocab_embedding", "vocab_head"} <= styles:
        raise ValueError(
            "sequence parallelism splits the sequence at the vocabulary-parallel embedding and "
            "gathers it at the vocabulary-parallel head: the plan needs both "
            "'vocab_embedding' and 'vocab_head'"
        )
    if sequence_parallel:  # attention reads the sequence length from its input
        for name, style in chosen.items():
            parent = name.rpartition(".")[0]
            if (
                style == "colwise"
                and hasattr(model.get_submodule(parent), "head_dim")
                and chosen.get(parent) != "parallel_region"
            ):
                raise ValueError(
                    f"with sequence parallelism attention must see the whole sequence: mark "
                    f"{parent!r} as 'parallel_region' in the plan (as GPT_PLAN does)"
                )
    # A weight shared by a sharded module and one left whole would silently come apart.
    shards = lambda name: chosen.get(name) not in (None, "sequence_norm", "parallel_region")  # noqa: E731
    sharded = {id(m.weight) for name, m in model.named_modules() if shards(name)}
    for name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in sharded and not shards(name):
                raise ValueError(
                    f"{name}.{p_name} is shared with a layer the plan shards: shard both (as "
                    "GPT's tied embed and head: 'vocab_embedding' and 'vocab_head') or neither"
                )
    return chosen


# --------------------------------------------------------------------------- reading the shards
def _gather(t, param) -> torch.Tensor:
    dim = getattr(param, "tp_shard_dim", None)
    if dim is None:
        return t.detach().cpu().clone()
    with torch.no_grad():
        return gather_along_dim(t.detach(), dim, param.tp_group).cpu()


def full_weights(model) -> dict:
    """Every parameter by name at its full (unsharded) shape, as plain CPU tensors (a collective)."""
    return {name: _gather(p, p) for name, p in model.named_parameters()}


def full_gradients(model) -> dict:
    """Every gradient by name at its full shape (None where there is none; a collective)."""
    return {name: None if p.grad is None else _gather(p.grad, p) for name, p in model.named_parameters()}
