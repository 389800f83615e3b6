"""Tests for ultrascale.kernels: every Triton kernel against its PyTorch reference, and the counting models.

On a CPU the kernels run in Triton's interpreter (the package sets TRITON_INTERPRET=1
when there is no CUDA device), so sizes stay small: each kernel test takes well
under a few seconds there. Sizes are chosen *not* to be multiples of the block
sizes, so every masked edge is exercised. On a GPU the same tests run compiled,
and the tests marked ``gpu`` also time the kernels.

Tolerances. The interpreter does fp32 arithmetic in numpy; its ``tl.dot`` is an
exact fp32 ``np.matmul`` (no TF32 rounding), so results differ from PyTorch only
in summation order and in exp/log rounding: a few ulps, ~1e-6 relative. A sum of
K products of unit-variance values has magnitude ~sqrt(K) and an accumulated
rounding error of ~K * 6e-8, hence atol 1e-4 for dot-based kernels with K <= 128.
On a GPU, ``tl.dot`` on fp32 uses TF32 (10-bit mantissa, ~5e-4 relative per
product) unless told otherwise, so the dot-based tolerances widen to 2e-2.
"""

import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ultrascale.kernels as K
from ultrascale.kernels import gpu_ideas
from ultrascale.kernels.tiled_attention import merge_partial_attention

DEVICE = K.kernel_device()
ROOT = Path(__file__).resolve().parents[1]
gpu = pytest.mark.skipif(not K.on_gpu(), reason="needs a CUDA GPU with compiled Triton")

# Element-wise and reduction kernels: fp32 in registers on both CPU and GPU.
ELEMENTWISE_TOL = dict(atol=1e-5, rtol=1e-5)
# Kernels built on tl.dot: exact fp32 in the interpreter, TF32 on a GPU (see module docstring).
DOT_TOL = dict(atol=2e-2, rtol=2e-2) if K.on_gpu() else dict(atol=1e-4, rtol=1e-5)


def randn(*shape, dtype=torch.float32, requires_grad=False, seed=None):
    gen = torch.Generator().manual_seed(0 if seed is None else seed)
    t = torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=DEVICE)
    return t.requires_grad_(requires_grad)


def _run_python(code: str, env_updates: dict, drop=("TRITON_INTERPRET",)) -> str:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_updates)
    env["PYTHONPATH"] = str(ROOT / "lib") + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# ---- Import and device selection -------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_import_on_cpu_turns_on_the_interpreter_and_kernels_run():
    out = _run_python(
        "import os, torch, ultrascale.kernels as K\n"
        "x = torch.arange(5.0)\n"
        "print(os.environ['TRITON_INTERPRET'], K.on_gpu(), K.vector_add(x, x).tolist())",
        {},
    )
    assert out == "1 False [0.0, 2.0, 4.0, 6.0, 8.0]"


def test_an_explicit_triton_interpret_setting_is_respected():
    out = _run_python(
        "import os, ultrascale.kernels as K; print(os.environ['TRITON_INTERPRET'], K.interpreted())",
        {"TRITON_INTERPRET": "0"},
    )
    assert out == "0 False"


def test_tensors_on_the_wrong_device_get_an_actionable_error():
    wrong = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match=r"\.cpu\(\)|\.cuda\(\)"):
        K.vector_add(wrong, wrong)


@pytest.mark.skipif(K.on_gpu(), reason="interpreter limitation only")
def test_bf16_dot_kernels_refuse_to_run_in_the_interpreter():
    a = randn(16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        K.matmul(a, a)


# ---- Element-wise kernels --------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1000,), (3, 333)])
def test_vector_add_matches_torch_for_sizes_that_are_not_block_multiples(shape):
    x, y = randn(*shape, seed=1), randn(*shape, seed=2)
    # One fp32 addition per element on both sides: bit-identical.
    assert torch.equal(K.vector_add(x, y, block_size=128), K.vector_add_reference(x, y))


@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_elu_matches_reference(alpha):
    x = randn(1001) * 3
    torch.testing.assert_close(K.elu(x, alpha, block_size=256), K.elu_reference(x, alpha), **ELEMENTWISE_TOL)
    assert torch.equal(K.elu(x.abs(), alpha), x.abs())  # identity for x >= 0


# ---- Fused softmax and the norms -------------------------------------------------------------


@pytest.mark.parametrize("shape", [(37, 300), (2, 5, 17), (4, 1)])
def test_fused_softmax_matches_torch(shape):
    x = randn(*shape) * 4
    out = K.softmax(x)
    torch.testing.assert_close(out, K.softmax_reference(x), **ELEMENTWISE_TOL)
    torch.testing.assert_close(out.sum(-1), torch.ones(shape[:-1], device=DEVICE))


def test_fused_softmax_is_stable_for_huge_logits():
    x = randn(3, 50) * 1e4  # exp(1e4) overflows unless the row max is subtracted first
    out = K.softmax(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, K.softmax_reference(x), **ELEMENTWISE_TOL)


def test_rms_norm_forward_and_backward_match_autograd_on_the_reference():
    x = randn(2, 19, 300, requires_grad=True, seed=3)  # 38 rows > the backward's programs; 300 not a power of 2
    w = (1 + 0.1 * randn(300, seed=4)).requires_grad_()
    dy = randn(2, 19, 300, seed=5)
    out = K.rms_norm(x, w, eps=1e-6)
    dx, dw = torch.autograd.grad(out, (x, w), dy)

    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out_ref = K.rms_norm_reference(x_ref, w_ref, eps=1e-6)
    dx_ref, dw_ref = torch.autograd.grad(out_ref, (x_ref, w_ref), dy)
    torch.testing.assert_close(out, out_ref, **ELEMENTWISE_TOL)
    torch.testing.assert_close(dx, dx_ref, **ELEMENTWISE_TOL)
    # dw sums 38 rows of O(1) products: allow for the different summation order.
    torch.testing.assert_close(dw, dw_ref, atol=1e-4, rtol=1e-5)


def test_rms_norm_reference_agrees_with_torch():
    x, w = randn(5, 30), randn(30)
    expected = torch.nn.functional.rms_norm(x, (30,), w, eps=1e-6)
    torch.testing.assert_close(K.rms_norm_reference(x, w, 1e-6), expected)


def test_layer_norm_forward_matches_torch_and_returns_row_statistics():
    x, w, b = randn(37, 300, seed=6) * 2 + 1, randn(300, seed=7), randn(300, seed=8)
    out, mean, rstd = K.layer_norm(x, w, b, eps=1e-5, return_stats=True)
    torch.testing.assert_close(out, K.layer_norm_reference(x, w, b, 1e-5), **ELEMENTWISE_TOL)
    torch.testing.assert_close(mean, x.mean(-1), **ELEMENTWISE_TOL)
    torch.testing.assert_close(rstd, torch.rsqrt(x.var(-1, unbiased=False) + 1e-5), **ELEMENTWISE_TOL)


# ---- Tiled matmul ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tiles",
    [
        dict(block_m=16, block_n=16, block_k=16, group_m=1),  # plain row-major order
        dict(block_m=32, block_n=16, block_k=32, group_m=3),  # grouped order, a short last group
        dict(block_m=64, block_n=64, block_k=64, group_m=8),  # one tile bigger than the matrix
    ],
)
def test_tiled_matmul_matches_torch_for_awkward_sizes(tiles):
    a, b = randn(67, 53, seed=9), randn(53, 45, seed=10)
    torch.testing.assert_close(K.matmul(a, b, **tiles), K.matmul_reference(a, b), **DOT_TOL)


def test_tiled_matmul_handles_non_contiguous_inputs():
    a, b = randn(53, 67, seed=11).t(), randn(45, 53, seed=12).t()  # transposed views: strides (1, n)
    torch.testing.assert_close(K.matmul(a, b, block_m=32, block_n=32, block_k=16), a @ b, **DOT_TOL)


def test_tiled_matmul_never_reads_past_the_matrix_edges():
    # The operands are windows into larger buffers filled with NaN. A tile that strays past
    # M, N or K picks up a NaN, and NaN * 0 is still NaN, so every mask must be right.
    a_buf = torch.full((80, 60), float("nan"), device=DEVICE)
    b_buf = torch.full((60, 50), float("nan"), device=DEVICE)
    a, b = a_buf[:67, :53], b_buf[:53, :45]
    a.copy_(randn(67, 53, seed=33))
    b.copy_(randn(53, 45, seed=34))
    out = K.matmul(a, b, block_m=32, block_n=32, block_k=16)
    torch.testing.assert_close(out, K.matmul_reference(a, b), **DOT_TOL)


def test_matmul_rejects_mismatched_shapes_with_a_clear_message():
    with pytest.raises(ValueError, match=r"\(M, K\) @ \(K, N\)"):
        K.matmul(randn(4, 5), randn(4, 5))


def test_grouped_order_in_the_kernel_matches_the_python_mirror_and_covers_every_tile_once():
    for num_m, num_n, group in [(5, 7, 3), (4, 4, 2), (3, 5, 1), (2, 3, 8)]:
        order = K.kernel_tile_order(num_m, num_n, group)
        assert order == K.grouped_tile_order(num_m, num_n, group)
        assert sorted(order) == [(m, n) for m in range(num_m) for n in range(num_n)]


def test_grouped_order_by_hand():
    # 3 x 4 tiles, groups of 2 rows: go down the 2-row group column by column, then the last row.
    assert K.grouped_tile_order(3, 4, 2) == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
        (0, 2),
        (1, 2),
        (0, 3),
        (1, 3),
        (2, 0),
        (2, 1),
        (2, 2),
        (2, 3),
    ]
    assert K.grouped_tile_order(2, 3, 1) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]  # row-major


def test_grouping_cuts_the_tiles_that_instances_in_flight_need():
    # 9 x 9 tiles, 9 instances running at once: row-major needs 1 row of A and all 9 columns of B
    # (10 tiles); groups of 3 need 3 rows of A and 3 columns of B (6 tiles).
    assert K.blocks_touched(K.grouped_tile_order(9, 9, 1), 9) == 10
    assert K.blocks_touched(K.grouped_tile_order(9, 9, 3), 9) == 6


# ---- Attention: pure-PyTorch tiled reference -------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_attention_reference_equals_naive_attention(causal):
    q, k, v = (randn(2, 3, 70, 32, seed=s) for s in (13, 14, 15))
    out, lse = K.tiled_attention_reference(q, k, v, causal, None, block_m=16, block_n=24)
    out_ref, lse_ref = K.naive_attention(q, k, v, causal)
    torch.testing.assert_close(out, out_ref, **ELEMENTWISE_TOL)
    torch.testing.assert_close(lse, lse_ref, **ELEMENTWISE_TOL)


def test_merging_partial_attention_equals_attention_over_all_keys():
    """The one merge rule (tiled attention's key blocks, ring attention's ranks): attention over
    two parts of the keys, merged by their log-sum-exp, is attention over all of them."""
    q, k, v = (randn(2, 3, 10, 16, seed=s, dtype=torch.float64) for s in (40, 41, 42))
    out, lse = K.naive_attention(q, k, v)  # (computed in fp32 inside: ELEMENTWISE_TOL)
    out_a, lse_a = K.naive_attention(q, k[..., :4, :], v[..., :4, :])
    out_b, lse_b = K.naive_attention(q, k[..., 4:, :], v[..., 4:, :])
    merged, merged_lse = merge_partial_attention(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(merged, out, **ELEMENTWISE_TOL)
    torch.testing.assert_close(merged_lse, lse, **ELEMENTWISE_TOL)
    # A part a row does not see (lse = -inf) has weight 0; a row that sees nothing stays 0, not NaN.
    nothing = torch.full_like(lse_b, float("-inf"))
    assert torch.equal(merge_partial_attention(out_a, lse_a, torch.zeros_like(out_b), nothing)[0], out_a)
    empty, empty_lse = merge_partial_attention(torch.zeros_like(out_a), nothing, torch.zeros_like(out_b), nothing)
    assert torch.equal(empty, torch.zeros_like(out_a)) and torch.isneginf(empty_lse).all()


def test_naive_attention_agrees_with_torch_sdpa():
    q, k, v = (randn(1, 2, 33, 16, seed=s) for s in (16, 17, 18))
    for causal in (False, True):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(K.naive_attention(q, k, v, causal)[0], expected, **ELEMENTWISE_TOL)


def test_peak_intermediate_bytes_counts_live_tensors_only():
    def make_two_then_free_one():
        a = torch.empty(1000)  # 4000 bytes
        del a
        b = torch.empty(1000)
        c = torch.empty(500)  # live together with b: 6000 bytes
        return b, c

    def views_and_in_place_ops_allocate_nothing(x):
        x.view(-1).add_(1)
        return x * 2  # the only new tensor: 400 bytes

    assert K.peak_intermediate_bytes(make_two_then_free_one)[1] == 6000
    assert K.peak_intermediate_bytes(views_and_in_place_ops_allocate_nothing, torch.zeros(100))[1] == 400


def test_tiled_attention_never_holds_a_score_matrix_and_grows_linearly():
    rows = K.attention_memory_report((128, 256, 512), head_dim=32, block=64)
    for row in rows:
        assert row["naive_bytes"] >= row["score_matrix_bytes"]  # S (and P) exist in full
    assert rows[-1]["tiled_bytes"] < rows[-1]["score_matrix_bytes"] / 4
    # Doubling s: tiled memory (O(s d) output plus fixed-size blocks) at most doubles;
    # naive memory (O(s^2)) nearly quadruples.
    assert rows[2]["tiled_bytes"] <= 2 * rows[1]["tiled_bytes"]
    assert rows[2]["naive_bytes"] >= 3.5 * rows[1]["naive_bytes"]


def test_hbm_traffic_model_by_hand():
    # s = 1024, d = 64, block 128, 2-byte elements:
    # naive = (4*1024*64 + 4*1024^2) * 2;  flash = (2*1024*64 + 2*1024*64*8) * 2.
    assert K.attention_hbm_bytes(1024, 64, 128, 2) == dict(naive=8_912_896, flash=2_359_296)


# ---- FlashAttention kernels ------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [16, 32, 80, 128])
def test_flash_attention_forward_matches_naive_attention(causal, head_dim):
    q, k, v = (randn(1, 2, 70, head_dim, seed=s) for s in (19, 20, 21))  # 70 is not a block multiple
    out, lse = K.flash_attention_forward(q, k, v, causal, block_m=32, block_n=16)
    out_ref, lse_ref = K.attention_reference(q, k, v, causal)
    torch.testing.assert_close(out, out_ref, **DOT_TOL)
    torch.testing.assert_close(lse, lse_ref, **DOT_TOL)


def test_flash_attention_forward_with_more_keys_than_queries_and_a_custom_scale():
    q, k, v = randn(2, 1, 45, 32, seed=22), randn(2, 1, 70, 32, seed=23), randn(2, 1, 70, 32, seed=24)
    out, lse = K.flash_attention_forward(q, k, v, False, sm_scale=0.3)
    out_ref, lse_ref = K.attention_reference(q, k, v, False, sm_scale=0.3)
    torch.testing.assert_close(out, out_ref, **DOT_TOL)
    torch.testing.assert_close(lse, lse_ref, **DOT_TOL)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [32, 80])
def test_flash_attention_backward_matches_autograd(causal, head_dim):
    q, k, v = (randn(1, 2, 70, head_dim, requires_grad=True, seed=s) for s in (25, 26, 27))
    do = randn(1, 2, 70, head_dim, seed=28)
    out = K.flash_attention(q, k, v, causal)
    grads = torch.autograd.grad(out, (q, k, v), do)
    out_ref = K.attention_reference(q, k, v, causal)[0]
    grads_ref = torch.autograd.grad(out_ref, (q, k, v), do)
    torch.testing.assert_close(out, out_ref, **DOT_TOL)
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        torch.testing.assert_close(g, g_ref, **DOT_TOL, msg=lambda m, name=name: f"d{name}: {m}")


def test_flash_attention_backward_with_small_blocks():
    # Blocks of 16 keys and 32 queries: the dk/dv loop's causal start (query start_n) is not a
    # multiple of the query block, so its query blocks straddle the diagonal differently.
    q, k, v = (randn(1, 1, 70, 32, seed=s) for s in (29, 30, 31))
    do = randn(1, 1, 70, 32, seed=32)
    out, lse = K.flash_attention_forward(q, k, v, True, block_m=32, block_n=16)
    grads = K.flash_attention_backward(do, q, k, v, out, lse, True, block_m=32, block_n=16)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    grads_ref = torch.autograd.grad(K.attention_reference(*leaves, True)[0], leaves, do)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, **DOT_TOL)


def test_flash_attention_rejects_bad_shapes():
    with pytest.raises(ValueError, match="batch, heads"):
        K.flash_attention_forward(randn(70, 32), randn(70, 32), randn(70, 32))
    with pytest.raises(ValueError, match="head_dim"):
        K.flash_attention_forward(randn(1, 1, 8, 8), randn(1, 1, 8, 8), randn(1, 1, 8, 8))


# ---- Counting models (gpu_ideas) -------------------------------------------------------------


def test_count_segments_by_hand():
    assert gpu_ideas.count_segments(np.arange(32) * 4) == 4  # 32 consecutive floats = 128 bytes
    assert gpu_ideas.count_segments(np.arange(32) * 4, segment_bytes=128) == 1
    assert gpu_ideas.count_segments([64] * 32) == 1  # everyone reads one address: a broadcast
    assert gpu_ideas.count_segments(np.arange(32) * 4096) == 32  # a column of a row-major matrix


def test_one_warp_naive_vs_coalesced_addresses():
    naive = gpu_ideas.naive_matmul_warp_addresses(warp=0, step=5, n=64, k=64)
    coalesced = gpu_ideas.coalesced_matmul_warp_addresses(warp=0, step=5, n=64, k=64)
    # Naive: 32 lanes = 32 rows of A (k*4 = 256 bytes apart) and one shared element of B.
    assert (gpu_ideas.count_segments(naive["A"]), gpu_ideas.count_segments(naive["B"])) == (32, 1)
    # Coalesced: one shared element of A and 32 neighbouring elements of B (128 bytes).
    assert (gpu_ideas.count_segments(coalesced["A"]), gpu_ideas.count_segments(coalesced["B"])) == (1, 4)


def test_matmul_load_transactions_by_hand():
    # 64^3, blocks of 32 x 32 threads: 4 blocks x 32 warps x 64 steps = 8192 warp-steps.
    # Naive: 33 segments per warp-step; coalesced: 5 (32-byte segments) or 2 (128-byte).
    assert gpu_ideas.matmul_load_transactions("naive", 64, 64, 64) == 33 * 8192
    assert gpu_ideas.matmul_load_transactions("coalesced", 64, 64, 64) == 5 * 8192
    assert gpu_ideas.matmul_load_transactions("naive", 64, 64, 64, segment_bytes=128) == 33 * 8192
    assert gpu_ideas.matmul_load_transactions("coalesced", 64, 64, 64, segment_bytes=128) == 2 * 8192


def test_tiled_matmul_counting_by_hand():
    a, b = np.random.default_rng(0).standard_normal((64, 64)), np.random.default_rng(1).standard_normal((64, 64))
    c, loads = gpu_ideas.tiled_matmul_counting(a, b, 16, 16, 16)
    np.testing.assert_allclose(c, a @ b, atol=1e-10)
    assert gpu_ideas.naive_matmul_loads(64, 64, 64) == 2 * 64**3 == 524_288
    assert loads == gpu_ideas.tiled_matmul_loads(64, 64, 64, 16, 16) == 2 * 64**3 // 16 == 32_768
    # Awkward sizes: A (50 x 20) is read once per column-tile (2), B (20 x 30) once per row-tile (4).
    a, b = np.ones((50, 20)), np.ones((20, 30))
    c, loads = gpu_ideas.tiled_matmul_counting(a, b, 16, 16, 16)
    assert loads == gpu_ideas.tiled_matmul_loads(50, 30, 20, 16, 16) == 1000 * 2 + 600 * 4 == 4400
    assert (c == 20).all()


def test_warp_divergence_by_hand():
    tid = np.arange(256)  # a block of 8 warps
    assert gpu_ideas.divergent_passes(tid % 2 == 0) == 16  # every warp splits: 2 passes each
    assert gpu_ideas.divergent_passes((tid // 32) % 2 == 0) == 8  # whole warps agree: 1 pass each
    assert gpu_ideas.divergent_passes(tid < 48) == 9  # only warp 1 (threads 32..63) splits

    def alpha_exp(x):
        return 0.5 * (math.exp(x) - 1)

    values = np.linspace(-2, 2, 32)
    out, passes = gpu_ideas.run_divergent(values, lambda x: x < 0, alpha_exp, lambda x: x)
    out_pred, passes_pred = gpu_ideas.run_predicated(values, lambda x: x < 0, alpha_exp, lambda x: x)
    np.testing.assert_allclose(out, out_pred)
    np.testing.assert_allclose(out, np.where(values < 0, 0.5 * np.expm1(values), values))
    assert len(passes) == 2 and [p.sum() for p in passes] == [16, 16]  # each pass leaves half the lanes idle
    assert len(passes_pred) == 1 and passes_pred[0].all()
    _, uniform = gpu_ideas.run_divergent(np.abs(values), lambda x: x < 0, alpha_exp, lambda x: x)
    assert len(uniform) == 1  # no lane takes the branch: it is skipped


def test_thread_coarsening_by_hand():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((64, 64)), rng.standard_normal((64, 64))
    c, loads_1x1, threads_1x1 = gpu_ideas.coarsened_matmul_counting(a, b, 1, 1)
    c4, loads_4x4, threads_4x4 = gpu_ideas.coarsened_matmul_counting(a, b, 4, 4)
    np.testing.assert_allclose(c, a @ b, atol=1e-10)
    np.testing.assert_allclose(c4, a @ b, atol=1e-10)
    assert (loads_1x1, threads_1x1) == (2 * 64**3, 4096)  # 2 loads per multiply-add
    assert (loads_4x4, threads_4x4) == (2 * 64**3 // 4, 256)  # (4 + 4) loads per 16 multiply-adds
    # Awkward: 10 x 7 outputs in 4 x 3 patches, k = 5: 5 * (10 * ceil(7/3) + 7 * ceil(10/4)) = 255.
    _, loads, threads = gpu_ideas.coarsened_matmul_counting(np.ones((10, 5)), np.ones((5, 7)), 4, 3)
    assert loads == gpu_ideas.coarsened_matmul_loads(10, 7, 5, 4, 3) == 255
    assert threads == 9


# ---- Ahead-of-time compilation for an H100 (no GPU needed) -----------------------------------


def _can_compile_for_cuda() -> bool:
    try:
        backends = importlib.import_module("triton.backends")
        return "nvidia" in backends.backends
    except Exception:
        return False


def _compile_for_h100(*only) -> list:
    # Kernels must be imported with the interpreter off, hence a separate process.
    args = ["--arch", "90"] + (["--only", *only] if only else [])
    out = _run_python(
        f"import sys; from ultrascale.kernels.compile_check import main; sys.exit(main({args!r}))",
        {"TRITON_INTERPRET": "0"},
    )
    lines = out.splitlines()
    assert lines and all(line.endswith(" ok") for line in lines), out
    return lines


needs_nvidia_backend = pytest.mark.skipif(not _can_compile_for_cuda(), reason="this triton has no NVIDIA backend")


@needs_nvidia_backend
def test_the_largest_kernels_compile_for_an_h100_and_fit_its_shared_memory():
    # The interpreter accepts code the compiler rejects, and knows nothing of shared memory.
    # These are the kernels with the biggest tiles, at the sizes the wrappers pick on a GPU.
    lines = _compile_for_h100("matmul bf16", "flash forward bf16 d=128", "flash backward dk,dv bf16 d=128")
    assert len(lines) == 3, lines


@needs_nvidia_backend
@pytest.mark.slow
def test_every_kernel_compiles_for_an_h100_and_fits_its_shared_memory():
    # About 30 s on 2 cores the first time (seconds once Triton's cache holds the kernels).
    lines = _compile_for_h100()
    for kernel in (
        "vector_add",
        "elu",
        "softmax",
        "rms_norm forward",
        "rms_norm backward",
        "layer_norm",
        "matmul bf16",
        "matmul fp32",
        "flash forward fp32 d=128",
        "flash backward dq fp32 d=128",
    ):
        assert any(line.startswith(kernel) for line in lines), f"{kernel} was not compiled: {lines}"


# ---- GPU only: timings -----------------------------------------------------------------------


@gpu
@pytest.mark.gpu
def test_fused_softmax_is_not_slower_than_twice_torch():
    import triton.testing

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    ours = triton.testing.do_bench(lambda: K.softmax(x))
    torch_ms = triton.testing.do_bench(lambda: torch.softmax(x, dim=-1))
    assert ours < 2 * torch_ms, f"fused softmax {ours:.3f} ms vs torch {torch_ms:.3f} ms"


@gpu
@pytest.mark.gpu
def test_flash_attention_bf16_matches_sdpa_and_beats_naive_attention():
    import triton.testing

    q, k, v = (torch.randn(2, 8, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, _ = K.flash_attention_forward(q, k, v, causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)  # bf16 has an 8-bit mantissa
    ours = triton.testing.do_bench(lambda: K.flash_attention_forward(q, k, v, causal=True))
    naive = triton.testing.do_bench(lambda: K.naive_attention(q, k, v, causal=True))
    assert ours < naive, f"flash {ours:.3f} ms vs naive {naive:.3f} ms"
