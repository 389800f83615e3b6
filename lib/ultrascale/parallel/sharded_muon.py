"""Muon on weights sharded per parameter (``fsdp.apply_fsdp``), in one process or on ranks.

Muon (Keller Jordan, 2024; ``torch.optim.Muon``) steps a weight matrix with an
orthogonalised momentum: ``buf = momentum * buf + (1 - momentum) * grad``, then the
Newton-Schulz iteration turns ``grad + momentum * (buf - grad)`` (Nesterov) into a nearby
matrix with all singular values near 1, and the weight moves by ``lr * sqrt(max(1, rows/cols))``
times that. The momentum is elementwise, so a rank can keep it for its own rows; the
Newton-Schulz step multiplies whole matrices (``X Xᵀ``), so it needs every row at once.
That is why Muon cannot simply run on shards as Adam does. Two ways out, both here:

* ``mode="gather"``: every rank all-gathers each matrix's update, orthogonalises the whole
  matrix itself and keeps its own rows. One all-gather per matrix; every rank repeats all the
  Newton-Schulz work.
* ``mode="owners"``: matrices are dealt round-robin to owner ranks (matrix i to rank i mod N,
  as nanochat's and torchtitan's distributed Muon deal them). Each owner gathers its matrices'
  rows, orthogonalises them, and scatters the rows back. Two collectives per matrix, but each
  rank does only 1/N of the Newton-Schulz work.

``Muon(params)`` without ``fsdp`` is Muon on whole matrices (one process, or replicated
weights): the reference both modes must equal, itself checked against ``torch.optim.Muon``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..comm.functional import all_gather_into
from .fsdp import pad_rows

__all__ = ["Muon", "newton_schulz", "adjusted_lr"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's a, b, c (torch.optim.Muon's)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype=torch.bfloat16) -> torch.Tensor:
    """An approximately orthogonal matrix near ``g`` (singular values pushed to about 1), in ``dtype``."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.shape[0] > g.shape[1]
    if tall:  # iterate on the small Gram matrix
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, shape) -> float:
    """Muon's learning rate for a ``rows x cols`` matrix: larger for tall ones (torch's "original")."""
    return lr * math.sqrt(max(1.0, shape[0] / shape[1]))


class Muon(torch.optim.Optimizer):
    """Muon on 2-D parameters: whole ones, or shards made by ``apply_fsdp`` (pass ``fsdp=model.fsdp``
    and a ``mode``, "gather" or "owners"). Defaults as ``torch.optim.Muon``'s; ``ns_dtype``:
    the Newton-Schulz iteration's dtype (bf16 as torch's; float64 for exact parity checks)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        eps=1e-7,
        ns_dtype=torch.bfloat16,
        fsdp=None,
        mode=None,
    ):
        if (fsdp is None) != (mode is None) or mode not in (None, "gather", "owners"):
            raise ValueError(
                "pass fsdp=model.fsdp with mode='gather' or 'owners' for sharded weights, neither for whole ones"
            )
        super().__init__(
            params,
            dict(
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                eps=eps,
                ns_dtype=ns_dtype,
            ),
        )
        self.fsdp, self.mode = fsdp, mode
        for group in self.param_groups:
            for p in group["params"]:
                shape = self.full_shape(p)
                if len(shape) != 2:
                    raise ValueError(
                        f"Muon steps matrices; got a parameter of shape {tuple(shape)}: "
                        "give biases, norms and embeddings to AdamW"
                    )

    def full_shape(self, p) -> torch.Size:
        return p.shape if self.fsdp is None else self.fsdp.entry(p).full_shape

    @torch.no_grad()
    def step(self, closure=None):
        index = 0  # the matrix's place in the round-robin deal
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    update = self.momentum_update(p, group)
                    ortho = self.orthogonalise(p, update, group, index)
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(ortho.to(p.dtype), alpha=-adjusted_lr(group["lr"], self.full_shape(p)))
                index += 1

    def momentum_update(self, p, group) -> torch.Tensor:
        """The momentum step, elementwise: on a shard it is exactly the shard of the whole one."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - group["momentum"])
        return p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def orthogonalise(self, p, update, group, index) -> torch.Tensor:
        """Newton-Schulz on the whole matrix; this rank's rows of the result."""
        ns = dict(steps=group["ns_steps"], eps=group["eps"], dtype=group["ns_dtype"])
        entry = None if self.fsdp is None else self.fsdp.entry(p)
        if entry is None or not entry.sharded:  # a whole matrix: nothing to gather
            return newton_schulz(update, **ns)
        fsdp = self.fsdp
        padded = pad_rows(update, entry.rows)
        if self.mode == "gather":  # everyone gets the whole matrix and does the work
            whole = padded.new_empty(fsdp.n * entry.rows, padded.shape[1])
            all_gather_into(whole, padded, fsdp.shard_group)
            return _my_rows(newton_schulz(whole[: entry.full_shape[0]], **ns), entry, fsdp)
        owner = index % fsdp.n  # "owners": one rank does this matrix's work
        owner_global = dist.get_global_rank(fsdp.shard_group, owner) if fsdp.shard_group is not None else owner
        mine = dist.get_rank(fsdp.shard_group) == owner
        pieces = [torch.empty_like(padded) for _ in range(fsdp.n)] if mine else None
        dist.gather(padded, pieces, dst=owner_global, group=fsdp.shard_group)
        if mine:
            ortho = newton_schulz(torch.cat(pieces)[: entry.full_shape[0]], **ns).to(padded.dtype)
            # contiguous: a tall matrix comes back transposed, and a collective sends raw memory
            pieces = list(pad_rows(ortho.contiguous(), fsdp.n * entry.rows).split(entry.rows))
        out = torch.empty_like(padded)
        dist.scatter(out, pieces, src=owner_global, group=fsdp.shard_group)
        return out[: p.shape[0]]


def _my_rows(whole: torch.Tensor, entry, fsdp) -> torch.Tensor:
    start = dist.get_rank(fsdp.shard_group) * entry.rows
    return whole[start : start + entry.param.shape[0]]
