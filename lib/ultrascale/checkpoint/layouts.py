"""Each layout's training state as one flat dict of global tensors, the same keys for all.

Every layout the course trains names the same things: ``model.<parameter>`` for each weight
and ``optim.state.<parameter>.<state>`` for each optimizer state (Adam's ``exp_avg``,
``exp_avg_sq`` and ``step``), at the parameter's *global* shape, whatever part of it this
rank holds. Those are the keys torch's ``get_state_dict`` gives an FSDP2 model once DCP
flattens them, so a checkpoint of ours and one of FSDP2 are the same files.

* :func:`zero_state`: ZeRO-1/2/3 (``parallel/zero.py``). The truth is the master shard of each
  flat unit and the optimizer state of its pieces; each parameter's part of them becomes
  :class:`~ultrascale.checkpoint.pieces.Pieces` (the padding after a unit's last parameter is
  left out: it belongs to no parameter, and another world size pads differently). Inside a
  composition (``parallel/compose.py``) ZeRO may flatten a tensor-parallel shard, or a pipeline
  stage's blocks: each run is then placed in the global tensor by its shard's position, under
  the whole model's name. A composition's ZeROs (dense and experts) each give their own part.
* :func:`module_state`: a model trained by a plain torch optimizer on its own parameters:
  replicated (plain DP) or tensor-parallel (a parameter carrying ``tp_shard_dim`` is that
  rank's slice along that dimension; its global shape is tp times as large there), or a
  pipeline's stages on this rank (each parameter under its name in the whole model, so the
  stages' keys together make the whole model's).
* FSDP2 (DTensor parameters) is torch's own: ``get_state_dict`` (in ``store.py``).

Each function returns the dict *and* a ``finish`` to call after DCP loaded into it: a load
fills the views in place, and then the layout publishes what it loaded (ZeRO gathers its
new parameters; both adopt the loaded step counts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.flat import split_piece
from .pieces import Pieces

__all__ = ["zero_state", "module_state", "global_names", "init_optimizer_state"]

MODEL, STATE = "model.", "optim.state."


def init_optimizer_state(optimizer, params) -> None:
    """Give every parameter its optimizer state (zeros) without changing it, so that a load
    has tensors to fill: one step on zero gradients at learning rate 0, as torch's own
    ``set_state_dict`` does (its helper for it is private). Does nothing once there is state."""
    if optimizer.state:
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
    for p in params:
        p.grad = None


def _is_elementwise(value, like: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == like.shape


# --------------------------------------------------------------------------- ZeRO
def _parameter_runs(zero, names):
    """(name, parameter, unit, start, stop): the elements ``start:stop`` of each parameter
    (flattened) that this rank's shard holds, and where they sit in ``unit.master``."""
    for unit in zero.all_units:
        own = unit.own.start
        for p in unit.params:
            first, last = unit.offsets[p]
            lo, hi = max(first, own), min(last, unit.own.stop)  # padding is past ``last``: left out
            hi = max(lo, hi)
            yield names[p], p, unit, lo - first, hi - first, lo - own


def zero_state(zero, model, for_load: bool = False):
    """ZeRO's state as global tensors: each parameter's part of the master shard, and of the
    optimizer state of the piece that holds it. ``for_load``: step counts as separate tensors
    per parameter (a piece's parameters may have been saved with different counts)."""
    names = global_names(model)
    state, where = {}, {}
    for name, p, unit, start, stop, at in _parameter_runs(zero, names):
        run = unit.master[at : at + stop - start]
        # a tensor-parallel shard's run, placed in the global tensor (compose: ZeRO after TP)
        state[MODEL + name] = Pieces.of_flat_run(p.shape, start, stop, run, *_shard_of(p))
        where[name] = (unit, p, start, stop, at)
    steps = {}
    for piece in zero.pieces:
        saved = zero.optimizer.state.get(piece.tensor)
        if not saved:  # never stepped (no gradient yet): torch keeps no state either
            continue
        for i in piece.index:
            name = names[piece.unit.params[i]]
            _, p, start, stop, at = where[name]
            lo = at - piece.lo  # this parameter's run inside the piece's state tensors
            for key, value in saved.items():
                if _is_elementwise(value, piece.tensor):
                    state[f"{STATE}{name}.{key}"] = Pieces.of_flat_run(
                        p.shape, start, stop, value[lo : lo + stop - start], *_shard_of(p)
                    )
                elif torch.is_tensor(value):
                    state[f"{STATE}{name}.{key}"] = value.clone() if for_load else value
                    steps.setdefault(piece, []).append((name, key))

    def finish(loaded: dict) -> None:
        _adopt_zero_counts(zero, names, loaded, steps)
        zero.publish_master()

    return state, finish


def _adopt_zero_counts(zero, names, loaded, steps) -> None:
    """Put the loaded step counts into the pieces' state, giving a piece whose parameters
    were saved with different counts one piece per parameter (as ZeRO does when they part)."""
    pieces = []
    for piece in zero.pieces:
        counts = {}
        for name, key in steps.get(piece, []):
            if f"{STATE}{name}.{key}" in loaded:
                counts.setdefault(name, {})[key] = loaded[f"{STATE}{name}.{key}"]
        distinct = {tuple(float(v) for v in c.values()) for c in counts.values()}
        parts = split_piece(piece, zero.optimizer.state) if len(distinct) > 1 else [piece]
        for part in parts:
            for name in (names[part.unit.params[i]] for i in part.index):
                for key, value in counts.get(name, {}).items():
                    zero.optimizer.state[part.tensor][key].copy_(value)
        pieces += parts
    if len(pieces) != len(zero.pieces):
        zero.use_pieces(pieces)


def load_zero_state(zero, model, present) -> tuple:
    """The dict to load into (only the keys the checkpoint has) and its ``finish``."""
    init_optimizer_state(zero.optimizer, [piece.tensor for piece in zero.pieces])
    state, finish = zero_state(zero, model, for_load=True)
    _require_weights(state, present)
    names = global_names(model)
    _drop_state_not_saved(
        zero.optimizer,
        {piece.tensor: [f"{STATE}{names[piece.unit.params[i]]}." for i in piece.index] for piece in zero.pieces},
        present,
    )
    return {k: v for k, v in state.items() if k in present}, finish


def _require_weights(state, present) -> None:
    missing = [k for k in state if k.startswith(MODEL) and k not in present]
    if missing:
        raise KeyError(
            f"the checkpoint has no {missing[0]} (and {len(missing) - 1} more): it was saved from another model"
        )


def _drop_state_not_saved(optimizer, prefixes: dict, present) -> None:
    """A parameter saved without optimizer state had never been stepped: forget the zeros
    ``init_optimizer_state`` gave it, so it starts as torch would (step 0, no moments)."""
    for tensor, starts in prefixes.items():
        if not any(k.startswith(s) for s in starts for k in present):
            optimizer.state.pop(tensor, None)


# --------------------------------------------------------------------------- plain and TP
def _shard_of(p):
    """(dim, index, count): how a parameter is cut over tp (None, 0, 1 when it is whole)."""
    dim = getattr(p, "tp_shard_dim", None)
    if dim is None:
        return None, 0, 1
    group = p.tp_group
    return dim, dist.get_rank(group), dist.get_world_size(group)


def global_names(model) -> dict:
    """Each parameter's name in the whole model. A pipeline's stages (``parallel.pipeline_parallel``:
    ``chunks``, and ``global_name``) number their blocks from 0 and call the tied head weight of
    the last stage by its own name: ``global_name`` gives the whole model's."""
    if hasattr(model, "chunks") and hasattr(model, "global_name"):
        return {
            p: model.global_name(int(s), n) for s, chunk in model.chunks.items() for n, p in chunk.named_parameters()
        }
    return {p: n for n, p in model.named_parameters()}


def module_state(model, optimizer, for_load: bool = False):
    """A model (or a pipeline's stages) and its torch optimizer, replicated or tensor-parallel,
    as global tensors."""
    state = {}
    for p, name in global_names(model).items():
        how = _shard_of(p)
        state[MODEL + name] = Pieces.of_shard(p.data, *how)
        for key, value in optimizer.state.get(p, {}).items():
            if _is_elementwise(value, p):
                state[f"{STATE}{name}.{key}"] = Pieces.of_shard(value, *how)
            elif torch.is_tensor(value):
                state[f"{STATE}{name}.{key}"] = value
    return state, lambda loaded: None  # loaded in place: nothing to publish


def load_module_state(model, optimizer, present) -> tuple:
    params = [p for p in model.parameters() if p.requires_grad]
    init_optimizer_state(optimizer, params)
    state, finish = module_state(model, optimizer)
    names = global_names(model)
    _require_weights(state, present)
    _drop_state_not_saved(optimizer, {p: [f"{STATE}{names[p]}."] for p in params}, present)
    return {k: v for k, v in state.items() if k in present}, finish
