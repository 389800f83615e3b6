"""Checking pipelines: a pipeline's first step and training against gradient accumulation in
one process, sleep-calibrated compute for measuring the bubble, and PyTorch's
``torch.distributed.pipelining`` on the very same stages.

    pipe = apply_pp(GPT(config), schedule="1f1b", microbatches=m)        # ours
    torch_pipe = pytorch_pipeline(GPT(config), schedule="1f1b", microbatches=m)   # PyTorch's
    per_rank = cluster.run(lambda ctx: first_step_and_train(pipe, batches, steps=3))
    assert_same_as_one_process(per_rank, one_process(GPT(config), batches, m, 3, fresh=...), "1F1B")

The pipeline's training loop itself is ``train.run_pipeline_steps`` (techniques train with
it; this module only checks). ``pytorch_pipeline`` wraps the same stage modules
(``stage_modules``) in ``PipelineStage``s and runs them with the PyTorch schedule of the same
name: ``ScheduleGPipe`` (AFAB), ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble`` (ZB-H1 with one stage per rank) or ``ScheduleDualPipeV``.
Its ``pipeline_order()`` gives PyTorch's per-rank compute actions in our notation, to set
against our generators' lists.
"""

from __future__ import annotations

import contextlib

import torch

from ..data import Batch
from ..model import lm_loss
from ..parallel.mesh import axis_group
from ..parallel.pipeline_parallel import Pipeline
from ..schedule import Action, duration, make_schedule
from ..train import gradients, run_pipeline_steps, run_steps, weights
from . import assert_same, merge_ranks

__all__ = [
    "PyTorchPipeline",
    "TORCH_SCHEDULES",
    "assert_same_as_one_process",
    "calibrate_compute",
    "first_step_and_train",
    "one_process",
    "pytorch_pipeline",
]


def first_step_and_train(pipe: Pipeline, batches, steps: int, optimizer="sgd", *, device=None) -> dict:
    """This rank's share of a pipeline's parity check: the first step's loss (None off the last
    stage), gradients and activations held at once, then ``steps`` optimizer steps from step 0's
    data on, then the weights. Set against ``one_process`` with ``assert_same_as_one_process``.
    ``device``: where the micro-batches go (``ctx.device``), as in ``run_pipeline_steps``."""
    m = pipe.schedule.microbatches
    loss = pipe.step([batches(0, micro).to(device) for micro in range(m)])
    out = {"loss": loss, "grads": pipe.gradients(), "peak": pipe.peak_activations}
    pipe.zero_grad()
    run_pipeline_steps(pipe, batches, steps, optimizer, device=device)
    return {**out, "weights": pipe.weights()}


def one_process(model, batches, m: int, steps: int, optimizer="sgd", fresh=None) -> dict:
    """Gradient accumulation over the m micro-batches ``batches(step, micro)`` in one process:
    the loss and gradients of step 0 and, on ``fresh()`` (a model equal to ``model``), the weights
    after ``steps`` steps: what ``first_step_and_train`` gives, merged over the ranks."""
    grads = []
    with torch.no_grad():
        loss = sum(batches(0, micro).loss(model) / m for micro in range(m))
    # no_sync: the hook runs once per step, after the last micro-batch's backward
    run_steps(
        model,
        batches,
        1,
        optimizer,
        grad_acc=m,
        no_sync=contextlib.nullcontext,
        after_backward=lambda: grads.append(gradients(model)),
    )
    model = fresh()
    run_steps(model, batches, steps, optimizer, grad_acc=m)
    return {"loss": loss, "grads": grads[0], "weights": weights(model)}


def assert_same_as_one_process(per_rank: list, want: dict, what: str, optimizer="sgd") -> None:
    """``first_step_and_train``'s results of every rank against ``one_process``'s: one loss, on
    the last stage's rank; every gradient and weight by name, none missing or extra."""
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    assert len(losses) == 1, f"{what}: exactly one rank holds the last stage"
    assert_same(losses[0], want["loss"], f"{what}: loss", optimizer=None)
    assert_same(merge_ranks([r["grads"] for r in per_rank]), want["grads"], f"{what}: gradients", optimizer=None)
    assert_same(
        merge_ranks([r["weights"] for r in per_rank]),
        want["weights"],
        f"{what}: weights after the steps",
        optimizer=optimizer,
    )


# --------------------------------------------------------------------------- calibrated compute
def calibrate_compute(pipe: Pipeline, t_f: float, t_b: float | None = None, t_w: float | None = None) -> None:
    """Make every compute action last what the simulator gives it: F ``t_f / v`` seconds, a
    whole B ``t_b / v`` (default t_b = 2 t_f, the book's assumption), a split one
    ``(t_b - t_w) / v`` and W ``t_w / v`` (default t_w = t_b / 2), by sleeping what the real
    compute left of it. With times well above the model's compute, a measured bubble can be
    set against (p-1)/m whatever the machine. ``pipe.durations = None`` undoes it."""
    pipe.durations = lambda action: duration(action, pipe.schedule, t_f, 2 * t_f if t_b is None else t_b, t_w)


# --------------------------------------------------------------------------- PyTorch's own
TORCH_SCHEDULES = {
    "afab": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "dualpipe-v": "ScheduleDualPipeV",
}
_TORCH_OPS = {"F": "F", "B": "B", "I": "B", "W": "W"}  # PyTorch's I is our split B


def _stage_class(pipelining):
    """``PipelineStage``, less its warm-up messages to its own rank.

    Before its first step, a schedule sends each stage's neighbours a one-element tensor, so
    that every pair of ranks has a connection before the real traffic. Up to torch 2.11 it sends
    one even when the neighbour stage lives on the same rank, which happens at the turn of a V
    (DualPipeV puts stages p-1 and p on the last rank), and gloo, which has no connection from
    a rank to itself, fails with "Pair is not connected". Torch
    2.12 replaced that warm-up (the stages vote instead, and no longer call this method); on
    2.11 we leave those messages out here. The activations themselves never travel to the same
    rank: the schedule hands them over in memory.
    """
    import torch.distributed as dist

    class Stage(pipelining.PipelineStage):
        def _get_init_p2p_neighbors_ops(self):
            me = dist.get_rank(self.group)
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != me]

    return Stage


class PyTorchPipeline(Pipeline):
    """Our stages (same modules, names, tied-weight handling) run by a torch.distributed.pipelining
    schedule instead of our executor."""

    def __init__(self, model, name: str, schedule, group=None, plan=None):
        from torch.distributed import pipelining

        super().__init__(model, schedule, group, plan=plan)
        m = schedule.microbatches
        device = next(model.parameters()).device
        stage_class = _stage_class(pipelining)
        stages = [stage_class(chunk, int(s), schedule.stages, device, group=group) for s, chunk in self.chunks.items()]
        cls = getattr(pipelining, TORCH_SCHEDULES[name])
        single = name in ("afab", "1f1b")  # the schedules that take one stage, not a list
        # The loss divided by m, as ours, rather than scale_grads: that divides every stage's
        # gradients, so a weight shared by two stages of one rank (GPT's tied embedding on rank 0
        # of a V) would be divided twice.
        self.torch_schedule = cls(
            stages[0] if single else stages,
            n_microbatches=m,
            loss_fn=lambda logits, targets: lm_loss(logits, targets) / m,
            scale_grads=False,
        )

    def step(self, batches):
        """The same contract as ``Pipeline.step``: a Batch, or the list of its m micro-batches."""
        if not isinstance(batches, Batch):
            batches = Batch(torch.cat([b.inputs for b in batches]), torch.cat([b.targets for b in batches]))
        first, last = "0" in self.chunks, str(self.last) in self.chunks
        losses = [] if last else None
        args = (batches.inputs,) if first else ()
        kwargs = {"target": batches.targets, "losses": losses} if last else {}
        # Like ours, keep the losses but not the logits (by default the last stage concatenates them).
        self.torch_schedule.step(*args, return_outputs=False, **kwargs)
        if self.tied_peer is not None:
            self._add_tied_gradients()
        return sum(loss.detach() for loss in losses) if last else None

    def pipeline_order(self) -> list[list[Action]]:
        """PyTorch's compute actions per rank, in our notation (its overlapped F+B pairs unfolded)."""

        def ours(a):
            if a.sub_actions:
                return [x for sub in a.sub_actions for x in ours(sub)]
            op = _TORCH_OPS.get(a.computation_type.value)
            return [Action(op, a.microbatch_index, a.stage_index)] if op else []

        order = self.torch_schedule.pipeline_order
        return [[x for a in order[r] if a is not None for x in ours(a)] for r in sorted(order)]


def pytorch_pipeline(
    model, mesh_or_group=None, *, schedule: str = "1f1b", microbatches: int, chunks: int | None = None, plan=None
) -> PyTorchPipeline:
    """``apply_pp``'s counterpart run by torch.distributed.pipelining (see ``TORCH_SCHEDULES``)."""
    import torch.distributed as dist

    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: PyTorch's counterparts exist for {sorted(TORCH_SCHEDULES)}")
    group = axis_group(mesh_or_group, "pp")
    ours = make_schedule(schedule, dist.get_world_size(group), microbatches, chunks)
    return PyTorchPipeline(model, schedule, ours, group, plan)
