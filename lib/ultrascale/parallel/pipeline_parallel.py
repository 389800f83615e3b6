"""Pipeline parallelism: the course model cut into stages, run by a schedule's action lists.

Files for the basic form, in reading order: ``schedule/`` (the action lists, simulated and
checked), this module (``apply_pp``, which runs them), ``pipeline_messages.py`` (the
activations and gradients sent between stages, over ``comm/ring.py``'s paired send and
receive) and ``mesh.py`` (the pp group).

Pipeline parallelism (PP) gives each of the ``pp`` ranks a slice of the layers: the first
stage also holds the embedding, the last the final norm, the head and the loss. A batch is
cut into m micro-batches; activations go forward from stage to stage with ``send``/``recv``,
their gradients come back the same way. *When* each rank runs which forward and backward is
the schedule's business (``ultrascale.schedule``): AFAB, 1F1B, interleaved, ZB-H1, DualPipeV.
This module only executes, action by action, exactly the list the simulator checked::

    def fn(ctx):
        pipe = apply_pp(GPT(config), schedule="1f1b", microbatches=8)   # this rank's stage(s)
        opt = make_optimizer(pipe.parameters(), "sgd")
        loss = pipe.step(micro_batches(batch, 8))   # forward + backward of the whole batch
        opt.step()

How the actions run on a rank:

* ``F``: the stage's forward; the last stage adds the loss, divided by m so that the summed
  gradients are the mean over the batch, as in single-process gradient accumulation;
* ``B``: ``torch.autograd.backward`` from the stage's output with the gradient received from
  the next stage. Split (Zero Bubble), B is ``torch.autograd.grad`` for the *input* only (the
  previous stage is waiting for it) and keeps the graph; ``W`` later asks the same graph for
  the weights' gradients. Our W walks the backward again, so it repeats the input-side work;
  torch's ``stage_backward_weight`` keeps B's intermediate gradients to avoid that;
* ``send_*``: ``isend``, never blocking, waited for at the end of the step; ``recv_*``:
  ``irecv`` and wait, right before the action that needs it, in the order the sender sent
  (NCCL's rule). The messages are their own idea, in ``pipeline_messages.py``
  (``StageMessages``, a part of ``Pipeline``).

Two stages on one rank (interleaving, V schedules) hand activations over without a message.
GPT ties the head to the embedding: that weight lives on the first and the last stage, and
each sees only its part of the gradient, so the two ranks add their parts (Megatron-LM's
"embedding group") after the backward. Every rank builds the whole model from the same seed
and keeps its layers: simple, and fine for the course's models (a 70B model would be built
on the meta device instead).
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..data import Batch, micro_batches
from ..model import lm_loss
from ..schedule import Schedule, event_name, make_schedule
from .mesh import axis_group
from .pipeline_messages import StageMessages, twin_group
from .timeline import or_disabled

__all__ = ["Pipeline", "apply_pp", "backward_input", "backward_weight", "build_stage", "split_layers", "stage_modules"]


# --------------------------------------------------------------------------- cutting the model
def split_layers(layers: int, stages: int, plan=None) -> list[range]:
    """The blocks of each stage: ``plan`` (layers per stage) or as even as possible, the extra
    layers on the first stages. ``split_layers(8, 3)`` -> ranges 0-2, 3-5, 6-7."""
    if stages > layers:
        raise ValueError(
            f"{stages} stages but the model has {layers} layers: every stage needs at least one "
            f"block. Use p*v <= {layers} (fewer ranks or chunks) or a model with more layers"
        )
    sizes = list(plan) if plan is not None else [layers // stages + (s < layers % stages) for s in range(stages)]
    if len(sizes) != stages or sum(sizes) != layers or min(sizes) < 1:
        raise ValueError(f"plan={plan}: give {stages} layer counts, each >= 1, that add up to {layers}")
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [range(start, start + n) for start, n in zip(starts, sizes)]


def build_stage(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """A shallow copy of ``model`` with only ``layers`` of its blocks, the embedding if it is the
    ``first`` stage, norm and head if it is the ``last``. It shares the model's parameters, and
    runs the model's own forward: a stage without embedding takes hidden states, one without
    head returns them (model.py allows exactly that)."""
    stage = copy.copy(model)
    for name, value in vars(model).items():  # own tables of modules and hooks: the model is not changed
        if isinstance(value, dict):
            stage.__dict__[name] = type(value)(value)
    stage.blocks = nn.ModuleList(model.blocks[i] for i in layers)
    if not first:
        stage.embed = None
    if not last:
        stage.norm, stage.head = None, None
    stage.layers = layers  # which blocks of the whole model these are, for global names
    return stage


def stage_modules(model: nn.Module, schedule: Schedule, rank: int, plan=None) -> dict[int, nn.Module]:
    """Rank ``rank``'s stages of ``model`` under ``schedule``'s placement: {stage index: module}."""
    split = split_layers(len(model.blocks), schedule.stages, plan)
    last = schedule.stages - 1
    return {s: build_stage(model, split[s], s == 0, s == last) for s in schedule.stages_of(rank)}


def _tied(model) -> bool:
    return model.embed is not None and model.head is not None and model.head.weight is model.embed.weight


def _sequence_shards(model) -> int:
    """Over how many ranks the activations between blocks are split along the sequence: tp
    under sequence parallelism (its embedding scatters the sequence, its head gathers it), else 1."""
    embed = getattr(model, "embed", None)
    if not getattr(embed, "sequence_parallel", False):
        return 1
    return dist.get_world_size(embed.group)


# --------------------------------------------------------------------------- the B/W split
def backward_input(output, stage_input, grad_output):
    """Zero Bubble's B: the gradient of ``stage_input`` only, which the previous stage waits
    for. The graph is kept (``retain_graph``): W needs it."""
    return torch.autograd.grad(output, stage_input, grad_output, retain_graph=True)[0]


def backward_weight(output, params, grad_output) -> None:
    """Zero Bubble's W: the gradients of ``params`` from the graph B kept, added to ``.grad`` as
    ``backward()`` would add them (so micro-batches accumulate). It walks the graph again from
    the output, repeating the input-side work that B did."""
    grads = torch.autograd.grad(output, params, grad_output, allow_unused=True)
    for p, g in zip(params, grads):
        if g is not None:
            p.grad = g if p.grad is None else p.grad.add_(g)


# --------------------------------------------------------------------------- executing a schedule
@dataclass
class _StepState:
    """Everything one step keeps between actions, by (micro-batch, stage)."""

    batches: list
    inputs: dict = field(default_factory=dict)  # stage inputs (leaves that require grad past stage 0)
    outputs: dict = field(default_factory=dict)  # stage outputs (the loss on the last stage)
    grads: dict = field(default_factory=dict)  # gradients of the stage outputs
    input_grads: dict = field(default_factory=dict)  # gradients of the stage inputs, to send back
    inbox: dict = field(default_factory=dict)  # messages received before they are needed
    received: dict = field(default_factory=dict)  # sender rank -> how many of its messages we took
    sends: list = field(default_factory=list)  # isend works, waited for at the end
    sent: list = field(default_factory=list)  # and their tensors, kept alive until then
    saved: dict = field(default_factory=dict)  # activation bytes autograd keeps, per (mb, stage)
    loss: torch.Tensor | float = 0.0
    held: int = 0


class Pipeline(StageMessages, nn.Module):
    """This rank's stages of a model and the schedule that runs them (what ``apply_pp`` returns).

    ``step(micro_batches)`` runs the forward and backward of a whole batch and leaves the
    gradients, summed over the micro-batches, in ``.grad``; call the optimizer after it.
    After a step, ``peak_activations`` is the most (micro-batch, stage) pairs whose activations
    this rank held at once (the simulator's number), and with ``measure_activations`` the
    bytes autograd saved for them, ``peak_activation_bytes``.
    """

    def __init__(
        self,
        model,
        schedule: Schedule,
        group=None,
        timeline=None,
        plan=None,
        measure_activations: bool = False,
        add_tied_after_step: bool = True,
    ):
        super().__init__()
        self.group, self.schedule, self.timeline = group, schedule, or_disabled(timeline)
        self.rank, size = dist.get_rank(group), dist.get_world_size(group)
        if size != schedule.ranks:
            raise ValueError(
                f"the schedule is for p={schedule.ranks} ranks but the pipeline group has {size}: "
                f"build the schedule with p={size}"
            )
        # The messages' group down the ranks (pipeline_messages). Made here, where every rank of the
        # pipeline is, rather than at a rank's first message, when its neighbours may be waiting on it.
        self.group_down = twin_group(group) if size > 1 else group
        self.chunks = nn.ModuleDict({str(s): m for s, m in stage_modules(model, schedule, self.rank, plan).items()})
        self.last = schedule.stages - 1
        self.hidden, self.dtype = model.config.hidden, next(model.parameters()).dtype
        self.sequence_shards = _sequence_shards(model)  # the messages' split of the sequence
        self.measure_activations, self.tied = measure_activations, _tied(model)
        self.peak_activations = self.peak_activation_bytes = 0
        self.durations = None  # action -> least seconds it lasts (pipeline_runs.calibrate_compute)
        self.arrivals = self._arrivals()
        # The tied embedding/head weight, and the rank holding its other half (None: nothing to add).
        ends = {schedule.rank_of(0), schedule.rank_of(self.last)}
        self.tied_peer = (ends - {self.rank}).pop() if self.tied and len(ends) == 2 and self.rank in ends else None
        # False when the gradients live elsewhere than .grad (ZeRO's flat buffers): then whoever
        # keeps them adds the two parts with add_tied (parallel.compose_zero).
        self.add_tied_after_step = add_tied_after_step

    def forward(self, *args, **kwargs):
        raise TypeError(
            "a pipeline runs forward and backward together, micro-batch by micro-batch: call pipe.step(micro_batches)"
        )

    # ------------------------------------------------------------------ one step
    def step(self, batches) -> torch.Tensor | None:
        """Forward and backward of the m micro-batches (a list, or one Batch cut into m).
        Returns the mean loss on the rank holding the last stage, None on the others."""
        m = self.schedule.microbatches
        batches = micro_batches(batches, m) if isinstance(batches, Batch) else list(batches)
        if len(batches) != m:
            raise ValueError(f"the schedule is for m={m} micro-batches, got {len(batches)}")
        st = _StepState(batches)
        self.peak_activations = self.peak_activation_bytes = 0
        for action in self.schedule.actions(self.rank):
            getattr(self, "_" + action.op)(action, st)
        for work in st.sends:
            work.wait()
        st.sent.clear()
        if self.tied_peer is not None and self.add_tied_after_step:
            self._add_tied_gradients()
        return st.loss if str(self.last) in self.chunks else None

    def _F(self, a, st):
        key, batch = (a.microbatch, a.stage), st.batches[a.microbatch]
        x = batch.inputs if a.stage == 0 else st.inputs[key]
        with self._compute(a), self._saved_bytes(key, st):
            y = self.chunks[str(a.stage)](x)
            if a.stage == self.last:  # the loss of one micro-batch, weighted as in gradient accumulation
                y = lm_loss(y, batch.targets) / len(st.batches)
                st.loss = st.loss + y.detach()
        st.inputs[key], st.outputs[key] = x, y
        st.held += 1
        self.peak_activations = max(self.peak_activations, st.held)
        if a.stage < self.last and self.schedule.rank_of(a.stage + 1) == self.rank:  # next chunk is ours
            st.inputs[(a.microbatch, a.stage + 1)] = y.detach().requires_grad_()

    def _B(self, a, st):
        key = (a.microbatch, a.stage)
        y, x = st.outputs[key], st.inputs[key]
        dy = None if a.stage == self.last else st.grads.pop(key)
        with self._compute(a):
            if key in self.schedule.split_backward:  # B: the input's gradient only, the graph kept for W
                dx = backward_input(y, x, dy) if a.stage > 0 else None
                st.grads[key] = dy
            else:  # the whole backward: .grad of the weights too
                torch.autograd.backward(y, dy)
                dx = x.grad if a.stage > 0 else None
                self._free(key, st)
        if a.stage > 0:
            if self.schedule.rank_of(a.stage - 1) == self.rank:
                st.grads[(a.microbatch, a.stage - 1)] = dx
            else:
                st.input_grads[key] = dx

    def _W(self, a, st):
        key = (a.microbatch, a.stage)
        params = [p for p in self.chunks[str(a.stage)].parameters() if p.requires_grad]
        with self._compute(a):
            backward_weight(st.outputs[key], params, st.grads.pop(key))
        self._free(key, st)

    def _free(self, key, st):
        """The backward is over: drop the graph and with it the activations."""
        st.outputs.pop(key)
        st.inputs.pop(key)
        st.held -= 1
        st.saved.pop(key, None)

    # ------------------------------------------------------------------ instrumentation
    @contextlib.contextmanager
    def _compute(self, action):
        """A compute action's bar; with ``durations`` set, it lasts at least its simulated time."""
        with self._span(action):
            start = time.perf_counter()  # inside the bar: the bar then lasts at least the duration
            yield
            if self.durations is not None:
                time.sleep(max(0.0, self.durations(action) - (time.perf_counter() - start)))

    def _span(self, action, name=None, lane="compute"):
        return self.timeline.span(name or event_name(action), lane)

    @contextlib.contextmanager
    def _saved_bytes(self, key, st):
        """Count the bytes autograd saves in this forward (one allocation once, weights left out)."""
        if not self.measure_activations:
            yield
            return
        weights = {p.untyped_storage().data_ptr() for p in self.parameters()}
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        st.saved[key] = sum(storages.values())
        self.peak_activation_bytes = max(self.peak_activation_bytes, sum(st.saved.values()))

    # ------------------------------------------------------------------ reading it whole
    def global_name(self, stage: int, name: str) -> str:
        """A chunk's parameter name as in the whole model ("blocks.0..." of stage 2 -> "blocks.4...")."""
        chunk = self.chunks[str(stage)]
        if name.startswith("blocks."):
            index, rest = name[len("blocks.") :].split(".", 1)
            return f"blocks.{chunk.layers[int(index)]}.{rest}"
        if name == "head.weight" and self.tied:
            return "embed.weight"  # GPT's tied weight: named after the embedding in the whole model
        return name

    def _named(self, what):
        out = {}
        for s, chunk in self.chunks.items():
            for name, p in chunk.named_parameters():
                t = p if what == "weights" else p.grad
                out[self.global_name(int(s), name)] = None if t is None else t.detach().cpu().clone()
        return out

    def weights(self) -> dict:
        """This rank's parameters, named as in the whole model (merge the ranks' with ``merge_ranks``)."""
        return self._named("weights")

    def gradients(self) -> dict:
        return self._named("gradients")


# --------------------------------------------------------------------------- the technique
def apply_pp(
    model,
    mesh_or_group=None,
    *,
    schedule="1f1b",
    microbatches: int | None = None,
    chunks: int | None = None,
    plan=None,
    timeline=None,
    measure_activations: bool = False,
    add_tied_after_step: bool = True,
) -> Pipeline:
    """This rank's part of ``model`` under pipeline parallelism, as a :class:`Pipeline`.

    ``schedule``: a name from ``ultrascale.schedule.SCHEDULES`` ("afab", "1f1b", "interleaved",
    "zb-h1", "dualpipe-v", ...), built for the pp group's size, ``microbatches`` (m) and
    ``chunks`` (v); or a ready :class:`~ultrascale.schedule.Schedule` (yours, say).
    ``plan``: the number of layers of each stage (default: as even as possible).
    ``timeline``: a ``Timeline`` that gets every action as a bar ("forward 3 stage 1", ...),
    which ``schedule.draw`` and ``schedule.bubble_fraction`` read.
    ``add_tied_after_step``: whether ``step`` adds the two ends' parts of a tied weight's gradient
    in ``.grad`` (False when another technique keeps the gradients, as ZeRO does in its flat
    buffers, and adds them itself with ``Pipeline.add_tied``).
    """
    group = axis_group(mesh_or_group, "pp")
    if isinstance(schedule, str):
        if microbatches is None:
            raise ValueError("say how many micro-batches the batch is cut into: apply_pp(..., microbatches=m)")
        schedule = make_schedule(schedule, dist.get_world_size(group), microbatches, chunks)
    elif microbatches is not None and microbatches != schedule.microbatches:
        raise ValueError(f"microbatches={microbatches}, but the schedule is for m={schedule.microbatches}")
    return Pipeline(model, schedule, group, timeline, plan, measure_activations, add_tied_after_step)
