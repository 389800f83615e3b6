"""A rank's part of a global tensor as DCP chunks, including the pieces ZeRO's flat shards hold.

``torch.distributed.checkpoint`` (DCP) stores each tensor under its global shape, as
*chunks*: boxes of the global tensor (an offset and a size along every dimension). A DTensor
or a tensor-parallel shard is one box per rank, and DCP knows how to save those. ZeRO's flat
shards are not boxes: a rank's shard of a flat buffer is a run of consecutive elements that
may start and end in the middle of a row of a weight (and holds padding after the last
parameter). So the course cuts each such run into at most a few boxes (:func:`flat_boxes`:
a partial row, whole rows, a partial row) and hands DCP a :class:`Pieces`, one global tensor
held as several local boxes. Saved that way, a checkpoint names no rank, world size or
padding: only global tensors, which any layout can read back its own boxes of.

``Pieces`` speaks DCP's chunk protocol (the ``__create_write_items__`` /
``__create_chunk_list__`` methods DTensor implements), and :class:`PiecesSavePlanner` /
:class:`PiecesLoadPlanner` extend DCP's default planners at the one point the planners offer
for it (``lookup_object`` / ``lookup_tensor``: which local tensor a chunk's index means).
Everything else (the global plan, deduplicating replicas, reading overlapping chunks of
another layout, the files) is DCP's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["Box", "Pieces", "flat_boxes", "PiecesSavePlanner", "PiecesLoadPlanner"]


@dataclass
class Box:
    """One box of a global tensor: where it starts, its sizes, and the local tensor holding it."""

    offsets: tuple
    sizes: tuple
    tensor: torch.Tensor


def flat_boxes(shape, start: int, stop: int) -> list[tuple[tuple, tuple]]:
    """Elements ``start:stop`` of a row-major tensor of ``shape``, flattened, as boxes
    ``(offsets, sizes)`` in the same order. Each box is contiguous in the flat order, so a
    flat slice of the same length, reshaped to ``sizes``, is that box's data."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (stop - start,) if shape else ())]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    if start % row == 0 and stop % row == 0:  # whole rows only: one box
        return [((first,) + (0,) * (len(shape) - 1), (last - first + 1,) + shape[1:])]
    if first == last:  # inside one row: recurse into it
        return [((first,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], start - first * row, stop - first * row)]
    head_stop = (first + 1) * row if start % row else start  # a partial first row, whole rows, a partial last
    tail_start = last * row if stop % row else stop
    return (
        flat_boxes(shape, start, head_stop)
        + flat_boxes(shape, head_stop, tail_start)
        + flat_boxes(shape, tail_start, stop)
    )


def _in_global(offsets: tuple, shard_shape, dim: int | None, index: int) -> tuple:
    """``offsets`` inside shard ``index`` (of shape ``shard_shape``) along ``dim``, as offsets in
    the global tensor: moved by the shards before it (unchanged when dim is None)."""
    if dim is None:
        return offsets
    return offsets[:dim] + (offsets[dim] + shard_shape[dim] * index,) + offsets[dim + 1 :]


def _grown(shape, dim: int | None, count: int) -> torch.Size:
    """The global shape of ``count`` shards of ``shape`` laid side by side along ``dim``."""
    shape = list(shape)
    if dim is not None:
        shape[dim] *= count
    return torch.Size(shape)


class Pieces:
    """A global tensor of ``shape`` of which this rank holds ``boxes`` (possibly none).

    Saving writes each box as a DCP chunk; loading fills each box in place (the boxes are
    views into the layout's own storage: ZeRO's master shard, an optimizer state)."""

    def __init__(self, shape, dtype, boxes: list[Box]):
        self.shape, self.dtype, self.boxes = torch.Size(shape), dtype, boxes

    @classmethod
    def of_flat_run(
        cls, shape, start: int, stop: int, run: torch.Tensor, dim: int | None = None, index: int = 0, count: int = 1
    ) -> "Pieces":
        """Elements ``start:stop`` of a flattened tensor of ``shape``, held in the 1-D ``run``.
        That tensor is the global one, or (``dim`` not None) shard ``index`` of ``count`` equal
        ones along ``dim``: ZeRO over tensor-parallel shards flattens the shard, so its boxes are
        cut in the shard and then moved to where the shard sits in the global tensor."""
        boxes, at = [], 0
        for offsets, sizes in flat_boxes(shape, start, stop):
            n = math.prod(sizes)
            boxes.append(Box(_in_global(offsets, shape, dim, index), sizes, run[at : at + n].view(sizes)))
            at += n
        return cls(_grown(shape, dim, count), run.dtype, boxes)

    @classmethod
    def of_shard(cls, local: torch.Tensor, dim: int | None, index: int, count: int) -> "Pieces":
        """A shard along ``dim`` (``index`` of ``count`` equal ones), or the whole tensor (dim None)."""
        offsets = _in_global((0,) * local.dim(), local.shape, dim, index)
        return cls(_grown(local.shape, dim, count), local.dtype, [Box(offsets, tuple(local.shape), local.detach())])

    def size(self) -> torch.Size:  # DCP compares it with the saved global size on load
        return self.shape

    # DCP's chunk protocol (as DTensor implements it)
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(b.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)),
                    properties=properties,
                    size=self.shape,
                ),
            )
            for b in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in self.boxes]

    def box_at(self, offsets) -> torch.Tensor:
        for b in self.boxes:
            if tuple(b.offsets) == tuple(offsets):
                return b.tensor
        raise KeyError(f"no box at {tuple(offsets)} of this {tuple(self.shape)} tensor on this rank")


def _find(state_dict, index: MetadataIndex):
    obj = state_dict[index.fqn]
    return obj.box_at(index.offset) if isinstance(obj, Pieces) else None


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner; a chunk of a :class:`Pieces` is read from its box."""

    def lookup_object(self, index: MetadataIndex):
        box = _find(self.state_dict, index)
        return super().lookup_object(index) if box is None else box.detach().clone()


class PiecesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; a chunk of a :class:`Pieces` is written into its box."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up makes DTensors of meta tensors and drops objects it does not know
        # (they become None); a Pieces is already the storage to fill: put it back.
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(pieces)
        self.state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        box = _find(self.state_dict, index)
        return super().lookup_tensor(index) if box is None else box
