"""The memory model: the book's tables, ZeRO, activations, and measurement on a tiny model."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ultrascale.memory import (
    GB,
    GiB,
    activation_bytes,
    breakdown,
    cp_kv_buffer_bytes,
    cuda_peak_bytes,
    model_state_bytes,
    saved_activation_bytes,
    state_bytes,
    zero_bytes_per_rank,
)
from ultrascale.model import GPT, LLAMA3_8B, LLAMA_TINY, GPTConfig, Llama, count_params

torch.set_num_threads(1)


# ------------------------------------------------------------------------ analytic
@pytest.mark.parametrize(
    "billions,plain_gb,fp32_accum_gb", [(1, 16, 20), (7, 112, 140), (70, 1120, 1400), (405, 6480, 8100)]
)
def test_book_table_of_model_states(billions, plain_gb, fp32_accum_gb):
    n = billions * 10**9
    assert sum(model_state_bytes(n, mixed_precision=False).values()) / GB == plain_gb
    assert sum(model_state_bytes(n, mixed_precision=True).values()) / GB == plain_gb
    assert sum(model_state_bytes(n, True, fp32_grad_accum=True).values()) / GB == fp32_accum_gb


def test_mixed_precision_parts():
    parts = model_state_bytes(1, mixed_precision=True)
    assert parts == {"parameters": 2, "gradients": 2, "optimizer states": 4 + 8}  # fp32 master + Adam m, v


def test_zero_stages_derived_numbers():
    psi, k, nd = 7.5e9, 12, 64
    totals = [sum(zero_bytes_per_rank(psi, stage, nd, k).values()) / GB for stage in range(4)]
    assert totals == pytest.approx([120, 31.40625, 16.640625, 1.875])
    assert [round(t, 2) for t in totals] == [120, 31.41, 16.64, 1.88]


def test_zero_rejects_bad_stage():
    with pytest.raises(ValueError, match="stage"):
        zero_bytes_per_rank(1e9, 4, 8)


def test_activation_formula_example():
    """h=4096, L=32, a=32, seq=4096, bs=1: 32*4096*4096*(34 + 160) bytes."""
    none = activation_bytes(LLAMA3_8B, seq=4096, micro_batch=1)
    assert none == 32 * 4096 * 4096 * 194
    assert none / 1e11 == pytest.approx(1.04, abs=0.005)
    assert none / GiB == pytest.approx(97, abs=0.1)
    assert activation_bytes(LLAMA3_8B, 4096, 1, "selective") == 32 * 4096 * 4096 * 34
    assert activation_bytes(LLAMA3_8B, 4096, 1, "full") == 32 * 2 * 4096 * 4096


def test_activation_scaling():
    a = lambda seq, bs: activation_bytes(LLAMA3_8B, seq, bs)  # noqa: E731
    assert a(1024, 4) == 4 * a(1024, 1)  # linear in batch
    assert a(2048, 1) > 2 * a(1024, 1)  # more than linear in seq
    # second difference in seq is constant: a pure quadratic term, 5*a*L*bs bytes per seq^2
    assert a(3000, 1) - 2 * a(2000, 1) + a(1000, 1) == 2 * 5 * 32 * 32 * 1000**2


# a small shape to compute by hand: s*b*h = 128*2*64 = 16384 and 5*a*s/h = 5*4*128/64 = 40
SMALL = SimpleNamespace(layers=2, hidden=64, heads=4)
MODES = ("none", "selective", "full")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_activations_at_tp_1_are_the_unparallel_formulas(sequence_parallel):
    for config, seq, bs in ((SMALL, 128, 2), (LLAMA3_8B, 4096, 1), (LLAMA3_8B, 1000, 3)):
        for mode in MODES:
            got = activation_bytes(config, seq, bs, mode, tp=1, sequence_parallel=sequence_parallel)
            assert got == activation_bytes(config, seq, bs, mode) and isinstance(got, int)
    sbh = 128 * 2 * 64
    assert activation_bytes(SMALL, 128, 2, tp=1, sequence_parallel=sequence_parallel) == 2 * sbh * (34 + 40)


def test_activations_with_tp_8_by_hand():
    sbh = 128 * 2 * 64
    tp_only = lambda mode: activation_bytes(SMALL, 128, 2, mode, tp=8)  # noqa: E731
    with_sp = lambda mode: activation_bytes(SMALL, 128, 2, mode, tp=8, sequence_parallel=True)  # noqa: E731
    # TP only: s*b*h*(10 + 24/t + 5as/(h t)) = 16384*(10 + 3 + 5) per layer, 2 layers
    assert tp_only("none") == 2 * sbh * 18 == 589_824
    assert tp_only("selective") == 2 * sbh * 13 == 425_984
    assert tp_only("full") == 2 * 2 * sbh == 65_536  # the layer input stays whole
    # TP + SP: s*b*h/t*(34 + 5as/h) = 2048*74 per layer
    assert with_sp("none") == 2 * 2048 * 74 == 303_104
    assert with_sp("selective") == 2 * 2048 * 34 == 139_264
    assert with_sp("full") == 2 * 2 * 2048 == 8_192


@pytest.mark.parametrize("mode", MODES)
def test_sequence_parallel_divides_every_activation_by_tp(mode):
    for tp in (2, 4, 8, 16):
        alone = activation_bytes(LLAMA3_8B, 4096, 2, mode)
        assert activation_bytes(LLAMA3_8B, 4096, 2, mode, tp=tp, sequence_parallel=True) == alone / tp
    # an uneven split still gives the exact quotient
    assert activation_bytes(SMALL, 3, 1, mode, tp=7, sequence_parallel=True) == pytest.approx(
        activation_bytes(SMALL, 3, 1, mode) / 7
    )


@pytest.mark.parametrize("mode", MODES)
def test_tp_alone_keeps_at_least_what_tp_with_sp_keeps(mode):
    for tp in range(1, 33):
        tp_only = activation_bytes(LLAMA3_8B, 2048, 1, mode, tp=tp)
        with_sp = activation_bytes(LLAMA3_8B, 2048, 1, mode, tp=tp, sequence_parallel=True)
        assert tp_only >= with_sp
        assert (tp_only == with_sp) == (tp == 1)
    # without SP the replicated 10 bytes set a floor: TP alone cannot go below 10*s*b*h per layer
    big_tp = activation_bytes(LLAMA3_8B, 2048, 1, "selective", tp=1024)
    assert big_tp > 32 * 10 * 2048 * 4096


@pytest.mark.parametrize("tp", [0, -1, 1.5])
def test_activations_refuse_a_bad_tp(tp):
    with pytest.raises(ValueError, match="tp"):
        activation_bytes(LLAMA3_8B, 4096, 1, tp=tp)


@pytest.mark.parametrize("mode", MODES)
def test_context_parallel_divides_every_activation_by_cp(mode):
    """CP gives each rank seq/cp tokens through the whole layer (and seq/cp query rows of the
    scores), on top of whatever TP and SP split."""
    for cp in (2, 4, 8):
        alone = activation_bytes(LLAMA3_8B, 131072, 1, mode)
        assert activation_bytes(LLAMA3_8B, 131072, 1, mode, cp=cp) == alone / cp
        for sp in (False, True):
            with_tp = activation_bytes(LLAMA3_8B, 131072, 1, mode, tp=8, sequence_parallel=sp)
            assert activation_bytes(LLAMA3_8B, 131072, 1, mode, tp=8, sequence_parallel=sp, cp=cp) == with_tp / cp
    with pytest.raises(ValueError, match="cp"):
        activation_bytes(LLAMA3_8B, 4096, 1, cp=0)


def test_breakdown_with_cp_splits_activations_not_weights():
    base, cp = breakdown(LLAMA3_8B, seq=131072), breakdown(LLAMA3_8B, seq=131072, cp=8)
    assert cp["activations"] == pytest.approx(base["activations"] / 8)
    assert all(cp[key] == base[key] for key in ("parameters", "gradients", "optimizer states"))
    with pytest.raises(ValueError, match="cp"):
        breakdown(LLAMA3_8B, cp=0)


def test_cp_kv_buffer_bytes_by_hand():
    # Llama 3 8B at 128k tokens, cp = 8, bf16 K/V: a block is 8 K/V heads x 16384 tokens x 128
    # = 16 Mi elements, 32 MiB. The ring holds K and V twice (attended, arriving): 128 MiB;
    # the all-gather variant the whole sequence's K and V: 8 x 2 x 32 MiB = 512 MiB.
    args = (1, 8, 131072, 128, 8)
    assert cp_kv_buffer_bytes(*args, "ring") == 128 * 2**20
    assert cp_kv_buffer_bytes(*args, "all_gather") == 512 * 2**20
    # backward adds fp32 dK/dV sums: three pairs for the ring, one per rank for the all-gather
    assert cp_kv_buffer_bytes(*args, "ring", backward=True) == (128 + 384) * 2**20
    assert cp_kv_buffer_bytes(*args, "all_gather", backward=True) == (512 + 1024) * 2**20
    # cp = 2: the ring needs one receive buffer only; cp = 1: none
    assert cp_kv_buffer_bytes(1, 8, 4096, 128, 2, "ring") == 2 * 8 * 2048 * 128 * 2
    assert cp_kv_buffer_bytes(1, 8, 4096, 128, 1, "ring") == 0
    with pytest.raises(ValueError, match="kind"):
        cp_kv_buffer_bytes(*args, "all_to_all")
    with pytest.raises(ValueError, match="divide"):
        cp_kv_buffer_bytes(1, 8, 100, 128, 8)


def test_breakdown_activations_default_to_sequence_parallel():
    """breakdown's activations are those it always gave: per layer / tp, times ceil(L/pp)*pp."""
    for tp, pp, mode, mixed in (
        (1, 1, "none", True),
        (4, 1, "none", True),
        (8, 3, "selective", True),
        (2, 4, "full", False),
        (16, 5, "none", False),
    ):
        per_layer = activation_bytes(LLAMA3_8B, 4096, 2, mode) / LLAMA3_8B.layers
        old = per_layer * math.ceil(LLAMA3_8B.layers / pp) * pp / tp * (1 if mixed else 2)
        parts = breakdown(LLAMA3_8B, seq=4096, micro_batch=2, recompute=mode, tp=tp, pp=pp, mixed_precision=mixed)
        assert parts["activations"] == pytest.approx(old, rel=1e-12)
        assert parts == breakdown(
            LLAMA3_8B,
            seq=4096,
            micro_batch=2,
            recompute=mode,
            tp=tp,
            pp=pp,
            mixed_precision=mixed,
            sequence_parallel=True,
        )
    no_sp = breakdown(LLAMA3_8B, seq=4096, tp=8, sequence_parallel=False)
    assert no_sp["activations"] == activation_bytes(LLAMA3_8B, 4096, 1, tp=8)
    assert no_sp["activations"] > breakdown(LLAMA3_8B, seq=4096, tp=8)["activations"]


def test_breakdown_single_gpu_matches_parts():
    n = count_params(LLAMA3_8B)
    parts = breakdown(LLAMA3_8B, seq=4096, micro_batch=1)
    assert parts["parameters"] == 2 * n
    assert parts["gradients"] == 2 * n
    assert parts["optimizer states"] == 12 * n
    assert parts["activations"] == activation_bytes(LLAMA3_8B, 4096, 1)
    fp32 = breakdown(LLAMA3_8B, seq=4096, mixed_precision=False)
    assert fp32["parameters"] + fp32["gradients"] + fp32["optimizer states"] == 16 * n
    accum = breakdown(LLAMA3_8B, seq=4096, fp32_grad_accum=True)
    assert accum["gradients"] == 6 * n


def test_breakdown_parallel_degrees():
    base = breakdown(LLAMA3_8B, seq=4096)
    tp = breakdown(LLAMA3_8B, seq=4096, tp=4)
    assert tp["parameters"] == pytest.approx(base["parameters"] / 4)
    assert tp["activations"] == pytest.approx(base["activations"] / 4)
    pp = breakdown(LLAMA3_8B, seq=4096, pp=4)
    assert pp["optimizer states"] == pytest.approx(base["optimizer states"] / 4)
    assert pp["activations"] == pytest.approx(base["activations"])  # 1F1B: pp micro-batches in flight
    dp = breakdown(LLAMA3_8B, seq=4096, dp=8)
    assert dp == base  # DP alone replicates everything
    z3 = breakdown(LLAMA3_8B, seq=4096, dp=8, zero_stage=3)
    assert z3["parameters"] == pytest.approx(base["parameters"] / 8)
    assert breakdown(LLAMA3_8B, seq=4096, optimizer_bytes=4)["optimizer states"] == 4 * count_params(LLAMA3_8B)
    # HSDP: 8 dp ranks as 2 replicas of 4 shards hold what 4 ZeRO-3 ranks hold, twice what 8 do
    hsdp = breakdown(LLAMA3_8B, seq=4096, dp=8, dp_shard=4, zero_stage=3)
    assert hsdp == breakdown(LLAMA3_8B, seq=4096, dp=4, zero_stage=3)
    assert hsdp["optimizer states"] == 2 * z3["optimizer states"]
    assert breakdown(LLAMA3_8B, seq=4096, dp=8, dp_shard=8, zero_stage=3) == z3
    with pytest.raises(ValueError, match="dp_shard=3 must divide dp=8"):
        breakdown(LLAMA3_8B, dp=8, dp_shard=3)


# ------------------------------------------------------------------------ measured
def train_one_step(model, optimizer, idx):
    model.loss(idx, idx).backward()
    optimizer.step()


def test_state_bytes_match_prediction_fp32_adam():
    model = GPT(GPTConfig())
    optimizer = torch.optim.Adam(model.parameters())
    train_one_step(model, optimizer, torch.randint(0, 256, (2, 16)))
    n = count_params(model.config)
    measured, predicted = state_bytes(model, optimizer), model_state_bytes(n, mixed_precision=False)
    assert measured["parameters"] == predicted["parameters"]  # the tied weight counts once
    assert measured["gradients"] == predicted["gradients"]
    # Adam also keeps a 4-byte step counter per parameter tensor; apart from it, exact
    step_counters = 4 * len(list(model.parameters()))
    assert measured["optimizer states"] == predicted["optimizer states"] + step_counters
    assert measured["optimizer states"] == pytest.approx(predicted["optimizer states"], rel=0.05)


def test_state_bytes_bf16_weights():
    model = Llama(LLAMA_TINY).to(torch.bfloat16)
    assert state_bytes(model) == {"parameters": 2 * count_params(LLAMA_TINY), "gradients": 0, "optimizer states": 0}


def saved(model, batch, seq, dtype=torch.bfloat16):
    idx = torch.randint(0, model.config.vocab_size, (batch, seq))
    return saved_activation_bytes(model, idx, autocast_dtype=dtype)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_saved_bytes_linear_in_batch(dtype):
    # from batch 2 up: at batch 1 PyTorch's matmul can save a view of the whole qkv buffer
    # instead of a copy of q or k, which keeps a different number of bytes alive
    model = GPT(GPTConfig())
    sizes = [saved(model, b, 32, dtype) for b in (2, 3, 4, 5)]
    assert np.all(np.diff(sizes, n=2) == 0) and sizes[1] > sizes[0]


def quadratic_fit(model, seqs, batch=2):
    sizes = [saved(model, batch, s) for s in seqs]
    return np.diff(sizes, n=2), sizes


def test_saved_bytes_linear_plus_quadratic_in_seq():
    config = GPTConfig()
    seqs = [8, 16, 24, 32, 40]
    second, _ = quadratic_fit(GPT(config), seqs)
    assert len(set(second)) == 1 and second[0] > 0  # exactly quadratic, positive curvature
    # bytes per attention-score element and layer: the formula's 5 counts bf16 softmax
    # output (2) + dropout mask (1) + dropout output (2); without dropout we keep the
    # bf16 softmax output (2) plus a 1-byte causal mask shared by batch and heads
    per_seq2 = second[0] / (2 * 8**2)
    per_score = per_seq2 / (config.layers * config.heads * 2)
    assert per_score == pytest.approx(2 + 1 / (config.heads * 2))


def test_selective_recomputation_removes_the_quadratic_term():
    model = GPT(GPTConfig()).set_recompute("selective")
    second, _ = quadratic_fit(model, [8, 16, 24, 32])
    assert np.all(second == 0)


def test_recomputation_reduces_saved_bytes():
    model = GPT(GPTConfig(layers=4))
    by_mode = {mode: saved(model.set_recompute(mode), 2, 64) for mode in ("none", "selective", "full")}
    assert by_mode["full"] < by_mode["selective"] < by_mode["none"]
    assert by_mode["full"] < 0.25 * by_mode["none"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_bytes():
    model = Llama(LLAMA_TINY).cuda()
    idx = torch.randint(0, 256, (2, 64), device="cuda")
    params = state_bytes(model)["parameters"]
    activations = saved_activation_bytes(model, idx)
    peak = cuda_peak_bytes(lambda: model.loss(idx, idx).backward())
    # at the end of the forward, the weights and every saved activation are alive together;
    # the allocator rounds each block up, so its peak can only be larger
    assert peak >= params + activations


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_peak_bytes_without_gpu_says_what_to_do():
    with pytest.raises(RuntimeError, match="saved_activation_bytes"):
        cuda_peak_bytes(lambda: None)


# ------------------------------------------------------------------------ widget
@pytest.mark.parametrize("preset", ["Llama 3 8B", "Llama 3 70B", "Llama 3 405B"])
def test_memory_figure_draws_the_breakdown(preset):
    from ultrascale.model import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B
    from ultrascale.viz.memory_widget import memory_figure

    config = {"Llama 3 8B": LLAMA3_8B, "Llama 3 70B": LLAMA3_70B, "Llama 3 405B": LLAMA3_405B}[preset]
    fig = memory_figure(preset, seq=2048, tp=2, dp=4, zero_stage=1)
    left = fig.axes[0]
    drawn = [bar.get_height() for bar in left.patches]  # one bar per consumer, stacked
    expected = breakdown(config, seq=2048, tp=2, dp=4, zero_stage=1)
    assert drawn == pytest.approx(
        [expected[name] / GB for name in ("parameters", "gradients", "optimizer states", "activations")]
    )
    assert len(fig.axes) == 3


def test_memory_figure_rejects_bad_inputs():
    from ultrascale.viz.memory_widget import memory_figure

    with pytest.raises(ValueError, match="divisible"):
        memory_figure(hidden=4100, heads=32)
    with pytest.raises(TypeError, match="unknown inputs"):
        memory_figure(batch_size=8)


def test_memory_widget_constructs_and_redraws():
    from ultrascale.viz.memory_widget import memory_widget

    widget = memory_widget()
    image = widget.children[-1]
    first = image.value
    assert first[:4] == b"\x89PNG"
    shape_box = widget.children[0].children[0]
    shape_box.children[0].value = "Llama 3 70B"  # the preset dropdown
    assert image.value != first
    hidden = next(c for c in shape_box.children if c.description == "hidden")
    assert hidden.value == 8192
    hidden.value = 8191  # not divisible by heads: message, no crash
    assert "divisible" in widget.children[1].value


def test_memory_widget_says_when_its_own_drawing_breaks(monkeypatch):
    """Any other error is shown beside the plot (not a silently frozen plot) and still raised for the log."""
    import ultrascale.viz.memory_widget as mw

    widget = mw.memory_widget()

    def broken(fig):
        raise RuntimeError("drawing broke")

    monkeypatch.setattr(mw, "_png", broken)
    hidden = next(c for c in widget.children[0].children[0].children if c.description == "hidden")
    with pytest.raises(RuntimeError, match="drawing broke"):
        hidden.value = 2048
    assert "RuntimeError" in widget.children[1].value and "drawing broke" in widget.children[1].value


# ------------------------------------------------------------------------ pipeline schedules (NB07)
def test_pp_in_flight_is_the_simulators_count():
    """AFAB holds all m micro-batches on every rank, 1F1B p - rank of them (at most m)."""
    from ultrascale.memory import pp_in_flight
    from ultrascale.schedule import interleaved_1f1b, simulate

    for p, m in [(4, 8), (4, 3), (2, 5), (8, 32)]:
        assert pp_in_flight("afab", p, m) == [m] * p
        assert pp_in_flight("1f1b", p, m) == [min(p - r, m) for r in range(p)]
    schedule = interleaved_1f1b(4, 8, v=2, order="breadth-first")
    assert pp_in_flight(schedule, 4, 8) == simulate(schedule).peak_activations
    with pytest.raises(ValueError, match="schedule is for p=4, m=8"):
        pp_in_flight(schedule, 2, 8)


def test_breakdown_with_a_pipeline_schedule():
    """Activations: the busiest rank's in-flight micro-batches times one chunk's layers;
    no schedule keeps the numbers breakdown always gave (ceil(L/pp) * pp layers)."""
    from ultrascale.schedule import interleaved_1f1b

    base = dict(seq=4096, pp=4)
    per_layer = activation_bytes(LLAMA3_8B, 4096, 1) / LLAMA3_8B.layers  # 32 layers: 8 per stage
    assert breakdown(LLAMA3_8B, **base)["activations"] == per_layer * 8 * 4
    afab = breakdown(LLAMA3_8B, **base, schedule="afab", micro_batches=16)
    one = breakdown(LLAMA3_8B, **base, schedule="1f1b", micro_batches=16)
    few = breakdown(LLAMA3_8B, **base, schedule="1f1b", micro_batches=2)
    assert afab["activations"] == per_layer * 8 * 16 and one["activations"] == per_layer * 8 * 4
    assert few["activations"] == per_layer * 8 * 2  # m < p: only m ever in flight
    for key in ("parameters", "gradients", "optimizer states"):  # the schedule changes activations only
        assert afab[key] == one[key] == breakdown(LLAMA3_8B, **base)[key]
    # Interleaved, v = 2: pairs of (micro-batch, chunk of 4 layers), rank 0's peak from the simulator.
    inter = breakdown(LLAMA3_8B, **base, schedule=interleaved_1f1b(4, 16, v=2), micro_batches=16)
    assert inter["activations"] == per_layer * 4 * 11
    with pytest.raises(ValueError, match="micro_batches=m"):
        breakdown(LLAMA3_8B, **base, schedule="1f1b")
    with pytest.raises(ValueError, match="m=0"):
        breakdown(LLAMA3_8B, **base, schedule="1f1b", micro_batches=0)


def test_breakdown_divides_only_the_expert_parameters_by_ep():
    from dataclasses import dataclass

    from ultrascale.memory import expert_params

    @dataclass(frozen=True)
    class MoE(GPTConfig):  # the two fields breakdown reads of an MoE config
        experts: int = 8
        top_k: int = 2

    dense, moe = GPTConfig(hidden=64, layers=4), MoE(hidden=64, layers=4)
    assert expert_params(dense) == 0 and breakdown(dense, ep=4) == breakdown(dense)
    assert expert_params(moe) == 4 * 8 * (8 * 64 * 64 + 5 * 64)
    for tp, pp in ((1, 1), (2, 2)):
        one, four = breakdown(moe, tp=tp, pp=pp), breakdown(moe, ep=4, tp=tp, pp=pp)
        saved = expert_params(moe) * 3 / 4 / (tp * pp)  # three quarters of the experts live elsewhere
        assert one["parameters"] - four["parameters"] == pytest.approx(2 * saved)
        assert one["optimizer states"] - four["optimizer states"] == pytest.approx(12 * saved)
        assert one["activations"] == four["activations"]  # ep ranks run their own tokens
    with pytest.raises(ValueError, match="ep=3 does not divide the 8 experts"):
        breakdown(moe, ep=3)


def test_zero_with_ep_shards_dense_states_over_dp_times_ep_and_experts_over_dp():
    """As the composition does (grad_sync.DATA_AXES): the dense layers are held by all dp x ep ranks,
    an expert by the dp ranks of its ep coordinate only."""
    from dataclasses import dataclass

    from ultrascale.memory import expert_params

    @dataclass(frozen=True)
    class MoE(GPTConfig):
        experts: int = 8
        top_k: int = 2

    moe = MoE(hidden=64, layers=4)
    dense = count_params(moe) - expert_params(moe)
    for stage in (1, 2, 3):
        got = breakdown(moe, zero_stage=stage, dp=2, ep=4, mixed_precision=True)
        assert got["optimizer states"] == pytest.approx(12 * (dense / 8 + expert_params(moe) / 4 / 2))
    assert breakdown(GPTConfig(hidden=64, layers=4), zero_stage=1, dp=2, ep=4) == breakdown(
        GPTConfig(hidden=64, layers=4), zero_stage=1, dp=2
    )  # a dense model has no ep
