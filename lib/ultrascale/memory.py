"""Memory of a training step: the analytic model and its measured counterpart.

Four consumers share a GPU: parameters, gradients, optimizer states and activations.
The analytic half predicts their bytes from a config (precision, recomputation, ZeRO
stage, TP/PP/CP degrees); the measured half counts the real bytes of a small model, on
CPU through autograd's saved-tensor hooks, on GPU through the CUDA caching allocator.
Sizes are in bytes; GB means 1e9 bytes, as in the book's tables.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .model import RECOMPUTE_MODES, LlamaConfig, count_params

GB = 1e9
GiB = 2**30
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


# --------------------------------------------------------------------------- model states
def model_state_bytes(n_params: int, mixed_precision: bool = True, fp32_grad_accum: bool = False) -> dict:
    """Bytes of parameters, gradients and Adam states for `n_params` parameters.

    Full precision: fp32 weights (4) and gradients (4), Adam momentum and variance (4 + 4).
    BF16 mixed precision: bf16 weights (2) and gradients (2) for compute, an fp32 "master"
    copy of the weights (4) that the optimizer updates, and the same Adam states (4 + 4).
    Both total 16 bytes per parameter. Accumulating gradients in fp32 (as nanotron does)
    adds an fp32 gradient buffer: 20 bytes per parameter.

    The keys are the course's one set (as in ``zero_bytes_per_rank`` and ``breakdown``):
    in mixed precision the fp32 master copy belongs to the optimizer, which alone reads
    it (k = 4 + 8 = 12 bytes per parameter), and an fp32 accumulation buffer to the
    gradients (2 + 4).
    """
    n = n_params
    if not mixed_precision:
        return {"parameters": 4 * n, "gradients": 4 * n, "optimizer states": 8 * n}
    return {"parameters": 2 * n, "gradients": (2 + (4 if fp32_grad_accum else 0)) * n, "optimizer states": (4 + 8) * n}


def zero_bytes_per_rank(
    n_params, stage: int, dp: int, k: float = 12, param_bytes: float = 2, grad_bytes: float = 2
) -> dict:
    """Per-rank model-state bytes under ZeRO with data-parallel degree `dp`.

    k is the optimizer bytes per parameter including the fp32 master weights (12 for Adam
    in mixed precision). Each stage shards one more kind of state across the dp ranks:
      stage 0: 2Ψ + 2Ψ + kΨ         stage 1: 2Ψ + 2Ψ + kΨ/Nd
      stage 2: 2Ψ + (2Ψ + kΨ)/Nd    stage 3: (2Ψ + 2Ψ + kΨ)/Nd
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if dp < 1:
        raise ValueError(f"data-parallel degree must be >= 1, got {dp}")
    shard = lambda sharded: dp if sharded else 1  # noqa: E731
    return {
        "parameters": param_bytes * n_params / shard(stage >= 3),
        "gradients": grad_bytes * n_params / shard(stage >= 2),
        "optimizer states": k * n_params / shard(stage >= 1),
    }


def zero_formula_bytes(zero, k: float = 12) -> dict:
    """``zero_bytes_per_rank`` for a built ``ZeRO`` (``parallel/zero.py``): its trainable
    parameters (Ψ), stage and group size, at its parameters' byte width (its gradients have
    the same). What its measured ``zero.state_bytes()`` is compared with."""
    width = zero.all_units[0].full.element_size()
    return zero_bytes_per_rank(zero.num_parameters, zero.stage, zero.world_size, k, width, width)


# --------------------------------------------------------------------------- activations
def activation_bytes(
    config,
    seq: int,
    micro_batch: int = 1,
    recompute: str = "none",
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
):
    """Activation bytes kept for backward by the transformer layers on one rank (16-bit activations).

    Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer
    Models", with s = seq, b = micro_batch, h = hidden, a = heads, t = tp, per layer:

    none, no TP:  s*b*h*(34 + 5*a*s/h)         the 5as/h term is the s x s attention scores,
                                               softmax and its dropout, quadratic in seq
    none, TP:     s*b*h*(10 + 24/t + 5*a*s/(h*t))
    none, TP+SP:  s*b*h/t*(34 + 5*a*s/h)
    selective:    the same without the 5as/h term (recompute only the attention scores in
                  backward): s*b*h*34, s*b*h*(10 + 24/t), 34*s*b*h/t
    full:         2*s*b*h, or 2*s*b*h/t with SP (keep only each layer's bf16 input; the one
                  layer being recomputed in backward briefly needs its full activations
                  again, which we leave out so that the three modes compare what is stored
                  across the step)

    Why 10 + 24/t: tensor parallelism splits what lives inside the sharded attention and
    MLP blocks (Q, K, V, the output projection's input, the MLP's hidden units: 24 of the
    34 bytes per token and hidden unit, and the scores, split by heads), but leaves the
    rest replicated on every TP rank: the two LayerNorm inputs (2 + 2), their outputs,
    which feed the first matmul of each block (2 + 2), and the dropout masks after
    attention and MLP (1 + 1), 10 bytes. Sequence parallelism splits those along the
    sequence, so everything divides by t. Without SP, full recomputation keeps the whole
    layer input on every rank; with SP each rank keeps its s/t slice.
    Embedding and logits activations are not counted, as in the paper.

    Context parallelism (``cp``) gives each rank seq/cp of the tokens through the whole
    layer, so every term divides by cp, on top of TP: the linear ones hold seq/cp tokens,
    and the score term holds seq/cp query rows against all seq keys. Ring attention (ours,
    like FlashAttention) keeps no scores at all but recomputes them in backward: for it
    take ``recompute="selective"``, which leaves the quadratic term out.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r}: choose one of {RECOMPUTE_MODES}")
    for name, degree in (("tp (the tensor-parallel degree)", tp), ("cp (the context-parallel degree)", cp)):
        if degree < 1 or int(degree) != degree:
            raise ValueError(f"{name} must be an integer >= 1, got {degree}")
    L, h, a = config.layers, config.hidden, config.heads
    tokens = seq * micro_batch
    quadratic = 0 if recompute == "selective" else 5 * a * seq * tokens  # split by TP's heads
    if recompute == "full":
        per_rank = _split(L * 2 * tokens * h, tp if sequence_parallel else 1)
    elif sequence_parallel:
        per_rank = _split(L * (34 * tokens * h + quadratic), tp)
    else:
        per_rank = L * 10 * tokens * h + _split(L * (24 * tokens * h + quadratic), tp)
    return _split(per_rank, cp)  # CP: every rank holds seq/cp of the tokens


def _split(total: int, ways: int):
    """``total`` bytes divided over ``ways`` ranks: an int when they divide evenly."""
    return total // ways if total % ways == 0 else total / ways


def pp_in_flight(schedule, pp: int, micro_batches: int, chunks: int | None = None) -> list[int]:
    """Per pipeline rank, the most micro-batches whose activations it holds at once (NB07).

    Counted in (micro-batch, chunk) pairs, each chunk holding 1/v of the rank's layers. The
    number is the simulator's (``ultrascale.schedule.simulate(...).peak_activations``), not a
    formula: AFAB holds all m on every rank, 1F1B ``min(p - rank, m)``, interleaved and Zero
    Bubble schedules what their order gives. ``schedule``: a name ("afab", "1f1b",
    "interleaved", "zb-h1", "dualpipe-v", ...) or a built ``Schedule`` for ``pp`` ranks.
    """
    from .schedule import Schedule, make_schedule, simulate  # pure Python, no torch

    if not isinstance(schedule, Schedule):
        schedule = make_schedule(schedule, pp, micro_batches, chunks)
    elif schedule.ranks != pp or schedule.microbatches != micro_batches:
        raise ValueError(
            f"the schedule is for p={schedule.ranks}, m={schedule.microbatches}; "
            f"got pp={pp}, micro_batches={micro_batches}"
        )
    return simulate(schedule).peak_activations


def expert_params(config) -> int:
    """Parameters in the experts of an MoE config, 0 for a dense one: E expert MLPs in every
    layer (GPT's fc and proj, 8h^2 + 5h each; Llama's gate, up and down, 3 h ffn each)."""
    experts = getattr(config, "experts", 0)
    if not experts:
        return 0
    h = config.hidden
    per_expert = 3 * h * config.ffn if isinstance(config, LlamaConfig) else 8 * h * h + 5 * h
    return config.layers * experts * per_expert


# --------------------------------------------------------------------------- one rank
def breakdown(
    config,
    *,
    seq=None,
    micro_batch=1,
    mixed_precision=True,
    fp32_grad_accum=False,
    recompute="none",
    zero_stage=0,
    tp=1,
    dp=1,
    pp=1,
    optimizer_bytes=None,
    sequence_parallel=True,
    cp=1,
    schedule=None,
    micro_batches=None,
    ep=1,
    dp_shard=None,
) -> dict:
    """Bytes held by one GPU, by consumer: what the memory widget draws.

    A simple model of the parallel degrees:
    - TP and PP split the weights, so parameters, gradients and optimizer states divide by
      tp*pp (ignoring that embeddings and norms split less evenly);
    - ZeRO then shards those states across the dp ranks (zero_bytes_per_rank);
    - TP with sequence parallelism (the default) splits every activation, so activations
      divide by tp; without it (sequence_parallel=False) the LayerNorm and dropout
      activations stay replicated (activation_bytes gives both);
    - PP gives a stage ceil(L/pp) layers, but with a 1F1B schedule the first stage holds
      pp micro-batches in flight, so its activations stay about those of L layers. Given a
      pipeline ``schedule`` (a name or a ``Schedule``) and ``micro_batches`` (m), the count
      is the schedule's instead: its busiest rank's peak from ``pp_in_flight``, times the
      layers of one chunk (ceil(L/(pp*v))); AFAB then holds m micro-batches, 1F1B min(pp, m);
    - DP does not shrink activations: each rank runs its own micro-batch;
    - CP splits the sequence: activations divide by cp, the weights stay whole on every rank;
    - EP splits the experts of an MoE config (``config.experts`` > 0): their parameters
      (``expert_params``) divide by ep as well; a dense model is unaffected. The ep ranks run
      different tokens, as dp ranks do, so activations do not shrink. ``dp`` is the number of
      replicas of an expert; the dense layers have dp * ep of them, over which ZeRO shards
      their states;
    - hybrid sharding (HSDP, ``dp_shard``): ZeRO (per-parameter FSDP is ZeRO-3) shards over
      ``dp_shard`` of the dp ranks only and keeps ``dp / dp_shard`` replicas of those shards,
      so the states divide by dp_shard (times ep for the dense layers), not by dp. Default:
      every dp rank shards;
    optimizer_bytes (k) defaults to 12 in mixed precision (fp32 master + Adam m, v), 8 in fp32.
    """
    for name, degree in (("tp", tp), ("dp", dp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if degree < 1:
            raise ValueError(f"{name} must be >= 1, got {degree}")
    shard = dp if dp_shard is None else dp_shard
    if shard < 1 or dp % shard:
        raise ValueError(
            f"dp_shard={dp_shard} must divide dp={dp}: HSDP cuts the dp ranks into dp / dp_shard "
            "replicas of dp_shard shards"
        )
    seq = seq or config.seq_len
    if mixed_precision:
        p_bytes, g_bytes, k = 2, 2 + (4 if fp32_grad_accum else 0), 12
    else:
        p_bytes, g_bytes, k = 4, 4, 8
    k = k if optimizer_bytes is None else optimizer_bytes
    experts = getattr(config, "experts", 0)
    if experts and experts % ep:
        raise ValueError(f"ep={ep} does not divide the {experts} experts: choose an ep that divides them")
    # ZeRO shards a state over the ranks holding the same copy of it: an expert's over the dp
    # ranks; a dense layer's over dp x ep, since EP borrows its ranks from DP and every one of
    # them holds the dense layers (parallel.grad_sync.DATA_AXES). HSDP: dp_shard of the dp ranks.
    dense = (count_params(config) - expert_params(config)) / (tp * pp)
    local_experts = expert_params(config) / ep / (tp * pp)
    dense_part = zero_bytes_per_rank(dense, zero_stage, shard * (ep if experts else 1), k, p_bytes, g_bytes)
    expert_part = zero_bytes_per_rank(local_experts, zero_stage, shard, k, p_bytes, g_bytes)
    result = {consumer: dense_part[consumer] + expert_part[consumer] for consumer in dense_part}
    per_layer = (
        activation_bytes(config, seq, micro_batch, recompute, tp=tp, sequence_parallel=sequence_parallel, cp=cp)
        / config.layers
    )
    if schedule is None:
        act = per_layer * math.ceil(config.layers / pp) * pp
    else:
        if micro_batches is None:
            raise ValueError("a pipeline schedule needs its number of micro-batches: breakdown(..., micro_batches=m)")
        from .schedule import Schedule, make_schedule

        if not isinstance(schedule, Schedule):
            schedule = make_schedule(schedule, pp, micro_batches)
        in_flight = max(pp_in_flight(schedule, pp, micro_batches))
        act = per_layer * math.ceil(config.layers / (pp * schedule.chunks)) * in_flight
    result["activations"] = act if mixed_precision else 2 * act  # fp32 activations: twice the bytes
    return result


def cp_kv_buffer_bytes(
    batch: int,
    kv_heads: int,
    seq: int,
    head_dim: int,
    cp: int,
    kind: str = "ring",
    *,
    backward: bool = False,
    bytes_per_element: int = 2,
    grad_bytes_per_element: int = 4,
) -> int:
    """Peak bytes of the K/V buffers that context-parallel attention allocates on one rank.

    A "block" is one rank's K (or V): batch * kv_heads * (seq / cp) * head_dim elements.
    * ring: two buffers of K and V take turns, the block attended to and the one arriving
      (one with cp = 2, none with cp = 1): at most 2 * 2 blocks, whatever cp is;
    * all_gather: the gathered K and V of all cp ranks: 2 * cp blocks, growing with cp.
    ``backward``: attention's backward moves K/V again and, besides, dK/dV accumulators of
    ``grad_bytes_per_element`` (fp32 in ``parallel.ring_attention``): the ring sends one
    running sum of dK/dV on while another arrives and a third is filled (3 * 2 blocks; 2 with
    cp = 1), the all-gather variant
    fills dK/dV for every rank's block before the reduce-scatter (2 * cp blocks).
    ``parallel.ring_attention.KVBufferMeter`` measures the same buffers.
    """
    if kind not in ("ring", "all_gather"):
        raise ValueError(f"kind={kind!r}: choose 'ring' or 'all_gather'")
    if cp < 1 or seq % cp:
        raise ValueError(f"cp={cp} must be >= 1 and divide seq={seq}")
    block = batch * kv_heads * (seq // cp) * head_dim
    kv_blocks = 2 * (min(2, cp - 1) if kind == "ring" else cp)
    grad_blocks = 2 * ((3 if cp > 1 else 1) if kind == "ring" else cp) if backward else 0
    return block * (kv_blocks * bytes_per_element + grad_blocks * grad_bytes_per_element)


# --------------------------------------------------------------------------- measurement
def saved_activation_bytes(model, batch, autocast_dtype=None) -> int:
    """Bytes of the tensors autograd saves for backward during one forward of `model(batch)`.

    Tensors are counted by storage: q, k and v are views of one qkv output, and a tensor
    saved by two operations is one allocation, so each storage (keyed by its data_ptr)
    counts once with its full size. Parameters are left out: they exist with or without a
    forward. Every saved tensor stays referenced by the graph until we return, so no
    address is reused by another tensor while we count. Under autocast, the low-precision
    copies of the weights are saved too: they do not depend on batch or sequence length,
    so they show up as a constant.
    """
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    autocast = torch.autocast(batch.device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        out = model(batch)
    total = sum(storages.values())
    del out  # the graph, and with it the saved tensors, is freed only now
    return total


def _unique_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def state_bytes(model, optimizer=None) -> dict:
    """Exact bytes of parameters, gradients and optimizer states (tied weights count once)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = []
    if optimizer is not None:
        states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "parameters": _unique_bytes(params),
        "gradients": _unique_bytes(grads),
        "optimizer states": _unique_bytes(states),
    }


def cuda_peak_bytes(fn, *args, device=None, **kwargs) -> int:
    """Peak bytes allocated by the CUDA caching allocator while `fn(*args, **kwargs)` runs.

    This counts tensors only: the CUDA context and kernels (1-2 GB) and the allocator's
    cached-but-free blocks are not included; nvidia-smi shows those too.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "cuda_peak_bytes needs a CUDA GPU; on CPU use saved_activation_bytes and state_bytes instead"
        )
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn(*args, **kwargs)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)
