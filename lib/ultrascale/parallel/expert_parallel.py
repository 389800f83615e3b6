"""Expert parallelism (EP): the experts of every MoE layer split over ranks, tokens sent to them.

Files for the basic form, in reading order: ``moe.py`` (the MoE layer whose experts are
split), this module (``apply_ep``), ``comm/functional.py`` (``all_to_all``) and ``mesh.py`` (the
ep group); ``grad_sync.py`` combines the gradients.

An MoE layer (``ultrascale.moe``) holds E expert MLPs. Under EP over ``ep`` ranks, rank r
keeps only experts ``r*E/ep .. (r+1)*E/ep - 1`` (``local_experts``): the expert weights,
their gradients and optimizer states shrink ep times. Everything else (attention, norms,
embeddings, the routers) stays replicated, and each rank trains on *different* tokens, as
in data parallelism: EP "borrows" the data-parallel ranks for the experts.

In every MoE layer, after the router has chosen each token's top-k experts:

1. **plan** (``dispatch_plan``): one row per (token, destination rank). A token whose k
   experts live on one rank is sent there once, with the ids and weights of the experts it
   uses there. The rows are sorted by destination, so each rank's rows are one slice;
2. **exchange the split sizes**: a rank knows how many rows it sends to each rank, not
   how many it will receive, so one tiny all-to-all of the counts comes first;
3. **dispatch**: ``all_to_all_single`` with those (uneven) splits sends the rows, and their
   expert ids and weights, to the ranks that hold the experts;
4. the rank runs its local experts (``moe.apply_experts``, tokens gathered per expert) and
   weights and sums the outputs per row;
5. **combine**: the reverse all-to-all brings each row back to its token's rank, where it is
   added to its token (``index_add`` over the plan's rows: the original order again).

The all-to-alls are ``comm.functional.all_to_all``, so backward sends the gradients back
the same way. ``CommLogger`` counts them under the labels "ep routing" (counts and ids),
"ep dispatch" and "ep combine" in forward (backward's are plain ``all_to_all_single``).
Group-limited routing (``GPTConfig.group_limit``, DeepSeek's node-limited routing) caps the
ranks a token reaches, hence the rows of step 1: the traffic it removes shows in the log.

**Gradients.** Each rank's loss is the mean over its own tokens, and the model's loss is
the mean over the D ranks with different data (D = ep, or dp * ep with data parallelism).
A dense parameter's gradient is therefore averaged over those D ranks. An expert's
gradient already *sums* the contributions of every ep rank's tokens (the all-to-all's
backward brought them to it), so it is summed over the expert's replicas (the dp group)
and divided by D, not by the number of replicas (``average_in_backward``; both through
``grad_sync``, the helper every technique uses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.functional import all_to_all, rank_and_size
from ..comm.logger import labelled
from ..matching import match_plan
from ..moe import MoE, apply_experts
from .grad_sync import NO_REPLICAS, average_gradients, reduce_gradient, sync_in_backward
from .mesh import Mesh, axis_group
from .timeline import or_disabled

__all__ = [
    "apply_ep",
    "local_experts",
    "dispatch_plan",
    "exchange_counts",
    "ExpertParallelDispatch",
    "expert_parameters",
    "expert_parameter_names",
    "data_groups",
    "average_after_backward",
    "average_in_backward",
    "rank_load",
    "dispatch_volume",
    "DispatchPlan",
]

DEFAULT_PLAN = {"blocks.*.mlp": "ep"}


# --------------------------------------------------------------------------- placement
def local_experts(experts: int, ep: int, rank: int) -> range:
    """The experts rank ``rank`` of ``ep`` holds: an equal, contiguous share."""
    if experts % ep:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ValueError(
            f"ep={ep} does not divide the {experts} experts: every rank must hold the same number "
            f"of experts; use ep in {divisors} or a number of experts that {ep} divides"
        )
    per_rank = experts // ep
    return range(rank * per_rank, (rank + 1) * per_rank)


def rank_load(chosen: torch.Tensor, experts: int, ep: int) -> torch.Tensor:
    """(token, expert) choices that land on each rank: the compute each rank does."""
    return torch.bincount((chosen // (experts // ep)).flatten(), minlength=ep)


# --------------------------------------------------------------------------- dispatch and combine
@dataclass
class DispatchPlan:
    """Where this rank's tokens go: one row per (token, destination rank), by destination."""

    rows: torch.Tensor  # (R,) the token of each row
    local_ids: torch.Tensor  # (R, k) the expert at the destination (its local index), -1 if not there
    weights: torch.Tensor  # (R, k) the router weight of that expert, 0 where the id is -1
    send_counts: list  # rows for each rank: the input split sizes


def dispatch_plan(chosen, weights, ep: int, per_rank: int) -> DispatchPlan:
    """Rows to send for tokens that chose experts ``chosen`` (T, k) with ``weights`` (T, k)."""
    rows, here, local_ids, send_counts = dispatch_rows(chosen, ep, per_rank)
    return DispatchPlan(rows, local_ids, weights[rows] * here, send_counts)


def dispatch_rows(chosen, ep: int, per_rank: int):
    """``dispatch_plan``'s indices: the token of each row, which of its k choices the row carries
    (``here``, (R, k)), their local expert ids (-1 where not), and the rows for each rank."""
    tokens = chosen.shape[0]
    destination = chosen // per_rank  # (T, k) rank of each choice
    sends = torch.zeros(ep, tokens, dtype=torch.bool, device=chosen.device)
    sends[destination, torch.arange(tokens, device=chosen.device)[:, None].expand_as(chosen)] = True
    ranks, rows = sends.nonzero(as_tuple=True)  # by rank, then by token
    here = destination[rows] == ranks[:, None]  # which of a row's k choices it carries
    local_ids = torch.where(here, chosen[rows] - ranks[:, None] * per_rank, -1)
    return rows, here, local_ids, torch.bincount(ranks, minlength=ep).tolist()


def exchange_counts(send_counts: list, group=None, device=None) -> list:
    """How many rows each rank will send to this one: an all-to-all of one number per rank."""
    counts = torch.tensor(send_counts, dtype=torch.int64, device=device)
    return all_to_all(counts, group=group).tolist()


class ExpertParallelDispatch:
    """``MoE.experts_forward`` under EP: dispatch, local experts, combine (steps 1-5 above)."""

    def __init__(self, experts: nn.ModuleDict, num_experts: int, group=None, timeline=None):
        self.experts, self.group, self.timeline = experts, group, or_disabled(timeline)
        self.ep = dist.get_world_size(group)  # apply_ep checked the group
        self.per_rank = num_experts // self.ep

    def __call__(self, tokens, chosen, weights):
        plan = dispatch_plan(chosen, weights, self.ep, self.per_rank)
        send = plan.send_counts
        with labelled("ep routing"):
            receive = exchange_counts(send, self.group, tokens.device)
            ids = all_to_all(plan.local_ids, receive, send, self.group)
        with labelled("ep dispatch"):
            x = all_to_all(tokens[plan.rows], receive, send, self.group)
            w = all_to_all(plan.weights, receive, send, self.group)
        y = self._local_experts(x, ids, w)
        with labelled("ep combine"):
            back = all_to_all(y, send, receive, self.group)  # the reverse exchange
        return tokens.new_zeros(tokens.shape).index_add(0, plan.rows, back)

    def _local_experts(self, x, ids, w):
        with self.timeline.span("experts"):
            return apply_experts(list(self.experts.values()), x, ids, w)


def dispatch_volume(
    send_counts: list,
    receive_counts: list,
    rank: int,
    hidden: int,
    top_k: int,
    element_size: int = 4,
    backward: bool = False,
) -> dict:
    """Bytes this rank sends in one MoE layer, per ``CommLogger`` label: the prediction the
    logged all-to-alls must equal (the rows a rank keeps never leave it). Forward by default;
    ``backward``: each all-to-all's gradient goes back the other way (unlabelled)."""
    out_rows = sum(send_counts) - send_counts[rank]
    back_rows = sum(receive_counts) - receive_counts[rank]
    if backward:  # the received rows' and weights' gradients return; the combine's go out again
        return {"all_to_all_single": element_size * ((hidden + top_k) * back_rows + hidden * out_rows)}
    n = len(send_counts)
    return {
        "ep routing": 8 * (n - 1) + 8 * top_k * out_rows,  # counts, then int64 ids
        "ep dispatch": element_size * (hidden + top_k) * out_rows,  # token rows and weights
        "ep combine": element_size * hidden * back_rows,
    }


# --------------------------------------------------------------------------- gradients
def expert_parameters(model: nn.Module) -> list:
    """The parameters of the experts of every MoE layer (sharded by EP); the others are dense."""
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The names of ``expert_parameters`` in ``model.named_parameters()``."""
    experts = {id(p) for p in expert_parameters(model)}
    return [name for name, p in model.named_parameters() if id(p) in experts]


def _reduce(grad, group, divisor: int):
    """One gradient as the hooks reduce it: summed over ``group`` (None: an expert without
    replica) and divided by ``divisor``. What chapter 08's exercise asks a learner to write."""
    return reduce_gradient(grad, NO_REPLICAS if group is None else group, divisor)


def _by_kind(model, data_group, expert_group):
    """[(parameters, group)]: the dense ones over ``data_group`` (None: all ranks), the experts
    over their replicas ``expert_group`` (None: no replica)."""
    experts = expert_parameters(model)
    ids = {id(p) for p in experts}
    dense = [p for p in model.parameters() if id(p) not in ids]
    return [(dense, data_group), (experts, NO_REPLICAS if expert_group is None else expert_group)]


def average_after_backward(model: nn.Module, data_group=None, expert_group=None) -> None:
    """After backward: dense gradients averaged over ``data_group`` (every rank with other
    tokens; None: all ranks), expert gradients summed over ``expert_group`` (the expert's
    replicas; None: no replica) and divided by the size of ``data_group``."""
    ranks = dist.get_world_size(data_group)
    for params, group in _by_kind(model, data_group, expert_group):
        average_gradients(params, group, divide_by=ranks)


def average_in_backward(model, data_group, expert_group) -> None:
    """``average_after_backward`` as hooks that run while backward computes each gradient, as
    context parallelism's do, so parity's plain training loop needs no extra call."""
    ranks = dist.get_world_size(data_group)
    for params, group in _by_kind(model, data_group, expert_group):
        sync_in_backward(params, group, divide_by=ranks, keep_as="_ep_grad_sync")


def data_groups(mesh_or_group, ep_group):
    """(dense data group, expert replica group) for the gradient hooks."""
    if not isinstance(mesh_or_group, Mesh):
        return ep_group or dist.group.WORLD, None
    if mesh_or_group.size("cp") > 1:
        raise ValueError(
            "apply_ep averages gradients over dp and ep only; with cp > 1 pass sync_gradients=False "
            "and average over (dp, ep, cp) yourself (parallel.compose does)"
        )
    if mesh_or_group.size("dp") == 1:
        return ep_group, None
    return mesh_or_group.group(("dp", "ep")), mesh_or_group.group("dp")


# --------------------------------------------------------------------------- apply
def apply_ep(
    model: nn.Module, mesh_or_group=None, *, plan: dict | None = None, timeline=None, sync_gradients: bool = True
) -> nn.Module:
    """Expert-parallel ``model`` over the ``ep`` axis of a mesh (or a group; None: all ranks).

    Every MoE layer matched by ``plan`` (``{module-name pattern: "ep"}``, default every
    block's ``mlp``) keeps only this rank's experts, under their global names
    (``blocks.0.mlp.experts.5.fc.weight`` on the rank holding expert 5), and sends tokens
    to them with ``ExpertParallelDispatch``. Build the model identically on every rank
    (same seed) before applying. ``sync_gradients``: average the gradients in backward
    (see the module docstring; with a mesh, over its (dp, ep) group, which ``init_mesh(...,
    joint=[("dp", "ep")])`` must have built). ``timeline``: per-block bars and the local
    experts' compute. Returns the model, changed in place.
    """
    group = axis_group(mesh_or_group, "ep")
    rank, ep = rank_and_size(group, "expert parallelism")
    plan = DEFAULT_PLAN if plan is None else plan
    # Patterns may name no MoE layer (dense MLPs are skipped); none at all is refused below, saying why.
    layers = [m for _, m, _ in match_plan(model, plan, kind=MoE, may_match_nothing=True)]
    if not layers:
        raise ValueError(
            f"no MoE layer matches the plan {sorted(plan)}: expert parallelism needs a mixture-of-"
            "experts model (e.g. GPTConfig(experts=8, top_k=2))"
        )
    for moe in layers:
        if isinstance(moe.experts, nn.ModuleDict):
            raise ValueError("expert parallelism is already applied to this model: build a fresh one")
        keep = local_experts(moe.num_experts, ep, rank)
        moe.experts = nn.ModuleDict({str(i): moe.experts[i] for i in keep})
        moe.experts_forward = ExpertParallelDispatch(moe.experts, moe.num_experts, group, timeline)
    if sync_gradients:
        average_in_backward(model, *data_groups(mesh_or_group, group))
    if timeline is not None and hasattr(model, "blocks"):
        timeline.instrument(model.blocks)
    return model
