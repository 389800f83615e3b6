"""The dry run (ultrascale.dryrun) measures what a real run measures, exactly.

A small Llama-style model trains one step on 4 real ranks (gloo) and, for the same layout and
rank, in a dry run (fake tensors, fake process group, a fresh process). Bytes of parameters,
gradients and optimizer states, the peak of saved activations, FLOPs and every collective's
calls and bytes must be equal, not close: a fake tensor has the same shapes and dtypes as the
real one, so any difference is something the dry run does differently (a technique swapped,
a tensor made twice, a collective lost), which is what this file exists to catch.
The layouts cover TP (with its vocabulary-parallel loss, which the dry run calls without its
Tensor subclass), SP (whose regathering hooks the dry run points at storages), gradient
accumulation, a 1F1B pipeline's first and last stages, plain DP, ZeRO-1 and ZeRO-3, HSDP, and CP
in both layouts (ring attention's causal masks made from real positions), and an MoE model
with and without EP, alone and with a pipeline and ZeRO-1 (both runs routed by
``balanced_choice``, the routing a dry run assumes); the refusals name their technique. ``dryrun_extrapolated`` (one and two blocks per stage, extended)
equals a whole dry run, and a full-size rank of Llama 3 8B sends, per collective, exactly what
the cost model's formulas charge.
"""

import pytest
import torch
import torch.distributed as dist

from dataclasses import replace

from ultrascale.dryrun import (
    DryRunError,
    balanced_choice,
    balanced_routing,
    dryrun,
    dryrun_extrapolated,
    measure_step,
    rank_batches,
    refuse,
)
from ultrascale.memory import state_bytes
from ultrascale.model import LlamaConfig, build_model
from ultrascale.parallel.compose import ParallelConfig, apply_parallelisms, build_mesh
from ultrascale.runtime import shared_cluster

# kv_heads < heads (grouped-query attention) and an untied head, as the published Llama presets
CONFIG = LlamaConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, seq_len=16)

# 4 experts, 2 per token: under EP a token's two experts are on two ranks (balanced_choice)
MOE = replace(CONFIG, experts=4, top_k=2)

CASES = [  # (layout, the rank compared, model): a dry run costs seconds, so one rank each
    (ParallelConfig(pp=2, tp=2, microbatches=3, optimizer="adam"), 3, CONFIG),  # TP's vocab loss, last stage
    (ParallelConfig(dp=2, pp=2, microbatches=2, zero=1, optimizer="adam"), 0, CONFIG),  # the first stage, ZeRO-1
    (ParallelConfig(dp=2, tp=2, microbatches=2, zero=3, optimizer="sgd"), 1, CONFIG),  # ZeRO-3, TP, accumulation
    (ParallelConfig(dp=2, tp=2, sp=True, optimizer="adam"), 2, CONFIG),  # SP's regathered inputs, plain DP
    (ParallelConfig(dp=4, dp_shard=2, optimizer="adam"), 3, CONFIG),  # HSDP: 2 replicas of 2 per-parameter shards
    (ParallelConfig(dp=2, cp=2, optimizer="adam"), 1, CONFIG),  # CP zig-zag: ring attention's masks from positions
    (ParallelConfig(cp=4, cp_layout="contiguous", optimizer="sgd"), 2, CONFIG),  # blocks skipped (future keys)
    (ParallelConfig(dp=4, optimizer="adam"), 1, MOE),  # MoE without EP: the batches per expert
    (ParallelConfig(dp=2, ep=2, optimizer="adam"), 3, MOE),  # EP: dispatch, local experts, combine
    (ParallelConfig(pp=2, ep=2, zero=1, microbatches=2, optimizer="adam"), 1, MOE),  # DeepSeek-V3's kind
]


def real_step(ctx, layout, config):
    """One measured step of the real model on this rank: what the dry run must reproduce (an MoE
    model routed as the dry run routes it, by ``balanced_choice``)."""
    torch.manual_seed(0)
    mesh = build_mesh(ctx, layout)
    par = apply_parallelisms(build_model(config).to(ctx.device), mesh, layout)
    batches = [b.to(ctx.device) for b in rank_batches(layout, mesh, config)]
    with balanced_routing():
        measured = measure_step(par, batches)
    # the same parameters as memory's own count (keyed by data_ptr, which real tensors have)
    independent = None if layout.zero else state_bytes(par.module)["parameters"]
    return measured, independent


@pytest.mark.parametrize("layout,rank,config", CASES, ids=[f"{c[0]}{'-moe' * bool(c[2].experts)}" for c in CASES])
def test_a_dry_run_measures_what_a_real_run_does(layout, rank, config):
    real, independent = shared_cluster(4).run(real_step, layout, config)[rank]
    dry = dryrun(layout, config, rank)
    assert dry.rank == rank and dry.layout == str(layout)
    assert dryrun(layout, config, rank) is dry  # the same call again is remembered, not run
    for key in ("parameters", "gradients", "optimizer_states", "activations", "flops", "collectives"):
        assert getattr(dry, key) == real[key], f"{layout}, rank {rank}: {key} {getattr(dry, key)} != {real[key]}"
    assert real["activations"] > 0 and real["flops"] > 0 and real["collectives"]
    if independent is not None:
        assert real["parameters"] == independent
    assert not dist.is_initialized()  # the dry run left no process group here


def test_per_parameter_sharding_holds_the_activations_of_plain_data_parallelism():
    """FSDP's gathered weights are made anew at each forward and freed after it: parameters
    gathered, not activations. Counted as saved tensors (as they were), HSDP's activations came
    out at plain DP's plus every gathered weight. (The HSDP dry run is the one CASES made.)"""
    hsdp, plain = (dryrun(ParallelConfig(dp=4, **k, optimizer="adam"), CONFIG, 3) for k in ({"dp_shard": 2}, {}))
    assert hsdp.activations == plain.activations > 0
    assert 2 * hsdp.parameters == plain.parameters  # half of every weight: one of 2 shards


def test_what_cannot_run_on_fake_tensors_is_refused_by_name():
    with pytest.raises(DryRunError, match="group_limit=1"):
        refuse(ParallelConfig(dp=2), replace(MOE, expert_groups=2, group_limit=1))
    refuse(ParallelConfig(dp=2, ep=2), MOE)  # routed by balanced_choice
    refuse(ParallelConfig(dp=2, tp=2, sp=True, pp=2, zero=1), CONFIG)  # these run
    refuse(ParallelConfig(cp=2, tp=2), CONFIG)
    with pytest.raises(ValueError, match="ranks 0..3"):
        dryrun(ParallelConfig(dp=2, tp=2), CONFIG, rank=4)
    # an error inside the dry run's process comes back with the technique that raised it
    with pytest.raises(DryRunError, match=r"tensor parallelism \(TP\) failed in the dry run"):
        dryrun(ParallelConfig(tp=3), CONFIG, rank=0)


@pytest.mark.parametrize("tokens,experts,top_k,ep", [(4096, 256, 8, 64), (16, 4, 2, 2), (36, 12, 5, 6), (30, 6, 4, 3)])
def test_the_routing_a_dry_run_assumes_is_balanced_and_spread(tokens, experts, top_k, ep):
    """``balanced_choice``: every expert gets the same number of choices when the experts divide
    the tokens, a token never picks an expert twice, and its k experts sit on k ep ranks if k <= ep."""
    chosen = balanced_choice(tokens, experts, top_k)
    assert chosen.shape == (tokens, top_k) and chosen.dtype == torch.int64
    assert torch.bincount(chosen.flatten(), minlength=experts).tolist() == [tokens * top_k // experts] * experts
    assert all(len(set(row)) == top_k for row in chosen.tolist())
    ranks = chosen // (experts // ep)
    if top_k <= ep:  # (with more experts per token than ranks, some rank must hold two)
        assert all(len(set(row)) == top_k for row in ranks.tolist())


def test_extrapolating_from_one_and_two_blocks_per_stage_is_exact():
    """``dryrun_extrapolated`` (two dry runs of 1 and 2 blocks per stage, extended to the rank's
    own count) equals the whole model's dry run in every count: the blocks are alike. Five
    layers on two stages: rank 0's stage holds three, with TP, SP, two micro-batches in flight
    and ZeRO-1 (on one data rank: its flat buffers and fp32 master shards)."""
    config = LlamaConfig(vocab_size=64, hidden=32, layers=5, heads=4, kv_heads=2, ffn=48, seq_len=16)
    layout = ParallelConfig(pp=2, tp=2, sp=True, zero=1, microbatches=2, optimizer="adam")
    whole, extrapolated = dryrun(layout, config, 0), dryrun_extrapolated(layout, config, 0)
    for key in ("parameters", "gradients", "optimizer_states", "activations", "flops", "collectives"):
        assert getattr(extrapolated, key) == getattr(whole, key), (key, getattr(extrapolated, key), getattr(whole, key))
    with pytest.raises(ValueError, match="one stage"):
        dryrun_extrapolated(ParallelConfig(pp=2, schedule="interleaved", microbatches=2), config, 0)


def test_a_full_size_ranks_bytes_per_collective_are_the_cost_models():
    """Issue 59 item 2's last part, at real size: rank 0 of Llama 3 8B under plain DP 4 x PP 2
    (1F1B over 3 micro-batches of 1,024 tokens, bf16) sends, per collective, exactly what the cost
    model's formulas (``ultrascale.overlap``) charge: the ring all-reduce of its stage's gradients
    (``dp_comm_time``'s volume, 2 (dp-1)/dp of them) and, on the first stage, one activation out
    and one gradient back per micro-batch (``pp_comm_time``'s message each). The formula side is
    counted from the model's shape, not from the dry run."""
    from ultrascale import overlap
    from ultrascale.model import LLAMA3_8B, count_params

    m, seq, dp, elt = 3, 1024, 4, 2  # bf16: 2 bytes an element
    dry = dryrun_extrapolated(
        ParallelConfig(dp=dp, pp=2, microbatches=m, optimizer="adam"), LLAMA3_8B, 0, seq=seq, dtype=torch.bfloat16
    )
    h, v, layers = LLAMA3_8B.hidden, LLAMA3_8B.vocab_size, LLAMA3_8B.layers
    block = (count_params(LLAMA3_8B) - 2 * v * h - h) // layers  # untied embedding and head, the final norm
    stage0 = elt * (v * h + layers // 2 * block)  # the embedding and the first 16 blocks
    assert dry.gradients == stage0
    ops = dry.collectives
    assert set(ops) == {"all_reduce", "isend", "irecv"}, ops
    assert ops["all_reduce"]["bytes_sent"] == overlap.dp_comm_time(stage0, dp, peak_bw=1)
    message = overlap.pp_comm_time(seq, 1, h, peak_bw=1, bytes_per_element=elt)
    assert ops["isend"] == {"calls": m, "bytes_sent": m * message, "bytes_received": 0}
    assert ops["irecv"] == {"calls": m, "bytes_sent": 0, "bytes_received": m * message}
    # an end stage has one neighbour: half of the per-step volume of a stage between two
    assert m * message * 2 == elt * overlap.pp_bytes_per_step(seq, 1, h, grad_acc=m) / 2
