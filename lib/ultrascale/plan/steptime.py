"""How long one training step takes under a configuration: the planner's cost model.

A step is ``gas`` micro-batches through the pipeline, then the gradient synchronisation.
For one micro-batch on the busiest GPU (the pipeline stage with the most layers):

* **compute**: the model's training FLOPs for ``mbs * seq`` tokens (``model.training_flops``:
  6N per token plus causal attention; N counts the active parameters of an MoE), times the
  stage's share of the layers, divided over the ``tp * cp`` GPUs that share the
  micro-batch, at ``hardware.achieved_flops(mbs * seq / cp)`` (lower for short micro-batches);
  recomputation adds a forward (full) or the
  attention scores' forward (selective);
* **TP**: with sequence parallelism, 4 all-gathers or reduce-scatters of the
  ``mbs * seq/cp * h`` activation per layer in forward and 4 in backward (4 more when a
  full recomputation repeats the forward). Each one's result is the next matmul's input,
  so none of it overlaps: it all adds up (async TP would hide some; see appendix A3);
* **CP**: ring attention passes each rank's K and V round the ``cp`` ranks, and backward
  passes K, V, dK and dV: it hides behind the attention it runs beside (chapter 06);
* **EP**: four all-to-alls per MoE layer (dispatch and combine, forward and backward) of
  the ``top_k`` copies of each token's hidden state, not overlapped (DeepSeek's DualPipe
  overlaps them; we do not model it);
* **PP**: one activation sent forward and one gradient sent back per stage boundary; each
  hides behind the next micro-batch's work (appendix A3's PP ratio) unless it is longer.

Then, per step:

* **bubble**: the pipeline's idle time, ``(pp - 1) / (v * gas)`` of the ideal time, the
  book's formula (``schedule.predicted_bubble_fraction``), with ``v`` chunks for an
  interleaved schedule;
* **DP**: the gradients of the stage's weights are all-reduced (reduce-scattered and
  all-gathered with ZeRO-1/2, the same bytes) over the ranks holding the same weights,
  hidden behind the last micro-batch's backward where it is shorter (appendix A3's DP
  ratio). ZeRO-3 instead gathers the weights in forward and again in backward and
  reduce-scatters the gradients in every micro-batch, hidden behind that micro-batch's
  forward and backward (appendix A3's ZeRO-3 ratio). Hybrid sharding (``dp_shard``) runs
  those over one replica's block of ``dp_shard * ep * cp`` ranks (inside a node when the
  block fits in one), then all-reduces the gradient shards (1/block of the weights) over
  the ``dp / dp_shard`` replicas once per step, on the link between them (between nodes as
  soon as the cluster is more than one), in the last backward beside its reduce-scatter.

Every collective is a ring on :class:`~ultrascale.comm.AlphaBeta` links (bus bandwidth,
so with ``alpha = 0`` each time is exactly appendix A3's ``t_comm``; ``Hardware.overlap=False``
hides nothing, as on a CPU whose collectives use the computing cores); a group runs on
NVLink when it fits in a node and on InfiniBand otherwise (``Hardware.link``), with the
mesh's axis order ``dp, pp, ep, cp, tp`` (tp innermost). Left out, and said here so that
nobody trusts the model beyond it: kernels running below ``achieved_flops`` as shards get
small, the optimizer step, the embedding and loss, load imbalance between experts, and the
SMs that communication kernels take from compute (the book's closing remark).
"""

from __future__ import annotations

import dataclasses
import math

from ..model import attention_flops_per_token, count_params, training_flops
from ..schedule.simulate import predicted_bubble_fraction
from .enumerate import ParallelConfig
from .hardware import Hardware

PARTS = ("compute", "recompute", "TP", "CP", "EP", "PP", "bubble", "DP")


def flops_config(model):
    """The config whose parameter count is what each token really multiplies with: for an
    MoE, the same model with only its ``top_k`` experts (the active parameters)."""
    experts = getattr(model, "experts", 0) or 0
    if experts:
        return dataclasses.replace(model, experts=getattr(model, "top_k", 1))
    return model


def micro_batch_flops(model, mbs: int, seq: int) -> float:
    """Model FLOPs of one micro-batch's forward and backward (causal attention)."""
    return training_flops(flops_config(model), mbs * seq, seq_len=seq, causal=True)


def recompute_flops(model, mbs: int, seq: int, mode: str) -> float:
    """FLOPs spent again by activation recomputation in one micro-batch's backward."""
    if mode == "full":  # the whole forward again: a third of forward + backward
        return micro_batch_flops(model, mbs, seq) / 3
    if mode == "selective":  # only the attention scores' forward
        return mbs * seq * attention_flops_per_token(model, seq, causal=True) / 3
    return 0.0


def tp_collectives(recompute: str) -> int:
    """All-gathers and reduce-scatters of a micro-batch's hidden state per layer under TP with SP:
    4 in forward, 4 in backward, and 4 more when full recomputation repeats the forward."""
    return 8 + (4 if recompute == "full" else 0)


def _p2p(link, nbytes: float) -> float:
    return float(link.message_time(nbytes))


def step_time(model, c: ParallelConfig, seq: int, hardware: Hardware) -> dict:
    """Seconds of one step, by part (``PARTS``), with ``"step"``, ``"mfu"`` and
    ``"tokens/s/gpu"``. See the module docstring for what each part counts."""
    hw, b = hardware, hardware.bytes_per_element
    L, h = model.layers, model.hidden
    stage_share = math.ceil(L / c.pp) / L  # the slowest stage's share of the layers
    layers = math.ceil(L / c.pp)
    split = c.tp * c.cp  # GPUs sharing one micro-batch in a stage
    flops = micro_batch_flops(model, c.mbs, seq)
    speed = hw.achieved_flops(c.mbs * seq / c.cp)  # rows of this GPU's matmuls
    compute = flops * stage_share / split / speed
    recompute = recompute_flops(model, c.mbs, seq, c.recompute) * stage_share / split / speed
    activation = c.mbs * (seq // c.cp) * h * b  # one hidden state of the micro-batch
    parts = dict.fromkeys(PARTS, 0.0)
    parts["compute"], parts["recompute"] = compute, recompute

    if c.tp > 1:
        parts["TP"] = tp_collectives(c.recompute) * layers * float(hw.link(1, c.tp).ring_phase_time(activation, c.tp))
    if c.cp > 1:
        kv = 2 * c.mbs * (seq // c.cp) * model.kv_heads * model.head_dim * b / c.tp  # K and V of one block
        sends = 3 * layers * (c.cp - 1) * _p2p(hw.link(c.tp, c.cp), kv)  # K,V fwd; K,V,dK,dV bwd
        attention = c.mbs * seq * attention_flops_per_token(model, seq, causal=True) * stage_share / split / speed
        parts["CP"] = _exposed(sends, attention, hw)
    if c.ep > 1:
        routed = c.mbs * (seq // c.cp) * getattr(model, "top_k", 1) * h * b / c.tp
        # an all-to-all is ep - 1 exchanges of routed/ep bytes: a ring phase's cost
        parts["EP"] = 4 * layers * float(hw.link(c.tp * c.cp, c.ep).ring_phase_time(routed, c.ep))
    if c.pp > 1:
        send = _p2p(hw.link(c.tp * c.cp * c.ep, c.pp), activation / c.tp)
        forward = compute / 3
        parts["PP"] = 2 * c.chunks * _exposed(send, forward, hw)

    micro_batch = sum(parts[k] for k in ("compute", "recompute", "TP", "CP", "EP", "PP"))
    for k in ("compute", "recompute", "TP", "CP", "EP", "PP"):
        parts[k] *= c.gas
    if c.pp > 1:
        parts["bubble"] = predicted_bubble_fraction(c.pp, c.gas, c.chunks) * c.gas * micro_batch
    parts["DP"] = _data_parallel_exposed(model, c, hw, compute + recompute)

    total = sum(parts.values())
    useful = flops * c.gas * c.replicas
    return {
        **parts,
        "step": total,
        "mfu": useful / (total * c.gpus * hw.peak_flops),
        "tokens/s/gpu": c.batch_tokens(seq) / (total * c.gpus),
    }


def _data_parallel_exposed(model, c: ParallelConfig, hw: Hardware, micro_batch_compute: float) -> float:
    """Seconds of gradient (and, for ZeRO-3, weight) traffic that the backward does not hide."""
    ranks = c.dp * c.ep * c.cp  # ranks holding the same (dense) weights
    if ranks == 1:
        return 0.0
    # the group spans the mesh from tp outwards to its outermost axis (dp is the outermost of all)
    link = hw.link(1, c.gpus if c.dp > 1 else c.tp * c.cp * c.ep)
    weights = count_params(model) / (c.tp * c.pp * c.ep) * hw.bytes_per_element
    forward, backward = micro_batch_compute / 3, 2 * micro_batch_compute / 3
    if c.zero == 3:
        replicas = c.dp_replicate
        if replicas > 1:  # HSDP: ZeRO-3 inside a block of gpus / replicas consecutive ranks
            link = hw.link(1, c.gpus // replicas)
        gather = float(link.ring_phase_time(weights, c.shard_ranks))
        per_micro_batch = _exposed(gather, forward, hw) + _exposed(2 * gather, backward, hw)  # AG; AG + RS
        if replicas == 1:
            return c.gas * per_micro_batch
        # HSDP's replicas all-reduce their gradient shards once per step, after the last reduce-scatter
        across = hw.link(c.gpus // replicas, replicas)
        all_reduce = float(across.ring_all_reduce_time(weights / c.shard_ranks, replicas))
        last = _exposed(gather, forward, hw) + _exposed(2 * gather + all_reduce, backward, hw)
        return (c.gas - 1) * per_micro_batch + last
    return _exposed(float(link.ring_all_reduce_time(weights, ranks)), backward, hw)


def _exposed(comm: float, window: float, hw: Hardware) -> float:
    """What shows of ``comm`` seconds of communication run beside ``window`` seconds of compute."""
    return max(0.0, comm - window) if hw.overlap else comm
