"""Saving and loading a training run with DCP, atomically: what a restart needs, and nothing half-written.

    path = save_checkpoint("ckpt", step, model, optimizer, loader=loader)   # on every rank
    meta = load_checkpoint(latest_checkpoint("ckpt"), model, optimizer, loader=loader)

A checkpoint is one DCP directory holding each layout's global tensors (``layouts.py``),
the step, the data loader's position (in samples, so another world size resumes at the same
sample) and every rank's random-number state. ``optimizer`` is a ZeRO, a composition's ZeROs
(``parallel.compose``: pass ``par.module`` and ``par.optimizer``), or the torch optimizer of a
replicated, tensor-parallel, expert-parallel, pipelined or FSDP2 model; the layout that loads
need not be the one that saved: DCP reads each rank's boxes of the global tensors from
whichever chunks hold them.

**Atomic.** DCP writes into ``step-NNNNNNNN.partial``; only when every rank's files and
DCP's ``.metadata`` are written (``dcp.save`` returns once the coordinator has written the
metadata) and every rank has said so (a barrier: a rank that died after its files and before
the barrier fails it) does rank 0 rename the directory to ``step-NNNNNNNN``. A rename within
one file system is atomic, so a save killed half-way leaves a ``.partial`` directory that
:func:`latest_checkpoint` never returns. (DCP writes into the directory it is given and has no
commit step of its own; this rename is the course's.)
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..parallel.compose_zero import ComposedZeRO
from ..parallel.zero import ZeRO
from .layouts import load_module_state, load_zero_state, module_state, zero_state
from .pieces import Box, Pieces, PiecesLoadPlanner, PiecesSavePlanner

__all__ = [
    "save_checkpoint",
    "save_checkpoint_async",
    "PendingSave",
    "load_checkpoint",
    "latest_checkpoint",
    "checkpoint_steps",
    "PARTIAL",
]

PARTIAL = ".partial"
NAME = re.compile(r"step-(\d{8})")


def _is_fsdp2(model) -> bool:
    return any(hasattr(p, "device_mesh") for p in model.parameters())  # DTensor parameters


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _training_state(model, optimizer, for_load: bool = False):
    """(the layout's dict of global tensors, what to run after a load fills it)."""
    if isinstance(optimizer, ZeRO):
        return zero_state(optimizer, model, for_load)
    if isinstance(optimizer, ComposedZeRO):
        return _each_zero(zero_state, optimizer, model, for_load)
    if _is_fsdp2(model):
        return _fsdp2_flat(model, *get_state_dict(model, optimizer)), None
    return module_state(model, optimizer, for_load)


@contextmanager
def _one_process_is_fine():
    """DCP warns when it runs without a process group; one process saving is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _meta(step: int, loader, group) -> dict:
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    meta = {"meta.step": step, "meta.world_size": world}
    if loader is not None:
        meta["meta.next_sample"] = loader.next_sample
    # each rank's generator, under its own key (the same key on every rank would keep one)
    meta[f"rng.rank{_rank(group)}"] = torch.get_rng_state()
    return meta


def save_checkpoint(root, step: int, model, optimizer, *, loader=None, group=None, before_commit=None) -> Path:
    """Save this training state under ``root/step-NNNNNNNN`` (a collective: call it on every
    rank of ``group``). ``before_commit``: called on every rank once the files are written and
    before the rename (the failure tests kill a rank there). Returns the directory."""
    final, partial = _begin(root, step, group)
    state = _state_to_save(step, model, optimizer, loader, group)
    with _one_process_is_fine():
        dcp.save(state, storage_writer=FileSystemWriter(partial), planner=PiecesSavePlanner(), process_group=group)
    return _commit(final, partial, group, before_commit)


def _begin(root, step: int, group) -> tuple[Path, Path]:
    final = Path(root) / f"step-{step:08d}"
    partial = final.with_name(final.name + PARTIAL)
    if _rank(group) == 0:  # a save killed earlier may have left files here
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier(group)
    return final, partial


def _state_to_save(step: int, model, optimizer, loader, group) -> dict:
    state, _ = _training_state(model, optimizer)
    state.update(_meta(step, loader, group))
    return state


def _commit(final: Path, partial: Path, group, before_commit=None) -> Path:
    if before_commit is not None:
        before_commit()
    if dist.is_initialized():
        dist.barrier(group)  # every rank is done with this step's files: only now may it count
    if _rank(group) == 0:
        shutil.rmtree(final, ignore_errors=True)  # saving the same step again replaces it
        os.replace(partial, final)
    if dist.is_initialized():
        dist.barrier(group)  # nobody looks for the checkpoint before it has its name
    return final


# --------------------------------------------------------------------------- without stopping
_CHECKPOINT_GROUPS: dict = {}


def _checkpoint_group(group):
    """A gloo group of the same ranks for the background writes: their collectives (DCP's plan,
    the barriers) must not interleave with training's on the training group. Made on first use,
    which every rank reaches at the same save."""
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    if ranks not in _CHECKPOINT_GROUPS:
        _CHECKPOINT_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo")
    return _CHECKPOINT_GROUPS[ranks]


def _on_host(value):
    """A copy in host memory: what the background write reads while training changes the original."""
    if isinstance(value, Pieces):
        return Pieces(
            value.shape,
            value.dtype,
            [Box(b.offsets, b.sizes, b.tensor.detach().to("cpu", copy=True)) for b in value.boxes],
        )
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    return value


class PendingSave:
    """A checkpoint being written in the background. ``wait()`` finishes it (a collective):
    the write, then the same barrier and rename as a blocking save. Call it before the next save."""

    def __init__(self, future, final: Path, partial: Path, group):
        self.future, self.final, self.partial, self.group = future, final, partial, group

    def wait(self) -> Path:
        self.future.result()
        return _commit(self.final, self.partial, self.group)


def save_checkpoint_async(root, step: int, model, optimizer, *, loader=None, group=None) -> PendingSave:
    """``save_checkpoint`` that returns as soon as this rank's state is copied to host memory:
    DCP's ``async_save`` writes the copy from a background thread, over a group of its own,
    while training goes on. The cost a step sees is the copy; ``wait()`` commits it."""
    final, partial = _begin(root, step, group)
    staged = {key: _on_host(value) for key, value in _state_to_save(step, model, optimizer, loader, group).items()}
    ckpt_group = _checkpoint_group(group) if dist.is_initialized() else None
    with _one_process_is_fine():
        future = dcp.async_save(
            staged, storage_writer=FileSystemWriter(partial), planner=PiecesSavePlanner(), process_group=ckpt_group
        )
    return PendingSave(future, final, partial, ckpt_group)


def checkpoint_steps(root) -> list[int]:
    """The steps of the complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [NAME.fullmatch(d.name) for d in root.iterdir()]
    return sorted(int(m.group(1)) for m in found if m and (root / m.group(0) / ".metadata").is_file())


def latest_checkpoint(root) -> Path | None:
    """The newest complete checkpoint under ``root`` (never a ``.partial`` one), or None."""
    steps = checkpoint_steps(root)
    return Path(root) / f"step-{steps[-1]:08d}" if steps else None


def load_checkpoint(path, model, optimizer, *, loader=None, group=None) -> dict:
    """Load a checkpoint into this layout (a collective) and return its meta data: ``step``
    (the steps done), ``world_size`` (of the run that saved it), ``next_sample``."""
    path = Path(path)
    if path.name.endswith(PARTIAL) or not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (a save that did not finish leaves a "
            f"'{PARTIAL}' directory): load latest_checkpoint(root) instead"
        )
    present = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    state, finish = _state_to_load(model, optimizer, present)
    rng = f"rng.rank{_rank(group)}"
    meta = {key: None for key in present if key.startswith("meta.") or key == rng}
    if rng in meta:
        meta[rng] = torch.empty_like(torch.get_rng_state())
    state.update(meta)
    with _one_process_is_fine():
        dcp.load(state, storage_reader=FileSystemReader(path), planner=PiecesLoadPlanner(), process_group=group)
    finish(state)
    if rng in state:  # a rank the saving run did not have keeps its own generator
        torch.set_rng_state(state[rng])
    if loader is not None:
        if "meta.next_sample" not in state:
            raise KeyError(f"{path} records no data position: it was saved without a loader")
        loader.next_sample = state["meta.next_sample"]
    return {key[len("meta.") :]: state[key] for key in state if key.startswith("meta.")}


def _state_to_load(model, optimizer, present):
    if isinstance(optimizer, ZeRO):
        return load_zero_state(optimizer, model, present)
    if isinstance(optimizer, ComposedZeRO):
        return _each_zero(load_zero_state, optimizer, model, present)
    if _is_fsdp2(model):
        return _fsdp2_state_to_load(model, optimizer, present)
    return load_module_state(model, optimizer, present)


def _each_zero(state_of, composed, model, *args) -> tuple:
    """A composition's ZeROs (``parallel.compose_zero``: the dense parameters' and the experts',
    over their own groups) hold different parameters: their dicts side by side, finished in turn."""
    state, finishes = {}, []
    for zero in composed.zeros:
        part, finish = state_of(zero, model, *args)
        state.update(part)
        finishes.append(finish)

    def finish(loaded: dict) -> None:
        for each in finishes:
            each(loaded)

    return state, finish


def _fsdp2_flat(model, model_state, optim_state) -> dict:
    """torch's state dicts under our keys: a parameter once (a tied one under its first name, as
    ``named_parameters`` gives it), its optimizer state beside it."""
    names = dict(model.named_parameters())
    flat = {f"model.{k}": v for k, v in model_state.items() if k in names}
    flat.update(
        {
            f"optim.state.{name}.{key}": value
            for name, state in optim_state["state"].items()
            if name in names
            for key, value in state.items()
        }
    )
    return flat


def _fsdp2_state_to_load(model, optimizer, present):
    """torch's own path for FSDP2: ``get_state_dict`` gives DTensors (with the optimizer state
    initialised), DCP fills them, ``set_state_dict`` puts them back."""
    model_state, optim_state = get_state_dict(model, optimizer)
    flat = _fsdp2_flat(model, model_state, optim_state)
    first_name = {}  # a tied parameter's other names take the loaded tensor of its first
    for name, value in model_state.items():
        first_name.setdefault(id(value), name)

    missing = [k for k in flat if k.startswith("model.") and k not in present]
    if missing:
        raise KeyError(
            f"the checkpoint has no {missing[0]} (and {len(missing) - 1} more): it was saved from another model"
        )

    def finish(loaded: dict) -> None:
        for name, value in list(model_state.items()):
            model_state[name] = loaded.get(f"model.{first_name[id(value)]}", value)
        for name, state in optim_state["state"].items():
            for key in state:
                state[key] = loaded.get(f"optim.state.{name}.{key}", state[key])
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)

    return {k: v for k, v in flat.items() if k in present}, finish
