"""ultrascale.plan: the rules, the enumerator's constraints, the memory filter, the step-time
model and the published-setup ranking."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from ultrascale import memory, overlap
from ultrascale.comm.cost_model import AlphaBeta
from ultrascale.model import LLAMA3_8B, LLAMA3_70B, LLAMA_TINY, count_params
from ultrascale.plan import (
    H100,
    DATASHEETS,
    Hardware,
    ParallelConfig,
    PlanError,
    divisors,
    enumerate_configs,
    fits,
    datasheet,
    memory_per_gpu,
    plan,
    step_time,
    violations,
)
from ultrascale.plan import published, rules
from ultrascale.plan.fit import _schedule_factor

SEQ, BATCH = 4096, 2**20


# ---- rules -----------------------------------------------------------------------------


def test_step1_small_model_one_technique_on_a_node():
    assert rules.step1_techniques(3e9, 8) == [frozenset({"TP"}), frozenset({"ZeRO-3"}), frozenset({"DP"})]


def test_step1_mid_size_model():
    assert set(rules.step1_techniques(70e9, 64)) == {
        frozenset({"TP", "PP"}),
        frozenset({"TP", "ZeRO-3"}),
        frozenset({"ZeRO-3"}),
    }


def test_step1_large_clusters_and_extras():
    assert all({"TP", "PP"} & o for o in rules.step1_techniques(70e9, 512))
    # PP goes with plain DP or ZeRO-1 at 512-1023 GPUs, never with ZeRO-3 (the book: rare)
    assert set(rules.step1_techniques(70e9, 1023)) == {
        frozenset({"TP", "ZeRO-3"}),
        frozenset({"TP", "DP"}),
        frozenset({"PP", "DP"}),
        frozenset({"PP", "ZeRO-1"}),
    }
    assert not any(
        {"PP", "ZeRO-3"} <= o
        for n in (3e9, 70e9, 405e9)
        for gpus in (512, 1023, 1024, 16384)
        for o in rules.step1_techniques(n, gpus)
    )
    assert rules.step1_techniques(405e9, 1024) == [frozenset({"TP", "PP", "ZeRO-2"})]
    assert rules.step1_techniques(10e9, 1024) == [frozenset({"TP", "PP", "ZeRO-2"})]
    assert rules.step1_techniques(405e9, 1024, long_sequence=True, moe=True) == [
        frozenset({"TP", "PP", "ZeRO-2", "CP", "EP"})
    ]
    with pytest.raises(ValueError):
        rules.step1_techniques(0, 8)


def test_step1_a_model_under_10b_needs_no_pp_at_any_scale():
    """At 512 and 1024 GPUs the rule still looks at the model: under 10B it fits without PP."""
    assert set(rules.step1_techniques(9.99e9, 512)) == {frozenset({"TP", "ZeRO-3"}), frozenset({"TP", "DP"})}
    assert rules.step1_techniques(9.99e9, 1024) == [frozenset({"TP", "ZeRO-2"})]
    assert rules.step1_techniques(1e9, 16384, long_sequence=True) == [frozenset({"TP", "ZeRO-2", "CP"})]
    assert not any(
        "PP" in o for gpus in (1, 8, 64, 511, 512, 1023, 1024, 16384) for o in rules.step1_techniques(8e9, gpus)
    )


def test_gpu_poor_trades_compute_for_memory():
    assert rules.gpu_poor(gas=4) == {"recompute": "full", "gas": 8}


def test_step2_gradient_accumulation():
    assert rules.step2_gradient_accumulation(BATCH, SEQ, mbs=2, replicas=32) == 4
    with pytest.raises(PlanError, match="cannot be shared"):
        rules.step2_gradient_accumulation(BATCH, SEQ, mbs=3, replicas=32)
    with pytest.raises(PlanError, match="whole number"):
        rules.step2_gradient_accumulation(BATCH + 1, SEQ, mbs=1, replicas=1)


def test_step2_adjust_directions():
    assert rules.step2_adjust(BATCH, BATCH // 2).startswith("raise")
    assert "CP" in rules.step2_adjust(BATCH, BATCH // 2, long_sequence=True)
    assert rules.step2_adjust(BATCH, 2 * BATCH).startswith("lower")
    assert rules.step2_adjust(BATCH, BATCH) == "on target"


def test_step3_next_move_in_the_books_order():
    c = ParallelConfig(dp=8, tp=1, zero=1)
    assert rules.step3_next_move(c, {"DP": 0.5, "step": 1.0}) == "pp"
    assert rules.step3_next_move(c, {"DP": 0.0, "step": 1.0}) == "tp"
    assert rules.step3_next_move(ParallelConfig(dp=8, tp=8, zero=1), {"DP": 0.0, "step": 1.0}) == "zero3"
    assert rules.step3_next_move(ParallelConfig(dp=8, tp=8, zero=3), {"DP": 0.0, "step": 1.0}) == "mbs"


def test_techniques_of_a_layout():
    assert rules.techniques(ParallelConfig(dp=128, tp=8, pp=16, zero=2)) == {"TP", "PP", "ZeRO-2"}
    assert rules.techniques(ParallelConfig()) == frozenset()


# ---- enumerator ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device, label",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10G", "A10"),
        ("Tesla T4", None),
    ],
)
def test_datasheet_of_a_device_name(device, label):
    # what torch.cuda.get_device_name() returns: a variant's name holds the plainer one's
    # (H100 PCIe holds H100, L40S holds L4, A100 holds A10), so the order of the table matters
    sheet = datasheet(device)
    assert (sheet and sheet.label) == label


def test_datasheets_are_dense_bf16_and_the_planner_default_is_the_h100_sxm():
    assert H100.peak_flops == datasheet("NVIDIA H100 80GB HBM3").bf16_flops == 989e12
    for _, sheet in DATASHEETS:  # dense peaks of data-centre GPUs, not the "with sparsity" ones
        assert 100e12 <= sheet.bf16_flops <= 1000e12 and 0.3e12 <= sheet.memory_bandwidth <= 5e12


def test_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    with pytest.raises(ValueError):
        divisors(0)


@pytest.mark.parametrize("gpus", [8, 24, 64])
def test_every_enumerated_layout_obeys_the_products_and_rules(gpus):
    configs = list(enumerate_configs(LLAMA3_8B, gpus=gpus, global_batch_tokens=BATCH, seq=SEQ))
    assert configs and len(set(configs)) == len(configs)
    for c in configs:
        assert c.gpus == gpus and c.batch_tokens(SEQ) == BATCH
        assert 8 % c.tp == 0 and LLAMA3_8B.heads % c.tp == 0 and c.pp <= LLAMA3_8B.layers
        assert not violations(LLAMA3_8B, c, gpus=gpus, global_batch_tokens=BATCH, seq=SEQ)


def test_enumeration_is_complete_for_a_small_case():
    """Every product of degrees that passes `violations` is enumerated (brute force)."""
    import itertools

    model, gpus, batch, seq = LLAMA_TINY, 4, 8 * 64, 64
    found = set(
        enumerate_configs(model, gpus=gpus, global_batch_tokens=batch, seq=seq, zero_stages=(0,), recompute=("none",))
    )
    brute = set()
    for dp, tp, pp, cp, mbs, gas in itertools.product(range(1, 9), repeat=6):
        c = ParallelConfig(dp, tp, pp, cp, 1, 0, mbs, gas)
        if not violations(model, c, gpus=gpus, global_batch_tokens=batch, seq=seq):
            brute.add(c)
    assert found == brute


def test_violations_name_each_broken_rule():
    bad = ParallelConfig(dp=1, tp=16, pp=64, cp=3, ep=2, mbs=1, gas=1)
    text = " | ".join(violations(LLAMA3_8B, bad, gpus=8, global_batch_tokens=BATCH, seq=SEQ))
    for needle in (
        "not the 8 GPUs",
        "one node",
        "attention heads",
        "at least one layer",
        "zig-zag",
        "experts",
        "global batch",
    ):
        assert needle in text
    assert violations(LLAMA3_8B, ParallelConfig(dp=0), gpus=8, global_batch_tokens=BATCH, seq=SEQ)


def test_impossible_batches_are_explained():
    with pytest.raises(PlanError, match="whole number of 4096-token sequences"):
        list(enumerate_configs(LLAMA3_8B, gpus=8, global_batch_tokens=BATCH + 1, seq=SEQ))
    with pytest.raises(PlanError, match="cannot be shared evenly"):
        plan(LLAMA_TINY, gpus=9, global_batch_tokens=2 * 64, seq=64)


# ---- memory filter ---------------------------------------------------------------------


def test_memory_is_the_memory_models():
    c = ParallelConfig(dp=8, tp=8, pp=4, zero=1, mbs=1, gas=8, recompute="selective")
    got = memory_per_gpu(LLAMA3_70B, c, SEQ)
    expected = memory.breakdown(
        LLAMA3_70B, seq=SEQ, micro_batch=1, recompute="selective", zero_stage=1, tp=8, dp=8, pp=4, cp=1
    )
    for key in ("parameters", "gradients", "optimizer states", "activations"):
        assert got[key] == pytest.approx(expected[key])
    assert got["total"] == pytest.approx(
        sum(expected[k] for k in ("parameters", "gradients", "optimizer states", "activations"))
    )


@pytest.mark.parametrize("schedule,pp,m,v", [("interleaved", 4, 8, 2), ("interleaved", 2, 4, 2)])
def test_cached_schedule_factor_equals_the_memory_models_simulation(schedule, pp, m, v):
    from ultrascale.schedule import make_schedule

    direct = memory.breakdown(
        LLAMA3_8B, seq=SEQ, tp=2, pp=pp, schedule=make_schedule(schedule, pp, m, v), micro_batches=m
    )["activations"]
    default = memory.breakdown(LLAMA3_8B, seq=SEQ, tp=2, pp=pp)["activations"]
    assert default * _schedule_factor(LLAMA3_8B.layers, pp, schedule, m, v) == pytest.approx(direct)


def test_a_pipeline_with_fewer_micro_batches_than_stages_holds_only_those():
    """1F1B's first stage holds min(pp, gas) micro-batches, not pp (the filter charged pp, 6.5x
    the 11 GB a dry run measured for Llama 3 8B on pp 16 with gas 1: chapter 10)."""
    for gas in (1, 3, 8, 12):
        c = ParallelConfig(dp=4, pp=8, zero=1, mbs=2, gas=gas, recompute="full")
        direct = memory.breakdown(
            LLAMA3_8B,
            seq=SEQ,
            micro_batch=2,
            recompute="full",
            zero_stage=1,
            dp=4,
            pp=8,
            schedule="1f1b",
            micro_batches=gas,
        )["activations"]
        assert memory_per_gpu(LLAMA3_8B, c, SEQ)["activations"] == pytest.approx(direct)
        assert direct == pytest.approx(
            min(gas, 8) / 8 * memory_per_gpu(LLAMA3_8B, replace(c, gas=8), SEQ)["activations"]
        )


def test_memory_filter_keeps_only_what_fits():
    result = plan(LLAMA3_8B, gpus=8, global_batch_tokens=BATCH, seq=SEQ)
    assert all(s.memory["total"] <= H100.usable_memory for s in result.ranked)
    assert len(result.ranked) < result.candidates
    assert fits(LLAMA3_8B, result.best.config, SEQ, H100)


def test_a_model_that_fits_nowhere_is_explained():
    with pytest.raises(PlanError, match=r"fits on none of the .* layouts .* GB per GPU"):
        plan(LLAMA3_70B, gpus=8, global_batch_tokens=BATCH, seq=SEQ)
    # with more memory per GPU it fits
    assert plan(LLAMA3_70B, gpus=8, global_batch_tokens=BATCH, seq=SEQ, hardware=H100.with_memory(400e9)).ranked


# ---- step time -------------------------------------------------------------------------


def test_links_are_a3s_t_comm_without_latency():
    hw = Hardware(intra_node=AlphaBeta(0.0, 450e9), inter_node=AlphaBeta(0.0, 50e9))
    k = 1e9
    assert float(hw.link(1, 8).ring_all_reduce_time(k, 8)) == pytest.approx(overlap.dp_comm_time(k, 8, 450e9))
    assert float(hw.link(8, 2).ring_phase_time(k, 2)) == pytest.approx(overlap.zero3_comm_time(k, 2, 50e9))


def test_one_gpu_step_is_compute_only():
    c = ParallelConfig(mbs=1, gas=4)
    t = step_time(LLAMA3_8B, c, SEQ, H100)
    assert t["step"] == pytest.approx(t["compute"])
    tokens = 4 * SEQ
    assert t["mfu"] == pytest.approx(H100.matmul_efficiency * SEQ / (SEQ + H100.half_efficiency_tokens))
    assert t["tokens/s/gpu"] == pytest.approx(tokens / t["step"])


def test_bubble_is_the_books_formula():
    c = ParallelConfig(pp=4, mbs=1, gas=8)
    t = step_time(LLAMA3_8B, c, SEQ, H100)
    micro = (t["compute"] + t["PP"]) / 8
    assert t["bubble"] == pytest.approx((4 - 1) / 8 * 8 * micro)


def test_tp_across_nodes_costs_more_and_recompute_costs_time():
    nvlink, infiniband = AlphaBeta(0.0, 450e9), AlphaBeta(0.0, 50e9)
    c = ParallelConfig(dp=2, tp=8, mbs=1, gas=128)
    inside = step_time(LLAMA3_70B, c, SEQ, Hardware(intra_node=nvlink, inter_node=infiniband))
    across = step_time(LLAMA3_70B, c, SEQ, Hardware(intra_node=infiniband, inter_node=infiniband))
    assert across["TP"] == pytest.approx(inside["TP"] * 9)
    full = step_time(LLAMA3_70B, ParallelConfig(dp=2, tp=8, mbs=1, gas=128, recompute="full"), SEQ, H100)
    assert full["recompute"] == pytest.approx(full["compute"] / 3)


def test_no_overlap_charges_every_byte():
    c = ParallelConfig(dp=8, mbs=1, gas=4)
    hidden = step_time(LLAMA3_8B, c, SEQ, H100)
    shown = step_time(LLAMA3_8B, c, SEQ, Hardware(overlap=False))
    assert shown["DP"] > hidden["DP"] and shown["DP"] == pytest.approx(
        float(H100.intra_node.ring_all_reduce_time(2 * count_params(LLAMA3_8B), 8))
    )


def test_ranking_is_by_step_time():
    result = plan(LLAMA3_8B, gpus=16, global_batch_tokens=BATCH, seq=SEQ)
    steps = [s.step for s in result.ranked]
    assert all(b >= a * (1 - 0.011) for a, b in zip(steps, steps[1:]))
    assert result.rank_of(result.best.config) == 1
    assert result.rank_of(ParallelConfig(dp=999)) is None


# ---- published setups ------------------------------------------------------------------


def test_llama3_405b_layout_is_among_the_best():
    r = published.compare(published.LLAMA3_405B_PRETRAIN, max_cp=1)
    assert r["published"] is not None and r["slowdown"] <= 1.10 and r["rank"] <= 0.05 * r["of"]


def test_heatmap_findings():
    cells = published.heatmap({"1B": published.LLAMA32_1B, "70B": LLAMA3_70B}, nodes=(1, 4, 64))
    assert cells["70B", 1] is None and cells["70B", 4] is not None
    assert cells["1B", 64].mfu < cells["1B", 1].mfu


def test_the_planner_imports_no_runtime():
    code = (
        "import sys, ultrascale.plan, ultrascale.plan.published; "
        "print(any(m.startswith(('ultrascale.runtime', 'ultrascale.parallel')) for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- hybrid sharding (HSDP) ---------------------------------------------------------------


def test_hybrid_sharding_is_enumerated_only_when_asked_and_obeys_its_rules():
    kwargs = dict(gpus=64, global_batch_tokens=BATCH, seq=SEQ, recompute=("selective",))
    plain = set(enumerate_configs(LLAMA3_8B, **kwargs))
    both = set(enumerate_configs(LLAMA3_8B, hsdp=True, **kwargs))
    hybrid = both - plain
    assert plain < both and all(c.dp_shard == 0 for c in plain)
    assert hybrid and all(c.zero == 3 and 0 < c.dp_shard < c.dp and c.dp % c.dp_shard == 0 for c in hybrid)
    # every cut of every ZeRO-3 layout's dp ranks, and no other
    z3 = [c for c in plain if c.zero == 3]
    assert len(hybrid) == sum(len([d for d in divisors(c.dp)[:-1] if d * c.cp * c.ep > 1]) for c in z3)
    assert ParallelConfig(dp=64, zero=3, dp_shard=8).short().startswith("dp64 z3 hsdp8x8")
    for bad, needle in (
        (ParallelConfig(dp=64, zero=1, dp_shard=8, gas=4), "zero=3"),
        (ParallelConfig(dp=64, zero=3, dp_shard=64, gas=4), "must divide dp=64 and be smaller"),
        (ParallelConfig(dp=64, zero=3, dp_shard=6, gas=4), "must divide dp=64"),
    ):
        assert needle in " | ".join(violations(LLAMA3_8B, bad, gpus=64, global_batch_tokens=BATCH, seq=SEQ))


def test_hybrid_sharding_memory_divides_by_the_shard_degree_only():
    hsdp = memory_per_gpu(LLAMA3_8B, ParallelConfig(dp=64, zero=3, dp_shard=8, mbs=1, gas=4), SEQ)
    eight = memory_per_gpu(LLAMA3_8B, ParallelConfig(dp=8, zero=3, mbs=1, gas=32), SEQ)
    sixty_four = memory_per_gpu(LLAMA3_8B, ParallelConfig(dp=64, zero=3, mbs=1, gas=4), SEQ)
    for key in ("parameters", "gradients", "optimizer states"):
        assert hsdp[key] == eight[key] == 8 * sixty_four[key]
    assert hsdp["activations"] == sixty_four["activations"]
    # with cp the block holds the cp ranks too: 4 dp x 2 cp
    cp = memory_per_gpu(LLAMA3_8B, ParallelConfig(dp=32, cp=2, zero=3, dp_shard=4, mbs=2, gas=4), SEQ)
    assert cp["optimizer states"] == eight["optimizer states"]


def test_hybrid_sharding_time_counts_each_axis_on_its_link():
    from ultrascale.plan import calibrate as cal

    counting = cal.counting_hardware(64)  # 1 B/s links, fp32, nothing hidden: each part is bytes
    weights = 4 * count_params(LLAMA3_8B)
    c = ParallelConfig(dp=64, zero=3, dp_shard=8, mbs=1, gas=4)
    ring = AlphaBeta(0.0, 1.0)
    # per micro-batch a gather in forward, a gather and a reduce-scatter in backward over the 8;
    # once per step the gradient shards all-reduced over the 8 replicas
    expected = 4 * 3 * ring.ring_phase_time(weights, 8) + ring.ring_all_reduce_time(weights / 8, 8)
    assert step_time(LLAMA3_8B, c, SEQ, counting)["DP"] == pytest.approx(float(expected))
    # on H100 nodes (8 GPUs each) the block of 8 stays on NVLink and only the replicas' all-reduce
    # crosses InfiniBand; ZeRO-3 over all 64 runs every gather across nodes
    no_overlap = Hardware(overlap=False)
    hybrid = step_time(LLAMA3_8B, c, SEQ, no_overlap)["DP"]
    gather = float(no_overlap.intra_node.ring_phase_time(2 * count_params(LLAMA3_8B), 8))
    across = float(no_overlap.inter_node.ring_all_reduce_time(2 * count_params(LLAMA3_8B) / 8, 8))
    assert hybrid == pytest.approx(4 * 3 * gather + across)
    assert hybrid < step_time(LLAMA3_8B, ParallelConfig(dp=64, zero=3, mbs=1, gas=4), SEQ, no_overlap)["DP"]
    # and the plain layouts' times are unchanged by the extra term
    plain = ParallelConfig(dp=64, zero=3, mbs=1, gas=4)
    assert step_time(LLAMA3_8B, plain, SEQ, counting)["DP"] == pytest.approx(
        4 * 3 * float(ring.ring_phase_time(weights, 64))
    )
