"""A process mesh: the ranks laid out on named axes, one process group per axis.

5D parallelism (The Ultra-Scale Playbook) splits the same ranks in several ways at
once: data (``dp``), pipeline (``pp``), expert (``ep``), context (``cp``) and tensor
(``tp``) parallelism. Picture the ranks as an array of shape ``(dp, pp, ep, cp, tp)``,
``np.arange(world_size).reshape(...)``: a rank's index in that array is its coordinate,
and the ranks that differ only along one axis form that axis' group, e.g. the ranks
that all-reduce tensor-parallel activations together.

    mesh = Mesh(dp=2, tp=2)                 # pure layout, no processes needed
    mesh.coordinate(3)                      # {'dp': 1, 'tp': 1}
    mesh.group_ranks("tp")                  # [[0, 1], [2, 3]]
    print(mesh)                             # the rank -> coordinate table
    draw_mesh(mesh, color_by="tp")          # a picture (from ultrascale.viz.mesh)

    def fn(ctx):                            # on every rank (cluster.run or torchrun)
        mesh = init_mesh(ctx, dp=2, tp=2)   # groups built once per rank, then cached
        dist.all_reduce(x, group=mesh.group("tp"))

Axis order, outermost first, follows picotron (dp, pp, cp, tp), with ep just outside
cp as in Megatron-LM's default order. **ep is an axis like the others**: it is part of the
product, ``world_size = dp * pp * ep * cp * tp``. Dense (non-expert) layers are
replicated along ep, so their gradients are averaged over ``("dp", "ep")`` together:
build that group with ``init_mesh(..., joint=[("dp", "ep")])``. (Megatron and
torchtitan say the same thing the other way round: ep "borrows" ranks from dp.)
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np

# Outermost first. tp is innermost (fastest varying) so that a tp group is made of
# neighbouring ranks, i.e. GPUs of the same node: tp communicates in every layer,
# in the critical path, and needs NVLink. dp is outermost: its gradient all-reduce
# happens once per step and overlaps with the backward pass, so it can cross nodes.
# ep's all-to-all blocks every MoE layer, so it sits inside dp and pp, next to cp.
AXES = ("dp", "pp", "ep", "cp", "tp")

Axes = str | Iterable[str]  # one axis, or several taken together, e.g. ("dp", "cp")


class Mesh:
    """Named axis sizes, e.g. ``Mesh(dp=2, tp=2)``; axes left out have size 1.

    The layout part (coordinates, groups of ranks, the table) is pure Python. A mesh
    returned by :func:`init_mesh` also holds this rank's process groups.
    """

    def __init__(self, **sizes: int):
        for axis, size in sizes.items():
            if axis not in AXES:
                raise ValueError(f"unknown axis {axis!r}: the axes are {', '.join(AXES)}")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis} must be a positive integer, got {size!r}")
        # Keep the axes the caller named (size 1 included), in the canonical order.
        self.sizes: dict[str, int] = {a: sizes[a] for a in AXES if a in sizes}
        self.axes: tuple[str, ...] = tuple(self.sizes)
        self.shape: tuple[int, ...] = tuple(self.sizes.values())
        self.world_size: int = math.prod(self.shape)
        self.rank: int | None = None  # set by init_mesh, on a rank
        self._ctx = None
        self._groups: dict[tuple[str, ...], object] = {}
        self._split_groups: dict[tuple, tuple] = {}
        self._device_mesh = None

    @classmethod
    def from_sizes(cls, sizes: Mapping[str, int]) -> "Mesh":
        """``Mesh.from_sizes({"dp": 2, "pp": 1, "cp": 1, "tp": 2})``."""
        return cls(**sizes)

    def __reduce__(self):
        # A rank may return its mesh to the notebook: send the layout, not the groups.
        return (Mesh.from_sizes, (self.sizes,))

    # ------------------------------------------------------------- pure layout
    def size(self, axis: Axes) -> int:
        """How many ranks one group along ``axis`` (or axes) has; 1 for an absent axis."""
        return math.prod(self.sizes.get(a, 1) for a in _as_tuple(axis))

    def grid(self) -> np.ndarray:
        """The ranks as an array with one dimension per axis (as picotron builds it). A numpy
        array, not a torch tensor: the ranks are bookkeeping, and under a dry run's fake tensors
        (``dryrun.py``) a torch tensor made here would be fake, with no ranks in it to read."""
        return np.arange(self.world_size).reshape(self.shape)

    def coordinate(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits on each axis: ``Mesh(dp=2, tp=2).coordinate(3)`` is
        ``{'dp': 1, 'tp': 1}``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in this mesh of {self.world_size} ranks")
        coords, rest = {}, rank
        for axis in reversed(self.axes):  # innermost first: tp varies fastest
            rest, coords[axis] = divmod(rest, self.sizes[axis])
        return {a: coords[a] for a in self.axes}

    def rank_of(self, **coords: int) -> int:
        """The rank at these coordinates (the inverse of :meth:`coordinate`).
        Axes of size 1 may be left out; the others must be given."""
        rank = 0
        for axis in self.axes:
            if axis not in coords and self.sizes[axis] > 1:
                raise ValueError(f"rank_of needs a coordinate for {axis!r} (size {self.sizes[axis]})")
            index = coords.pop(axis, 0)
            if not 0 <= index < self.sizes[axis]:
                raise ValueError(f"{axis}={index} is outside 0..{self.sizes[axis] - 1}")
            rank = rank * self.sizes[axis] + index
        if coords:
            raise ValueError(f"{', '.join(coords)} not in this mesh (axes: {', '.join(self.axes)})")
        return rank

    def group_ranks(self, axis: Axes) -> list[list[int]]:
        """Every group along ``axis``: the ranks that differ only in that coordinate.

        ``Mesh(dp=2, tp=2).group_ranks("tp")`` is ``[[0, 1], [2, 3]]`` and
        ``group_ranks("dp")`` is ``[[0, 2], [1, 3]]``. Several axes, e.g.
        ``("dp", "cp")``, give the groups that vary along all of them.
        """
        dims = [self._dim(a) for a in self._key(axis)]
        others = [d for d in range(len(self.axes)) if d not in dims]
        # Move the group's axes last, then each row of the flattened grid is one group.
        return self.grid().transpose(others + dims).reshape(-1, self.size(axis)).tolist()

    def split_ranks(self, axis: Axes, outer: int) -> tuple[list[list[int]], list[list[int]]]:
        """Every group along ``axis`` cut into ``outer`` blocks of consecutive members, as hybrid
        sharding cuts the data ranks (``outer`` replicas, each sharded over one block). Returns
        (the blocks, the ranks at the same place of every block): (shard groups, replicate groups).
        ``Mesh(dp=4).split_ranks("dp", 2)`` is ``([[0, 1], [2, 3]], [[0, 2], [1, 3]])``."""
        size = self.size(axis)
        if isinstance(outer, bool) or not isinstance(outer, int) or outer < 1 or size % outer:
            raise ValueError(
                f"cannot cut groups of {size} ranks along {axis} into {outer!r} equal blocks: "
                f"choose one of {[d for d in range(1, size + 1) if size % d == 0]}"
            )
        blocks, across = [], []
        for group in self.group_ranks(axis):
            grid = np.array(group).reshape(outer, size // outer)
            blocks += grid.tolist()
            across += grid.T.tolist()
        return blocks, across

    def check_world_size(self, world_size: int) -> None:
        """Refuse a mesh that does not cover exactly ``world_size`` ranks."""
        if self.world_size != world_size:
            product = " x ".join(f"{a}={s}" for a, s in self.sizes.items()) or "(no axes)"
            raise ValueError(
                f"{product} = {self.world_size} ranks, but the cluster has {world_size}: "
                f"choose sizes whose product is {world_size}"
            )

    def table(self) -> str:
        """One line per rank with its coordinates, for printing in a notebook."""
        width = max(4, len(str(self.world_size - 1)))
        lines = ["rank".rjust(width) + "".join(a.rjust(4) for a in self.axes)]
        for rank in range(self.world_size):
            coords = self.coordinate(rank).values()
            lines.append(str(rank).rjust(width) + "".join(str(c).rjust(4) for c in coords))
        return "\n".join(lines)

    def group_map(self, axes: Iterable[Axes] | None = None) -> dict:
        """The rank-to-group map: ``{axis: group_ranks(axis)}`` for every axis (default: the
        axes of size > 1), or for the given axes and joint tuples of axes."""
        axes = [a for a in self.axes if self.sizes[a] > 1] if axes is None else list(axes)
        return {a if isinstance(a, str) else "x".join(a): self.group_ranks(a) for a in axes}

    def groups_table(self, axes: Iterable[Axes] | None = None) -> str:
        """The rank-to-group map as text, one axis per line: which ranks communicate together."""
        groups = self.group_map(axes)
        width = max(len(a) for a in groups) if groups else 4
        return "\n".join(
            f"{a.ljust(width)}  " + " ".join("[" + " ".join(map(str, g)) + "]" for g in gs) for a, gs in groups.items()
        )

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{a}={s}' for a, s in self.sizes.items())})"

    def __str__(self) -> str:
        return f"{self!r}: {self.world_size} ranks\n{self.table()}"

    def _dim(self, axis: str) -> int:
        if axis not in self.sizes:
            raise ValueError(f"{axis!r} is not an axis of {self!r}: name it, with size 1 if need be, to get its groups")
        return self.axes.index(axis)

    def _key(self, axis: Axes) -> tuple[str, ...]:
        """Axes in canonical order, so ("cp", "dp") and ("dp", "cp") are the same group."""
        return tuple(sorted(set(_as_tuple(axis)), key=self._dim))

    # ------------------------------------------------- this rank (after init_mesh)
    def group(self, axis: Axes):
        """This rank's process group along ``axis`` (or a ``joint`` tuple of axes)."""
        key = self._key(axis)
        self._require_rank()
        if key not in self._groups:
            raise ValueError(
                f"no group along {key}: init_mesh built {sorted(self._groups)}; "
                "ask for groups over several axes with init_mesh(..., joint=[...])"
            )
        return self._groups[key]

    def split_groups(self, axis: Axes, outer: int) -> tuple:
        """This rank's two process groups of :meth:`split_ranks`: (its block, its group across
        the blocks). Collective on first use (call on every rank), then kept."""
        self._require_rank()
        key = (self._key(axis), outer)
        if key not in self._split_groups:
            mine = []
            for groups in self.split_ranks(axis, outer):  # every rank creates every group, in order
                created = [self._ctx.new_group(ranks) for ranks in groups]
                mine.append(next(g for g, ranks in zip(created, groups) if self.rank in ranks))
            self._split_groups[key] = tuple(mine)
        return self._split_groups[key]

    def rank_in(self, axis: Axes) -> int:
        """This rank's index within its group along ``axis``: 0 for an absent axis."""
        self._require_rank()
        if isinstance(axis, str) and axis not in self.sizes:
            return 0
        group = next(g for g in self.group_ranks(axis) if self.rank in g)
        return group.index(self.rank)

    def _require_rank(self) -> None:
        if self.rank is None:
            raise RuntimeError("this mesh has no process groups: build it on the ranks with init_mesh(ctx, ...)")

    def to_device_mesh(self):
        """The same layout as a torch ``DeviceMesh`` (for DTensor, FSDP2, ...).

        Created on first use and kept: like ``new_group``, it is collective, so call
        it on every rank.
        """
        if self._device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            device_type = "cuda" if self._ctx.device.type == "cuda" else "cpu"
            self._device_mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.axes)
        return self._device_mesh


def init_mesh(ctx, *, joint: Iterable[tuple[str, ...]] = (), **sizes: int) -> Mesh:
    """This rank's :class:`Mesh`, with one process group per axis (and per ``joint``).

    ``new_group`` is collective and slow, so the groups are built once per rank and
    the mesh is kept in ``ctx.state``: later ``cluster.run`` calls with the same sizes
    get the same mesh and the same groups back. Call it on every rank.
    """
    mesh = Mesh(**sizes)
    joint = [mesh._key(axes) for axes in joint]
    key = ("mesh", tuple(mesh.sizes.items()), tuple(joint))
    if key not in ctx.state:
        mesh.check_world_size(ctx.world_size)
        mesh.rank, mesh._ctx = ctx.rank, ctx
        for axes in [(a,) for a in mesh.axes] + joint:
            mesh._groups[axes] = _build_groups(ctx, mesh, axes)
        ctx.state[key] = mesh
    return ctx.state[key]


def _build_groups(ctx, mesh: Mesh, axes: tuple[str, ...]):
    """Create every group along ``axes`` and return the one holding this rank.

    torch requires *every* rank to call ``new_group`` for *every* group, in the same
    order, even for groups it is not in. ``ctx.new_group`` also caches by ranks, so two
    meshes (or two axes of size 1) that need the same group share it.
    """
    mine = None
    for ranks in mesh.group_ranks(axes):
        group = ctx.new_group(ranks)
        if ctx.rank in ranks:
            mine = group
    return mine


def _as_tuple(axis: Axes) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def axis_group(mesh_or_group, axis: Axes):
    """The process group a technique works on: ``mesh.group(axis)`` for a mesh built by
    ``init_mesh``, or the group itself (None: all ranks). This is what lets every
    ``apply_<technique>(model, mesh_or_group)`` take either."""
    return mesh_or_group.group(axis) if isinstance(mesh_or_group, Mesh) else mesh_or_group
