"""5D parallelism: the chapters' techniques applied together to one model, on one mesh.

Each technique of chapters 02-08 takes its own axis of the mesh (``parallel.mesh``):
``tp`` (tensor, with optional sequence parallelism), ``cp`` (context), ``ep`` (expert),
``pp`` (pipeline) and ``dp`` (data, plain or ZeRO). ``apply_parallelisms`` applies them
from outside in one fixed order (torchtitan splits the pipeline first and then applies TP and
FSDP to each stage; sharding before the split, as here, gives the same stages):

1. **TP/SP** swaps the linears for their sharded versions: it must see the whole model;
2. **CP** replaces the attention cores, and **EP** the MoE layers (they run inside a stage);
3. **PP** cuts what is left into stages; a stage keeps the layers TP already sharded, so
   every pipeline stage is itself tensor-parallel (the tp ranks of one stage share a pp
   coordinate, so the pipeline pairs ranks of equal tp coordinate);
4. **DP/ZeRO** last: it must see the parameters the others have sharded, and it averages
   the gradients over every rank that saw *different data* for the same parameter (ZeRO's
   composition, with experts, pipeline stages and ZeRO-3, is ``compose_zero``'s). With
   ``dp_shard`` the data ranks shard per parameter instead (``fsdp.apply_fsdp``, FSDP2's
   design): over ``dp_shard`` of the dp ranks (times cp), the parameters' replicas on the
   other ``dp / dp_shard`` blocks all-reducing their gradient shards: hybrid sharding (HSDP),
   torchtitan's ``dp_replicate x dp_shard``.

Every step receives the mesh and returns what it builds; ``apply_parallelisms`` alone wires
the pieces together, in this order, and nothing changes another technique's object after
building it (under ZeRO the pipeline is told when it is built that the tied weight's two
gradient parts are ZeRO's to add). DP's all-reduce runs at one point on every path: just
before the optimizer's step (``Parallelized.sync_gradients``).

Which ranks see different data? The dp ranks (different rows), the cp ranks (different
tokens of the same rows) and, for the dense layers of an MoE model, the ep ranks (different
rows too: ep "borrows" ranks from dp). So the dense gradients are averaged over the joint
group ``("dp", "ep", "cp")`` and the expert gradients over ``("dp", "cp")``: one all-reduce
per parameter does what CP's own gradient hook and DP's all-reduce would do one after the
other. The tp and pp ranks hold *different* parameters (or, for TP's replicated norms and
biases, the same gradient already), so nothing is reduced over them.

    config = ParallelConfig(dp=2, pp=2, tp=2, microbatches=2)
    def fn(ctx):
        mesh = build_mesh(ctx, config)
        par = apply_parallelisms(GPT(gpt_config), mesh, config)
        losses = par.train(par.batches(data), steps=3)   # data: a data.Batches
        return par.full_weights()                        # whole tensors, named as in the model

Checking a composition against one process (``train_composed``, ``train_one_process``,
``assert_composition_matches``) is ``parity.composition``'s.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..comm.functional import gather_along_dim
from ..data import Batches, split
from ..train import make_optimizer, run_pipeline_steps, run_steps
from .compose_zero import apply_zero_composed
from .context_parallel import apply_cp
from .data_parallel import apply_data_parallel
from .fsdp import apply_fsdp, full_state_dict
from .grad_sync import DATA_AXES
from .mesh import AXES, Mesh, init_mesh
from .pipeline_parallel import apply_pp
from .tensor_parallel import apply_tp

__all__ = [
    "ParallelConfig",
    "Parallelized",
    "apply_parallelisms",
    "build_mesh",
    "data_index",
    "mean_loss",
    "DENSE_AXES",
    "EXPERT_AXES",
    "JOINT_GROUPS",
    "rank_parameters",
]

DENSE_AXES = DATA_AXES["dense"]  # the ranks whose data differ, for a parameter every one of them holds
EXPERT_AXES = DATA_AXES["expert"]  # an expert lives on one ep rank: its replicas differ along dp and cp only
JOINT_GROUPS = [DENSE_AXES, EXPERT_AXES, ("dp", "ep")]
SPLIT_SCHEDULES = ("zb-h1", "dualpipe-v")  # their W fills .grad itself, past ZeRO's hooks


@dataclass(frozen=True)
class ParallelConfig:
    """The degree of every axis and how the data and pipeline axes run.

    ``zero``: 0 for plain data parallelism (an all-reduce of the gradients), 1, 2 or 3 for
    ZeRO over the data ranks (``compose_zero``: dense and expert parameters over their own
    groups). ``microbatches``: the pipeline's m (gradient
    accumulation without PP). ``dp_shard``: 0 leaves the data axis to ``zero``; ``k`` > 0
    shards each parameter over ``k`` of the dp ranks (and the cp ranks: they hold the same
    weights) and replicates over the ``dp / k`` blocks of them: FSDP when ``k = dp``, HSDP
    (``dp_replicate x dp_shard``) between 1 and dp.
    """

    dp: int = 1
    tp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    pp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int = 1
    cp_layout: str = "zigzag"
    optimizer: str = "sgd"
    dp_shard: int = 0

    def __post_init__(self):
        for axis in AXES + ("microbatches",):
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{axis} must be a positive integer, got {value!r}")
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism splits the sequence over the tp ranks: it needs tp > 1")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero!r}: 0 (plain DP), or the ZeRO stage 1, 2 or 3")
        if self.dp_shard:
            self._check_dp_shard()
        if self.sp and self.pp > 1 and self.cp > 1:
            raise ValueError(
                "this course's library does not compose sequence parallelism inside pipeline stages "
                "with context parallelism yet: a later stage, given SP's slice of hidden states, "
                "does not get the global positions of CP's layout (use sp=False with pp and cp, or "
                "no pp)"
            )
        if self.zero and self.pp > 1 and self.schedule in SPLIT_SCHEDULES:
            raise ValueError(
                f"this course's library does not compose ZeRO with the {self.schedule!r} schedule "
                "yet: it computes the weights' gradients apart (W) with autograd.grad, which "
                "bypasses the hooks that move them into ZeRO's flat buffers; use a schedule "
                "without a B/W split (afab, 1f1b, interleaved)"
            )

    def _check_dp_shard(self) -> None:
        shard = self.dp_shard
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 0 or self.dp % shard:
            raise ValueError(
                f"dp_shard={shard!r} must divide dp={self.dp} (the dp ranks are cut into dp / dp_shard "
                f"replicas of dp_shard shards): choose one of "
                f"{[d for d in range(1, self.dp + 1) if self.dp % d == 0]}, or 0 for no per-parameter "
                "sharding"
            )
        if self.zero:
            raise ValueError(
                f"zero={self.zero} and dp_shard={shard} both shard the data axis: choose ZeRO's flat "
                "units (zero=) or per-parameter sharding (dp_shard=), not both"
            )
        if self.pp > 1 or self.ep > 1:
            raise ValueError(
                "this course's library does not compose per-parameter sharding (dp_shard) with "
                "pipeline or expert parallelism yet: use zero= there"
            )

    @property
    def dp_replicate(self) -> int:
        """How many replicas of the model the dp ranks keep: dp / dp_shard (dp without dp_shard)."""
        return self.dp // self.dp_shard if self.dp_shard else self.dp

    @property
    def sizes(self) -> dict:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    def layout(self) -> Mesh:
        """The mesh of the axes used (size > 1), for printing and drawing."""
        used = {a: s for a, s in self.sizes.items() if s > 1}
        return Mesh(**(used or {"dp": 1}))

    def __str__(self) -> str:
        used = [f"{a}{s}" for a, s in self.sizes.items() if s > 1] or ["one rank"]
        extras = (["sp"] if self.sp else []) + ([f"zero{self.zero}"] if self.zero else [])
        if self.dp_shard:
            extras.append("fsdp" if self.dp_shard == self.dp else f"hsdp{self.dp_replicate}x{self.dp_shard}")
        return " x ".join(used) + "".join(f" +{e}" for e in extras)


def build_mesh(ctx, config: ParallelConfig) -> Mesh:
    """This rank's mesh of all five axes, with the joint data groups (call on every rank)."""
    if config.world_size != ctx.world_size:
        product = " x ".join(f"{a}={s}" for a, s in config.sizes.items() if s > 1) or "1"
        raise ValueError(
            f"{product} = {config.world_size} ranks, but the cluster has {ctx.world_size}: "
            f"choose degrees whose product is {ctx.world_size}"
        )
    return init_mesh(ctx, joint=JOINT_GROUPS, **config.sizes)


def data_index(mesh: Mesh, rank: int) -> tuple[int, int]:
    """Which rows a rank trains on: (index, ways) over the dp x ep ranks (dp outer)."""
    c = mesh.coordinate(rank)
    return c.get("dp", 0) * mesh.size("ep") + c.get("ep", 0), mesh.size(("dp", "ep"))


def mean_loss(per_rank_losses: list, mesh: Mesh) -> list:
    """The loss curve of the whole batch from every rank's curve: the mean over the ranks with
    different data (tp coordinate 0, and only the pipeline's last stage, which holds the loss)."""
    curves = [
        c
        for r, c in enumerate(per_rank_losses)
        if mesh.coordinate(r).get("tp", 0) == 0 and c is not None and None not in c
    ]
    return [sum(float(c[t]) for c in curves) / len(curves) for t in range(len(curves[0]))]


@dataclass
class Parallelized:
    """A model with every axis applied: what ``apply_parallelisms`` returns on each rank."""

    model: nn.Module  # after TP, CP and EP (the pipeline's stages share its layers)
    mesh: Mesh
    config: ParallelConfig
    pipeline: object = None  # the Pipeline, with pp > 1
    data_parallel: object = None  # plain DP's wrapper (no zero, dp_shard or ep; data ranks > 1)
    optimizer: object = None  # a torch optimizer, or compose_zero's ComposedZeRO
    shard_dims: dict = field(default_factory=dict)  # TP-sharded parameter name -> its split dim

    @property
    def module(self) -> nn.Module:
        """What holds this rank's parameters: the pipeline's stages, or the model."""
        return self.pipeline if self.pipeline is not None else self.model

    def batches(self, data: Batches):
        """``(step, micro) -> Batch``: this rank's share of ``data``: rows by its dp (x ep) index,
        then, under CP, its tokens of those rows in the CP layout, on the device of this rank's
        parameters (``data`` draws them on the CPU)."""
        index, ways = data_index(self.mesh, self.mesh.rank)
        cp, cp_rank = self.mesh.size("cp"), self.mesh.rank_in("cp")
        device = next(self.module.parameters()).device

        def stream(step, micro=0):
            rows = split(data.global_batch(step, ways, micro), index, ways, "data")
            rows = split(rows, cp_rank, cp, "sequence", self.config.cp_layout) if cp > 1 else rows
            return rows.to(device)

        return stream

    def train(self, batches, steps: int, first_step: int = 0) -> list:
        """``steps`` optimizer steps, each over ``config.microbatches`` micro-batches of
        ``batches(step, micro)``. Returns this rank's loss curve (None without the loss:
        a pipeline rank before the last stage)."""
        optimizer = _SyncThenStep(self)
        if self.pipeline is not None:
            losses = run_pipeline_steps(self.pipeline, batches, steps, optimizer, first_step)
            return [None if loss is None else float(loss) for loss in losses]
        return run_steps(
            self.model, batches, steps, optimizer, grad_acc=self.config.microbatches, first_step=first_step
        )

    def sync_gradients(self) -> None:
        """DP's all-reduce of the gradients summed over the step's micro-batches (nothing
        without the plain DP wrapper: ZeRO, FSDP and EP's hooks reduce in their own way).

        Run once per step, just before the optimizer, on both paths. The wrapper is naive DP,
        which reduces after the whole backward; the pipeline runs every micro-batch's backward
        inside ``Pipeline.step``, so the one point the two training loops share is the step
        itself. (Without a pipeline the same all-reduce could run after the last micro-batch's
        backward, but nothing happens in between: the same numbers.)"""
        if self.data_parallel is not None:
            self.data_parallel.finish_gradient_synchronization()

    def full_weights(self) -> dict:
        """This rank's parameters at full size (TP shards all-gathered over the tp group), named
        as in the whole model; merge the ranks' with ``parity.merge_ranks``. A collective."""
        with getattr(self.optimizer, "gathered", contextlib.nullcontext)():  # ZeRO-3's shards, whole
            return self._full_weights()

    def _full_weights(self) -> dict:
        out = {}
        chunks = self.pipeline.chunks.items() if self.pipeline is not None else [(None, self.model)]
        # per-parameter shards gathered over the data ranks first (TP's over tp below)
        gathered = full_state_dict(self.model) if self.config.dp_shard else {}
        for stage, chunk in chunks:
            for name, p in chunk.named_parameters():
                name = name if stage is None else self.pipeline.global_name(int(stage), name)
                t = gathered[name].to(p.device) if name in gathered else p.detach()
                if name in self.shard_dims:
                    with torch.no_grad():
                        t = gather_along_dim(t, self.shard_dims[name], self.mesh.group("tp"))
                out[name] = t.cpu().clone()
        return out


class _SyncThenStep:
    """The optimizer ``Parallelized.train`` steps: DP's gradient all-reduce first, then the update."""

    def __init__(self, par: Parallelized):
        self.par = par

    def step(self):
        self.par.sync_gradients()
        self.par.optimizer.step()

    def zero_grad(self):
        self.par.optimizer.zero_grad()


def _check_experts(model, ep: int) -> None:
    experts = getattr(getattr(model, "config", None), "experts", 0)
    if ep > 1 and not experts:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model (config.experts > 0); this one is dense")
    if ep > 1 and experts % ep:
        raise ValueError(
            f"ep={ep} does not divide the {experts} experts: every ep rank must hold the same "
            f"number of experts; choose ep in {[d for d in range(1, experts + 1) if experts % d == 0]}"
        )


def apply_parallelisms(model, mesh: Mesh, config: ParallelConfig) -> Parallelized:
    """Apply TP/SP, CP, EP, PP and then DP/ZeRO to ``model`` on ``mesh`` (from ``build_mesh``),
    each only where its degree is above 1. Returns a :class:`Parallelized` with its optimizer."""
    if mesh.sizes != config.sizes:
        raise ValueError(f"the mesh {mesh!r} does not have the degrees of {config}: build it with build_mesh")
    _check_experts(model, config.ep)
    if config.tp > 1:
        apply_tp(model, mesh, sequence_parallel=config.sp)
    shard_dims = {n: p.tp_shard_dim for n, p in model.named_parameters() if hasattr(p, "tp_shard_dim")}
    if config.cp > 1:  # the data-parallel all-reduce below also averages over cp
        apply_cp(model, mesh, layout=config.cp_layout, sync_gradients=False)
    if config.ep > 1:  # its gradients are averaged below, with cp's and dp's
        from .expert_parallel import apply_ep

        apply_ep(model, mesh, sync_gradients=False)
    pipeline = None
    if config.pp > 1:  # under ZeRO the tied weight's two parts are added by ZeRO, in its flat buffers
        pipeline = apply_pp(
            model, mesh, schedule=config.schedule, microbatches=config.microbatches, add_tied_after_step=not config.zero
        )
    data_parallel, optimizer = _apply_data_parallel(model, mesh, config, pipeline)
    return Parallelized(
        model, mesh, config, pipeline=pipeline, data_parallel=data_parallel, optimizer=optimizer, shard_dims=shard_dims
    )


def _apply_data_parallel(model, mesh: Mesh, config: ParallelConfig, pipeline=None) -> tuple:
    """Average the gradients over the ranks with different data: one group for a dense model;
    dense and expert parameters over their own groups for an MoE model. Returns the plain DP
    wrapper (None where ZeRO, FSDP or EP's hooks reduce instead) and the optimizer."""
    module = pipeline if pipeline is not None else model  # what holds this rank's parameters
    if config.zero:  # dense and expert parameters over their own groups, the tied weight summed
        return None, apply_zero_composed(model, mesh, stage=config.zero, optimizer=config.optimizer, pipeline=pipeline)
    if config.dp_shard:  # FSDP or HSDP: shard within a block of the data ranks, replicate across blocks
        shard_group, replicate_group = mesh.split_groups(DENSE_AXES, config.dp_replicate)
        apply_fsdp(module, (replicate_group if config.dp_replicate > 1 else None, shard_group))
        return None, make_optimizer(module.parameters(), config.optimizer)  # a plain one, on the shards
    optimizer = make_optimizer(module.parameters(), config.optimizer)
    if config.ep > 1:
        # An expert's gradient already sums every ep rank's tokens (the all-to-all brought them):
        # sum it over its replicas (dp x cp) and divide by all the data ranks; dense ones average
        # over (dp, ep, cp). Hooks in backward, as expert parallelism's own sync does.
        from .expert_parallel import average_in_backward

        average_in_backward(model, mesh.group(DENSE_AXES), mesh.group(EXPERT_AXES))
        return None, optimizer
    if mesh.size(DENSE_AXES) > 1:
        return apply_data_parallel(module, mesh.group(DENSE_AXES), kind="naive"), optimizer
    return None, optimizer


# --------------------------------------------------------------------------- what a rank holds
def rank_parameters(config, *, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Exactly how many parameters a rank of pipeline stage ``stage`` holds, for the course GPT
    under ``apply_tp`` and ``apply_pp`` (``memory.breakdown`` divides everything by tp*pp instead).

    Per block, TP splits the q, k, v, out, fc and proj weights (12h^2) and the biases of the
    column-parallel layers (q, k, v: 3h; fc: 4h); the row-parallel biases (out, proj: 2h) and the
    two LayerNorms (4h) stay whole on every tp rank. The tied embedding (v*h, split by vocabulary)
    lives on the first stage *and* on the last; the final LayerNorm (2h) on the last.
    """
    from .pipeline_parallel import split_layers

    h, v = config.hidden, config.vocab_size
    block = (12 * h * h + 7 * h) // tp + 6 * h
    total = len(split_layers(config.layers, pp)[stage]) * block
    if stage == 0:
        total += v * h // tp
    if stage == pp - 1:
        total += 2 * h + (v * h // tp if pp > 1 else 0)  # one tensor when one stage holds both ends
    return total
