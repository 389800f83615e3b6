"""ZeRO's sharded training state: measured, and saved and resumed.

Each rank holds its share of the parameters, gradients and optimizer states;
:class:`ShardedState` counts those bytes (``state_bytes``; the book's per-rank formula they
are compared with is ``memory.zero_formula_bytes``, kept there with the other formulas so that
this file needs none of them), gathers every parameter in full (``full_state_dict``), and saves
and resumes this rank's share (``state_dict`` / ``load_state_dict``): the master shard of
every unit and the optimizer state of its pieces, on the same world size and stage.

:class:`ShardedState` is a part of :class:`~ultrascale.parallel.zero.ZeRO`; it reads ZeRO's
units and pieces and calls its public ``use_pieces`` and ``publish_master``, nothing private.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from .flat import Piece

__all__ = ["ShardedState"]


class ShardedState:
    """The inspection and checkpoint methods of :class:`~ultrascale.parallel.zero.ZeRO`."""

    @property
    def num_parameters(self) -> int:
        """The trainable parameters (the Ψ of the formulas); frozen ones are left out."""
        return sum(u.numel for u in self.all_units)

    def state_bytes(self) -> dict:
        """Bytes this rank holds now: parameters, gradients, optimizer (fp32 master + states).
        Frozen parameters are the model's, not ZeRO's: they are not counted."""
        nbytes = lambda t: 0 if t is None else t.untyped_storage().nbytes()  # noqa: E731
        units = self.all_units
        params = sum(nbytes(u.full) + nbytes(u.shard) for u in units)
        grads = sum(nbytes(u.grad_full) + nbytes(u.grad_shard) for u in units)
        grads += sum(nbytes(p.grad) for u in units for p in u.params)
        states = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        optimizer = sum(nbytes(u.master) for u in units) + sum(nbytes(t) for t in states)
        return {"parameters": params, "gradients": grads, "optimizer states": optimizer}

    def gathered(self):
        """Every unit's whole parameters while inside, to read them: at stage 3 a collective
        (``zero3.py`` gathers the shards, and frees them again after); below it they are whole."""
        return contextlib.nullcontext() if self.sharding is None else self.sharding.gathered()

    def full_state_dict(self) -> dict:
        """Every parameter in full on every rank (a collective: call it on all ranks)."""
        with self.gathered():
            return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's share of the training state: its master shard of every unit and
        the optimizer state of its pieces (with their layout). Save it on every rank;
        ``load_state_dict`` resumes on the same world size and stage, each rank its own.
        Frozen parameters and buffers are the model's: save them with the model."""
        return {
            "stage": self.stage,
            "world_size": self.world_size,
            "rank": self.rank,
            "units": [(u.name, u.numel) for u in self.all_units],
            "pieces": [(self.all_units.index(pc.unit), pc.index, pc.group) for pc in self.pieces],
            "master": [u.master.clone() for u in self.all_units],
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
        }  # not live references

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` (a collective at stages 1 and 2: call it on all ranks)."""
        for key in ("world_size", "stage", "rank"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"this ZeRO state dict was saved with {key}={state[key]}, but this ZeRO has "
                    f"{key}={getattr(self, key)}: a sharded state resumes only on the same world "
                    "size and stage, each rank loading the state dict it saved"
                )
        if state["units"] != [(u.name, u.numel) for u in self.all_units]:
            raise ValueError(
                "this ZeRO state dict was saved for other units or another model: "
                f"{state['units']} != {[(u.name, u.numel) for u in self.all_units]}"
            )
        ranges = [{r[0]: r for r in u.owned_ranges()} for u in self.all_units]
        pieces = [Piece(self.all_units[k], [ranges[k][i] for i in index], g) for k, index, g in state["pieces"]]
        self.use_pieces(pieces)  # the optimizer's state refers to pieces by position
        self.optimizer.load_state_dict(state["optimizer"])
        for unit, master in zip(self.all_units, state["master"]):
            unit.master.copy_(master)
        self.publish_master()  # the parameters are the master weights, rounded
