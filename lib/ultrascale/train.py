"""The course's train.py: the one training loop, its optimizers, and reading what it trained.

    losses = run_steps(model, data.global_stream(), steps=3, optimizer="sgd")   # data: a data.Batches
    final = weights(model)                           # every parameter by name, on the CPU

Every technique trains with this loop, so two runs can differ only by the technique.
A distributed run passes its wrapper and its hook after backward:

    ours = train(model, data.rank_stream(ctx.rank, ctx.world_size), steps=3, optimizer="sgd",
                 module=dp, after_backward=dp.finish_gradient_synchronization)

* ``run_steps``: forward, backward, gradient accumulation, optional ``no_sync``, a hook
  after backward, the step; it returns the loss curve. ``train`` runs it and returns the
  final weights. ``run_pipeline_steps`` is the same loop for a pipeline, which takes a step's
  micro-batches all at once.
* ``make_optimizer``: an optimizer by course name (``OPTIMIZERS``: "sgd", "adam", "adamw").
* ``weights`` and ``gradients``: a model's parameters and gradients as plain CPU tensors,
  a DTensor (FSDP2, DTensor TP) gathered first.
"""

from __future__ import annotations

import contextlib

import torch

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
}


def make_optimizer(params, optimizer: str = "sgd", **overrides):
    """A torch optimizer by course name ("sgd", "adam", "adamw") with its default settings."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {sorted(OPTIMIZERS)}")
    cls, kwargs = OPTIMIZERS[optimizer]
    return cls(params, **{**kwargs, **overrides})


# --------------------------------------------------------------------------- the loop
def train(model, batches, steps: int, optimizer="sgd", **options) -> dict:
    """``run_steps`` and then the final weights by name (see ``weights``)."""
    run_steps(model, batches, steps, optimizer, **options)
    return weights(model)


def run_steps(
    model,
    batches,
    steps: int,
    optimizer="sgd",
    *,
    grad_acc: int = 1,
    module=None,
    no_sync=None,
    after_backward=None,
    device=None,
    first_step: int = 0,
) -> list:
    """Train ``model`` for ``steps`` optimizer steps: the one training loop of the course.

    ``batches(step, micro)`` gives each micro-batch; losses are divided by ``grad_acc`` so
    the accumulated gradient is the mean over the step's micro-batches.
    ``optimizer``: a course name ("sgd", "adam", "adamw"), or an object with ``step`` and
    ``zero_grad`` (a torch optimizer, or ZeRO, which is its own optimizer). A name builds a
    fresh optimizer, so to go on over several calls pass the same object each time.
    ``module``: what to call for the forward, if not ``model`` (e.g. a DP wrapper).
    ``no_sync``: a context manager factory used for all micro-batches but the last
    (DDP's and our DP's ``no_sync``). ``after_backward``: called after every backward
    that is not inside ``no_sync`` (our DP's ``finish_gradient_synchronization``; DDP
    does that job inside backward by itself). ``first_step``: the index of the first
    step's data, to go on where an earlier call stopped. Returns the loss curve: each
    step's loss on this process (the mean over its micro-batches), as floats.
    """
    module = model if module is None else module
    opt = make_optimizer(model.parameters(), optimizer) if isinstance(optimizer, str) else optimizer
    losses = []
    for step in range(first_step, first_step + steps):
        loss = 0.0
        for micro in range(grad_acc):
            local = no_sync is not None and micro < grad_acc - 1
            with no_sync() if local else contextlib.nullcontext():
                batch = batches(step, micro)
                part = batch.to(device).loss(module) / grad_acc
                part.backward()
                loss += part.item()
            if after_backward is not None and not local:
                after_backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses


def run_pipeline_steps(pipe, batches, steps: int, optimizer="sgd", first_step: int = 0, *, device=None) -> list:
    """``run_steps`` for a pipeline (``parallel.pipeline_parallel.Pipeline``): each step,
    ``pipe.step`` on the m micro-batches ``batches(step, micro)`` (the same ones
    ``run_steps(..., grad_acc=m)`` trains one process on), moved to ``device`` as in
    ``run_steps``, then the optimizer. Returns the losses (None on ranks without the last stage)."""
    m = pipe.schedule.microbatches
    opt = make_optimizer(pipe.parameters(), optimizer) if isinstance(optimizer, str) else optimizer
    losses = []
    for step in range(first_step, first_step + steps):
        losses.append(pipe.step([batches(step, micro).to(device) for micro in range(m)]))
        opt.step()
        opt.zero_grad()
    return losses


# --------------------------------------------------------------------------- reading
def cpu_copy(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """A plain CPU copy; a DTensor (FSDP2, DTensor TP) is gathered first (a collective)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    needed = (t.storage_offset() + t.numel()) * t.element_size()
    if t.numel() and t.untyped_storage().nbytes() < needed:
        # Reading a freed storage would crash the process, not raise.
        raise RuntimeError(
            f"{name}: its storage is freed (ZeRO-3 keeps only a shard between "
            "forwards); read the weights with zero.full_state_dict() instead"
        )
    return t.detach().cpu().clone()


def weights(model) -> dict:
    """Every parameter by name, as plain CPU tensors."""
    return {name: cpu_copy(p, name) for name, p in model.named_parameters()}


def gradients(model) -> dict:
    """Every gradient by name (None where a parameter has none), as plain CPU tensors."""
    return {name: None if p.grad is None else cpu_copy(p.grad, name) for name, p in model.named_parameters()}
