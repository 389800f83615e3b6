"""Tensor parallelism (Megatron-LM) and sequence parallelism, applied from outside.

Tensor parallelism (TP) splits every large matrix multiply over the ``tp`` ranks:

* a **column-parallel** linear keeps a slice of the *output* features (rows of the weight).
  Its input must be whole on every rank: ``f`` (identity forward, all-reduce backward);
* a **row-parallel** linear keeps a slice of the *input* features (columns of the weight),
  takes the column-parallel output as it is, and sums the ranks' partial results: ``f*``
  (all-reduce forward). Its bias is added once, after the sum.

Attention is column-parallel q, k, v then row-parallel ``out``: a rank holds whole heads and
the course model reads the head count from the shapes, so it runs unchanged. The MLP is
column-parallel fc (gate and up for SwiGLU), then row-parallel proj (down).

The **vocabulary** is split too: each rank holds the rows of the embedding table for its
slice of token ids (other ids look up zeros, and ``f*`` sums the ranks' lookups); the LM head
is column-parallel over the vocabulary and returns only this rank's slice of the logits, as
:class:`VocabParallelLogits`. ``F.cross_entropy`` on them (so ``lm_loss``, ``Batch.loss`` and
``train.train`` unchanged) is the parallel cross-entropy: the ranks all-reduce the maximum,
the sum of exponentials and the target's logit, never the full ``(tokens x vocab)`` logits
(torchtitan's ``loss_parallel`` does the same for DTensor logits). The vocabulary is not
padded: a ``tp`` that does not divide it is refused. GPT ties ``head.weight`` to
``embed.weight``: both are sharded by vocabulary rows, so they share one local Parameter.

**Sequence parallelism** (SP, ``sequence_parallel=True``): between the TP regions (norms,
residual adds) the activations are identical on every rank, so that work and memory are
split along the sequence instead. ``f``/``f*`` become ``g`` (all-gather the sequence before
a column-parallel layer) and ``g*`` (reduce-scatter after a row-parallel one), which together
move the bytes of the one all-reduce they replace. Two consequences:

* a replicated parameter used on a slice of the sequence (norm weights, row-parallel biases)
  gets only that slice's gradient; a hook on each such parameter all-reduces its gradient
  over the tp group as it is computed, inside backward (so accumulation over micro-batches
  stays right and nothing has to be called after backward);
* the blocks see ``seq/tp`` tokens, but the model computes default RoPE positions from the
  embedding output's length, which would then be wrong. Attention runs between ``g`` and
  ``g*`` on the whole sequence, so it needs positions ``0..seq-1``: ``apply_tp`` registers a
  forward pre-hook on the model that passes them when the caller gives none
  (:func:`fill_global_positions`). ``model.py`` is not changed.

The course models have no dropout, so there is no random state to seed per rank.
Parameters sharded here carry ``tp_shard_dim`` and ``tp_group``; :func:`full_weights` and
:func:`full_gradients` gather them to full shapes, named as in the unsharded model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..comm.functional import f, f_star, g, g_star, gather_along_dim, rank_and_size
from .grad_sync import sync_in_backward
from .matching import match_plan
from .mesh import axis_group

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead",
           "VocabParallelLogits", "vocab_parallel_cross_entropy", "apply_tp", "enter_parallel_region",
           "fill_global_positions", "full_weights", "full_gradients", "tp_degrees", "choose_tp", "GPT_PLAN",
           "LLAMA_PLAN", "STYLES", "RegatherInBackward"]

# Styles: "colwise" / "rowwise" linears; "parallel_region": a module whose input enters a TP
# region, f (g with SP) applied once for all the column-parallel layers inside it (q, k and v
# read the same input: one all-reduce in backward, not three; and with SP attention must see
# the whole sequence, since it reads the length from its input); "vocab_embedding" /
# "vocab_head"; "sequence_norm": a module run on this rank's slice of the sequence under SP
# (its gradients all-reduced), an ordinary replicated module without SP.
STYLES = ("colwise", "rowwise", "parallel_region", "vocab_embedding", "vocab_head", "sequence_norm")
_NORMS = {"blocks.*.norm1": "sequence_norm", "blocks.*.norm2": "sequence_norm", "norm": "sequence_norm"}
_ATTENTION = {"blocks.*.attn": "parallel_region", "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
              "blocks.*.attn.v": "colwise", "blocks.*.attn.out": "rowwise"}
_VOCAB = {"embed": "vocab_embedding", "head": "vocab_head"}
GPT_PLAN = {**_VOCAB, **_NORMS, **_ATTENTION, "blocks.*.mlp": "parallel_region",
            "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
LLAMA_PLAN = {**_VOCAB, **_NORMS, **_ATTENTION, "blocks.*.mlp": "parallel_region",
              "blocks.*.mlp.gate": "colwise", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"}


# --------------------------------------------------------------------------- sharding helpers
def _rank_and_size(group) -> tuple[int, int]:
    return rank_and_size(group, "tensor-parallel layers")


def _shard(tensor, dim, group, shared=None) -> nn.Parameter:
    """This rank's slice of ``tensor`` along ``dim`` as a new Parameter. ``shared`` maps an
    original parameter to its shard, so weights tied in the model stay tied (GPT's embedding)."""
    if shared is not None and id(tensor) in shared:
        return shared[id(tensor)]
    rank, n = _rank_and_size(group)
    if tensor.shape[dim] % n:
        raise ValueError(f"tp={n} does not divide the {tensor.shape[dim]} rows/columns (dim {dim}) of a "
                         f"{tuple(tensor.shape)} weight: choose a tp that divides it")
    piece = tensor.shape[dim] // n
    local = nn.Parameter(tensor.detach().narrow(dim, rank * piece, piece).clone(),
                         requires_grad=tensor.requires_grad)
    local.tp_shard_dim, local.tp_group = dim, group
    if shared is not None:
        shared[id(tensor)] = local
    return local


def _sum_gradient_over_tp(param: nn.Parameter, group) -> None:
    """Under SP a replicated parameter sees only this rank's tokens: its full gradient is the
    sum over the tp ranks. The hook changes the gradient *before* it is accumulated into
    ``.grad``, so gradient accumulation over micro-batches is unaffected."""
    sync_in_backward([param], group, divide_by=1, keep_as="_tp_grad_sync")   # a sum: no division


# --------------------------------------------------------------------------- linear layers
def enter_parallel_region(x, group=None, sequence_parallel=False):
    """f (identity forward, all-reduce backward), or g (all-gather the sequence, dim 1) with SP."""
    return g(x, 1, group) if sequence_parallel else f(x, group)


class _Regathered:
    """What a saved-tensor hook keeps in place of (a view of) the gathered input: the slice."""
    __slots__ = ("shard", "size", "stride", "offset")

    def __init__(self, shard, t):
        self.shard, self.size, self.stride, self.offset = shard, t.size(), t.stride(), t.storage_offset()


class RegatherInBackward:
    """Saved-tensor hooks: keep this rank's slice of the sequence, not g's gathered output.

    With SP, the column-parallel layers after ``g`` save their input, the whole sequence
    ``(b, s, h)``, to compute their weight gradients: tp times what the rank holds between
    the regions. Megatron-LM keeps only the slice and all-gathers it again in backward,
    trading one more all-gather per region for ``b*s*h*(tp-1)/tp`` fewer saved elements;
    these hooks do the same for any layer inside the region (q, k and v save one tensor:
    it is gathered once, when the first of them needs it, and dropped after the last).
    Hooks already active (a checkpoint, a memory measurement) still see every saved
    tensor: the others unchanged, and the slice in place of the gathered input.
    """

    def __init__(self, shard, gathered, group):
        self.shard, self.group = shard.detach(), group
        self.storage = gathered.untyped_storage().data_ptr()
        self.packed = self.unpacked = 0
        self.full = None
        # Saved-tensor hooks do not nest on their own: the innermost pair is the only one
        # called, so ours hands every tensor on to the pair that was active before it.
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.outer_pack, self.outer_unpack = outer or (lambda t: t, lambda t: t)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t):
        if t.untyped_storage().data_ptr() != self.storage:
            return self.outer_pack(t)
        self.packed += 1
        return _Regathered(self.outer_pack(self.shard), t)

    def unpack(self, saved):
        if not isinstance(saved, _Regathered):
            return self.outer_unpack(saved)
        full = self.full
        if full is None:
            with torch.no_grad():
                full = gather_along_dim(self.outer_unpack(saved.shard), 1, self.group)
        self.unpacked += 1
        self.full = full if self.unpacked < self.packed else None   # drop it after the last use
        return full.as_strided(saved.size, saved.stride, saved.offset)


def _enter_region_keeping_shard(module, x, group, sequence_parallel, regather):
    """Apply f (g); with SP and ``regather``, push RegatherInBackward until the module's forward ends."""
    gathered = enter_parallel_region(x, group, sequence_parallel)
    if sequence_parallel and regather and torch.is_grad_enabled():
        module._regather = RegatherInBackward(x, gathered, group)
        module._regather.hooks.__enter__()
    return gathered


def _leave_region(module, *_):
    regather = module.__dict__.pop("_regather", None)
    if regather is not None:
        regather.hooks.__exit__(None, None, None)


class ColumnParallelLinear(nn.Module):
    """y_r = f(x) W_r^T + b_r: this rank's slice of the output features.

    With ``sequence_parallel`` the input is this rank's slice of the sequence (dim 1) and
    ``g`` all-gathers it first. The output stays split along the features.
    ``enter_region=False``: the module around this layer already applied f (g), once for all
    its column-parallel layers (``apply_tp``'s "parallel_region" style). ``regather``: with
    SP, save only the input's slice and all-gather it again in backward (RegatherInBackward)."""

    def __init__(self, weight, bias=None, group=None, sequence_parallel=False, enter_region=True,
                 regather=True):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.sequence_parallel, self.enter_region = group, sequence_parallel, enter_region
        self.regather = regather

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, sequence_parallel=False, enter_region=True, shared=None):
        """Slice an existing ``nn.Linear`` (rows of its weight, its bias) for this rank."""
        bias = None if linear.bias is None else _shard(linear.bias, 0, group, shared)
        return cls(_shard(linear.weight, 0, group, shared), bias, group, sequence_parallel, enter_region)

    def forward(self, x):
        if not self.enter_region:
            return F.linear(x, self.weight, self.bias)
        x = _enter_region_keeping_shard(self, x, self.group, self.sequence_parallel, self.regather)
        try:
            return F.linear(x, self.weight, self.bias)
        finally:
            _leave_region(self)

    def extra_repr(self):
        return (f"in_features={self.weight.shape[1]}, local out_features={self.weight.shape[0]}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, "
                f"enter_region={self.enter_region}")


class RowParallelLinear(nn.Module):
    """y = f*(x_r W_r^T) + b: this rank's input features; the partial products are summed.

    The bias is added after the sum: added on every rank before it, it would count tp times.
    With ``sequence_parallel`` ``g*`` reduce-scatters the sum along the sequence (dim 1),
    and the replicated bias, added to a slice of the tokens, gets its gradient all-reduced."""

    def __init__(self, weight, bias=None, group=None, sequence_parallel=False):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.sequence_parallel = group, sequence_parallel
        if sequence_parallel and bias is not None:
            _sum_gradient_over_tp(bias, group)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, sequence_parallel=False, shared=None):
        """Slice an existing ``nn.Linear`` (columns of its weight) for this rank; the bias is kept whole."""
        bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                            requires_grad=linear.bias.requires_grad)
        return cls(_shard(linear.weight, 1, group, shared), bias, group, sequence_parallel)

    def forward(self, x):
        y = F.linear(x, self.weight)
        y = g_star(y, 1, self.group) if self.sequence_parallel else f_star(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"local in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


# --------------------------------------------------------------------------- the vocabulary
class VocabParallelEmbedding(nn.Module):
    """Rows ``vocab_start .. vocab_start + V/tp`` of the embedding table on this rank.

    A token outside the slice looks up zeros here and its row on its owner rank, so the sum
    over ranks (``f*``, or ``g*`` with SP, which also leaves this rank its slice of the
    sequence) is the ordinary lookup."""

    def __init__(self, weight, vocab_start, group=None, sequence_parallel=False):
        super().__init__()
        self.weight, self.vocab_start = weight, vocab_start
        self.group, self.sequence_parallel = group, sequence_parallel

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None, sequence_parallel=False, shared=None):
        weight = _shard(embedding.weight, 0, group, shared)
        return cls(weight, _rank_and_size(group)[0] * weight.shape[0], group, sequence_parallel)

    def forward(self, idx):
        outside = (idx < self.vocab_start) | (idx >= self.vocab_start + self.weight.shape[0])
        local = F.embedding((idx - self.vocab_start).masked_fill(outside, 0), self.weight)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)   # row 0 was only a placeholder
        return g_star(local, 1, self.group) if self.sequence_parallel else f_star(local, self.group)

    def extra_repr(self):
        return f"local rows {self.vocab_start}..{self.vocab_start + self.weight.shape[0] - 1}, " \
               f"dim={self.weight.shape[1]}, sequence_parallel={self.sequence_parallel}"


class VocabParallelHead(ColumnParallelLinear):
    """The LM head, column-parallel over the vocabulary: returns :class:`VocabParallelLogits`."""

    @classmethod
    def from_linear(cls, linear, group=None, sequence_parallel=False, enter_region=True, shared=None):
        if linear.bias is not None:
            raise ValueError("vocab_head expects a head without bias (as the course models have)")
        return super().from_linear(linear, group, sequence_parallel, enter_region, shared)

    def forward(self, x):
        local = super().forward(x)   # (batch, seq, V/tp): with SP, g has gathered the sequence
        start = _rank_and_size(self.group)[0] * self.weight.shape[0]
        return VocabParallelLogits.wrap(local, start, self.group)


class VocabParallelLogits(torch.Tensor):
    """This rank's vocabulary slice of the logits, ``(..., V/tp)``; otherwise a plain tensor.

    ``F.cross_entropy`` on it (hence ``lm_loss``) computes the vocabulary-parallel
    cross-entropy; reshapes that keep the last dimension (``flatten(0, 1)``) and dtype
    casts keep it sharded; any other operation works on the plain local slice (so
    ``argmax(-1)`` or ``softmax(-1)`` see this rank's vocabulary only: gather first).
    ``full_tensor()`` all-gathers the full logits, for checks only.
    """

    _KEEPS_VOCAB_DIM = {"flatten", "view", "reshape", "float", "double", "to", "contiguous"}

    @staticmethod
    def wrap(local, vocab_start, group):
        with torch._C.DisableTorchFunctionSubclass():
            out = local.as_subclass(VocabParallelLogits)   # stays on the autograd graph
        out.vocab_start, out.group = vocab_start, group
        return out

    def local(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    def full_tensor(self) -> torch.Tensor:
        return gather_along_dim(self.local(), -1, self.group)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            return _cross_entropy(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            me = args[0] if args and isinstance(args[0], cls) else None
            keep = (me is not None and getattr(func, "__name__", "") in cls._KEEPS_VOCAB_DIM
                    and isinstance(out, torch.Tensor) and out.dim() and out.shape[-1] == me.shape[-1])
        return cls.wrap(out, me.vocab_start, me.group) if keep else out


def _cross_entropy(logits, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    if weight is not None or size_average is not None or reduce is not None or label_smoothing \
            or reduction != "mean":
        raise ValueError("the vocabulary-parallel cross-entropy supports the mean loss only "
                         "(no weight, reduction or label smoothing)")
    return vocab_parallel_cross_entropy(logits.local(), target, logits.vocab_start, logits.group, ignore_index)


def vocab_parallel_cross_entropy(local_logits, targets, vocab_start: int, group=None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy from this rank's logits for vocabulary ids ``vocab_start ..
    vocab_start + local_logits.shape[-1] - 1``, equal on every rank to ``lm_loss`` of the full
    logits (``F.cross_entropy``: targets equal to ``ignore_index`` do not count).
    loss = log(sum_v exp(z_v - m)) - (z_target - m), with m the maximum logit."""
    logits = local_logits.flatten(0, -2)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()    # as lm_loss: a softmax over the vocabulary needs fp32
    targets = targets.flatten()
    # 1. The global maximum only keeps exp() in range; softmax does not depend on it, so it
    #    needs no gradient and a plain all-reduce (MAX) will do.
    with torch.no_grad():
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    # 2. The target's logit lives on exactly one rank; the others contribute zero.
    mine = (targets >= vocab_start) & (targets < vocab_start + logits.shape[-1])
    index = (targets - vocab_start).masked_fill(~mine, 0).unsqueeze(-1)
    target_logit = shifted.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0)
    # 3. Both sums over the vocabulary in one f*: its backward is the identity, right here
    #    because every rank then computes the same loss from the same sums.
    sums = f_star(torch.stack([shifted.exp().sum(-1), target_logit]), group)
    counted = targets != ignore_index
    return torch.where(counted, sums[0].log() - sums[1], 0.0).sum() / counted.sum()


# --------------------------------------------------------------------------- apply_tp
def fill_global_positions(model, tp: int):
    """A forward pre-hook giving the model RoPE positions ``0..seq-1`` when the caller gives
    none. With SP the model would otherwise take them from the length of its (sequence-split)
    embedding output; attention sees the whole sequence. Also refuses a length tp does not divide."""
    def hook(module, args, kwargs):
        idx = args[0] if args else kwargs["idx"]
        tokens = idx.dim() == 2   # token ids: the whole sequence; hidden states: this rank's slice
        seq = idx.shape[1] if tokens else idx.shape[1] * tp
        if tokens and seq % tp:
            raise ValueError(f"sequence parallelism splits each sequence over tp={tp} ranks: {seq} tokens "
                             f"do not split evenly; use a sequence length divisible by {tp} (or pad)")
        if len(args) > 1 or kwargs.get("positions") is not None:
            return None   # the caller knows the global positions (e.g. context parallelism)
        return args, {**kwargs, "positions": torch.arange(seq, device=idx.device)}

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def _default_plan(model) -> dict:
    from ..model import GPT, Llama   # the plans are written for the course models

    if isinstance(model, GPT):
        return GPT_PLAN
    if isinstance(model, Llama):
        return LLAMA_PLAN
    raise ValueError(f"no default tensor-parallel plan for {type(model).__name__}: pass plan={{pattern: style}} "
                     f"with styles from {STYLES}")


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
            if head_dim:   # attention: a rank must hold whole heads
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
        raise ValueError(f"no tensor-parallel degree > 1 divides WORLD_SIZE={world_size} and fits this model "
                         f"(its heads, features, vocabulary{' and sequence' if seq else ''} allow tp in "
                         f"{fits}): use a WORLD_SIZE that one of them divides")
    return max(usable)


def _check(model, chosen, n, sequence_parallel):
    counts = _sharded_counts(model, chosen)
    for what, count in counts:
        if count % n:
            ok = tp_degrees(model, {name: style for name, style in chosen.items()})
            name = type(getattr(model, "config", model)).__name__.removesuffix("Config")
            raise ValueError(f"tp={n} does not divide the {count} {what} of this {name} config: "
                             f"choose tp in {{{', '.join(map(str, ok))}}}")
    styles = set(chosen.values())
    if sequence_parallel and not {"vocab_embedding", "vocab_head"} <= styles:
        raise ValueError("sequence parallelism splits the sequence at the vocabulary-parallel embedding and "
                         "gathers it at the vocabulary-parallel head: the plan needs both "
                         "'vocab_embedding' and 'vocab_head'")
    if sequence_parallel:   # attention reads the sequence length from its input
        for name, style in chosen.items():
            parent = name.rpartition(".")[0]
            if style == "colwise" and hasattr(model.get_submodule(parent), "head_dim") \
                    and chosen.get(parent) != "parallel_region":
                raise ValueError(f"with sequence parallelism attention must see the whole sequence: mark "
                                 f"{parent!r} as 'parallel_region' in the plan (as GPT_PLAN does)")
    # A weight shared by a sharded module and one left whole would silently come apart.
    shards = lambda name: chosen.get(name) not in (None, "sequence_norm", "parallel_region")   # noqa: E731
    sharded = {id(m.weight) for name, m in model.named_modules() if shards(name)}
    for name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in sharded and not shards(name):
                raise ValueError(f"{name}.{p_name} is shared with a layer the plan shards: shard both (as "
                                 "GPT's tied embed and head: 'vocab_embedding' and 'vocab_head') or neither")


def apply_tp(model, mesh_or_group=None, *, sequence_parallel: bool = False, plan: dict | None = None,
             regather_in_backward: bool = True, timeline=None):
    """Tensor-parallel ``model`` over the ``tp`` axis of a mesh (or a group; None: all ranks).

    Swaps the layers ``plan`` names (``{module-name pattern: style}``, default ``GPT_PLAN`` or
    ``LLAMA_PLAN``) for their parallel versions, sliced for this rank from the existing
    weights, and returns the model (changed in place). Everything is checked before anything
    is swapped. With ``sequence_parallel`` the activations outside the TP regions stay split
    along the sequence; see the module docstring for positions and norm gradients.
    ``regather_in_backward`` (SP only): the layers of a TP region save this rank's slice of
    their gathered input and all-gather it again in backward (as Megatron-LM does; see
    :class:`RegatherInBackward`); False saves the whole gathered input instead.
    ``timeline``: per-block compute bars (``Timeline.instrument(model.blocks)``).
    """
    group = axis_group(mesh_or_group, "tp")
    _, n = _rank_and_size(group)
    chosen = _match(model, _default_plan(model) if plan is None else plan)
    _check(model, chosen, n, sequence_parallel)
    shared = {}   # original parameter -> its shard: keeps tied weights tied
    sp = sequence_parallel
    for name, style in chosen.items():   # named_modules order: embed before head
        module = model.get_submodule(name)
        entered = chosen.get(name.rpartition(".")[0]) == "parallel_region"   # the parent applied f / g
        if style == "colwise":
            model.set_submodule(name, ColumnParallelLinear.from_linear(module, group, sp, not entered, shared))
        elif style == "rowwise":
            model.set_submodule(name, RowParallelLinear.from_linear(module, group, sp, shared))
        elif style == "vocab_embedding":
            model.set_submodule(name, VocabParallelEmbedding.from_embedding(module, group, sp, shared))
        elif style == "vocab_head":
            head = VocabParallelHead.from_linear(module, group, sp, True, shared)
            head.regather = regather_in_backward
            model.set_submodule(name, head)
        elif style == "parallel_region":
            module.register_forward_pre_hook(lambda mod, args: (
                _enter_region_keeping_shard(mod, args[0], group, sp, regather_in_backward), *args[1:]))
            module.register_forward_hook(_leave_region, always_call=True)
        elif sp:   # sequence_norm: runs on a slice of the tokens
            for p in module.parameters():
                _sum_gradient_over_tp(p, group)
    if sequence_parallel:
        fill_global_positions(model, n)
    if timeline is not None and hasattr(model, "blocks"):
        timeline.instrument(model.blocks)
    return model


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
