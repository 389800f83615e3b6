"""ultrascale.precision: formats, FP8 quantisation, the FP8 linear, loss scaling, FP8 recipes.

Exact values where the arithmetic is exact (field widths, epsilons, counts, bytes, a
quantised value that lies on the FP8 grid); bounds from the formats' rounding where it is
not. Tolerances and their reasons are written beside each check.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from ultrascale.data import Batches
from ultrascale.memory import model_state_bytes
from ultrascale.model import GPT, GPTConfig
from ultrascale.precision import (
    BOOK_TABLE,
    DTYPES,
    E4M3,
    E5M2,
    FP8_RECIPES,
    RECIPES,
    DynamicLossScaler,
    FP8Linear,
    FP8Recipe,
    Quantised,
    ScaledOptimizer,
    apply_fp8,
    decode,
    dequantize,
    dequantize_tiles,
    distinct_inside,
    fp8_gemm,
    fp8_max,
    layout,
    layouts,
    memory_row,
    quantize_per_tensor,
    quantize_tiles,
    reduction,
    relative_error,
    rounding_bound,
    state_bytes,
    tile_grid,
    tile_scaled_matmul,
    train_losses,
    update_scale,
)
from ultrascale.train import make_optimizer, train, weights

torch.set_num_threads(1)
CFG = GPTConfig(vocab_size=64, hidden=32, layers=2, heads=2, seq_len=16)


# --------------------------------------------------------------------------- formats
def test_the_book_table_is_what_torch_finfo_gives():
    for lay in layouts():
        assert (lay.bits, lay.sign, lay.exponent, lay.mantissa) == BOOK_TABLE[lay.name], lay.name
    assert [lay.name for lay in layouts()] == list(BOOK_TABLE)


def test_epsilons_exact_and_the_books_slips():
    eps = {name: layout(dtype).eps for name, dtype in DTYPES.items()}
    assert eps["float32"] == torch.finfo(torch.float32).eps == 1.1920928955078125e-07 == 2.0**-23
    assert eps["float16"] == 9.765625e-04 == 2.0**-10
    assert eps["bfloat16"] == 7.8125e-03 == 2.0**-7
    assert eps["bfloat16"] / eps["float16"] == 8  # the book says 10x
    assert f"{eps['float32']:.2e}" == "1.19e-07"  # 1.19 x 10^-7, not 1.19^-7
    assert 1.19**-7 > 0.29  # what "1.19^{-7}" would literally be


def test_ranges():
    f32, f16, bf16, e4m3, e5m2 = (layout(d) for d in DTYPES.values())
    assert bf16.smallest_normal == f32.smallest_normal and abs(bf16.max / f32.max - 1) < 0.01
    assert e5m2.smallest_normal == f16.smallest_normal == 2.0**-14
    assert e4m3.max == 448 and e5m2.max == 57344 and f16.max == 65504
    assert e4m3.smallest_subnormal == 2.0**-9 and e5m2.smallest_subnormal == 2.0**-16
    assert 76 < f32.decades() < 77 and 83 < f32.decades(subnormals=True) < 84  # "80 orders of magnitude"
    assert e4m3.decades() < e5m2.decades() == pytest.approx(f16.decades(), abs=0.06)
    # the smallest subnormal is really the smallest: half of it rounds (to even) to zero
    for lay in (f16, e4m3, e5m2):
        assert torch.tensor(lay.smallest_subnormal).to(lay.dtype).float().item() == lay.smallest_subnormal
        assert torch.tensor(lay.smallest_subnormal / 2).to(lay.dtype).float().item() == 0


def test_points_between_one_and_two():
    counts = {name: len(distinct_inside(dtype)) for name, dtype in DTYPES.items()}
    assert counts == {"float32": 9998, "float16": 1023, "bfloat16": 127, "float8 (e4m3)": 7, "float8 (e5m2)": 3}
    assert distinct_inside(E4M3).tolist() == [1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875]
    assert distinct_inside(E5M2).tolist() == [1.25, 1.5, 1.75]


def test_decode_known_values():
    f = decode(1.5, E4M3)
    assert (f.sign, f.exponent, f.mantissa, f.kind, f.bit_string()) == (0, 7, 4, "normal", "0 0111 100")
    f = decode(-5.734e7, torch.float32)
    assert (f.sign, f.exponent - 127) == (1, 25) and f.value == -57340000.0
    assert decode(448, E4M3).bit_string() == "0 1111 110"  # e4m3 uses its top exponent
    assert decode(torch.tensor([float("nan")]).to(E4M3)).kind == "nan"
    assert decode(torch.tensor(float("-inf")).to(E5M2)).kind == "inf"
    assert decode(torch.tensor(-0.0)).sign == 1 and decode(torch.tensor(-0.0)).kind == "zero"
    f = decode(2.0**-16, E5M2)
    assert (f.exponent, f.mantissa, f.kind, f.value) == (0, 1, "subnormal", 2.0**-16)


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_decode_rebuilds_every_value(dtype):
    g = torch.Generator().manual_seed(0)
    lay = layout(dtype)
    values = torch.randn(300, generator=g) * torch.exp2(torch.randint(-30, 30, (300,), generator=g).float())
    values = torch.cat([values, torch.tensor([0.0, lay.max, -lay.max, lay.smallest_subnormal, lay.smallest_normal])])
    for v in values.clamp(-lay.max, lay.max).to(dtype):
        assert decode(v).value == v.float().item(), (dtype, v)


def test_decode_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="float64 is not a format"):
        decode(torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="one value"):
        decode(torch.ones(2))
    with pytest.raises(ValueError, match="needs dtype"):
        decode(1.0)
    with pytest.raises(ValueError, match="int32 is not a format"):
        layout(torch.int32)


# --------------------------------------------------------------------------- quantisation
def test_per_tensor_round_trip_is_exact_on_the_grid():
    grid = torch.tensor(
        [v for v in torch.arange(256, dtype=torch.uint8).view(E4M3).float().tolist() if math.isfinite(v)]
    )  # every finite e4m3 value, amax 448
    for factor in (1.0, 2.0**-20, 2.0**10):  # a power-of-two scale keeps the grid exact
        q, scale = quantize_per_tensor(grid * factor)
        assert scale.item() == factor and q.dtype == E4M3
        assert torch.equal(dequantize(q, scale), grid * factor)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_per_tensor_error_bound(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-12, 4, (64, 96), generator=g).float())
    q, scale = quantize_per_tensor(x, dtype)
    assert scale.item() == pytest.approx(x.abs().max().item() / fp8_max(dtype), rel=1e-7)
    error = (dequantize(q, scale) - x).abs()
    # nearest rounding: half a step; 1e-6 covers the float32 division x / scale before it
    assert (error <= rounding_bound(x, scale, dtype) * (1 + 1e-6) + 1e-30).all()
    assert q.float().abs().max().item() == fp8_max(dtype)  # the largest value uses the top of the range


def test_zeros_and_overflow():
    q, scale = quantize_per_tensor(torch.zeros(3, 4))
    assert torch.isfinite(scale) and not q.float().any()
    q, scale = quantize_per_tensor(torch.tensor([1e30, -1e30, 1.0]), E5M2)
    assert torch.isfinite(q.float()).all()
    with pytest.raises(ValueError, match="int64"):
        quantize_per_tensor(torch.arange(3))
    with pytest.raises(ValueError, match="not an FP8 format"):
        quantize_per_tensor(torch.ones(3), torch.bfloat16)


def test_tiles_shapes_scales_and_refusal():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 256, generator=g)
    q, scales = quantize_tiles(x, (1, 128))
    assert scales.shape == (4, 2) and q.shape == x.shape
    assert torch.equal(scales, x.view(4, 2, 128).abs().amax(-1) / 448)
    w = torch.randn(256, 384, generator=g)
    q, scales = quantize_tiles(w, (128, 128))
    assert scales.shape == (2, 3)
    assert scales[1, 2] == w[128:, 256:].abs().max() / 448
    error = (dequantize_tiles(q, scales, (128, 128)) - w).abs()
    per_element_scale = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert (error <= rounding_bound(w, per_element_scale) * (1 + 1e-6)).all()
    with pytest.raises(ValueError, match=r"200 columns do not split into tiles of 128: pad the matrix to 256"):
        quantize_tiles(torch.randn(4, 200), (1, 128))
    with pytest.raises(ValueError, match="2-D"):
        tile_grid((2, 3, 4), (1, 128))
    # pad=True: the same as padding with zeros by hand, cut back
    x = torch.randn(5, 200, generator=g)
    q, scales = quantize_tiles(x, (2, 128), pad=True)
    padded = torch.zeros(6, 256)
    padded[:5, :200] = x
    q_ref, scales_ref = quantize_tiles(padded, (2, 128))
    assert scales.shape == (3, 2) and torch.equal(scales, scales_ref)
    assert q.shape == x.shape and torch.equal(q.float(), q_ref[:5, :200].float())


def test_tiles_contain_an_outlier():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=g)
    # One value 10^6 times the others: past e4m3's 2^18 span from 448 down to its smallest
    # subnormal, so with one scale the ordinary values fall to zero or to its last few steps.
    x[7, 300] = 1e6
    ordinary = torch.ones_like(x, dtype=torch.bool)
    ordinary[7, 256:384] = False  # the outlier's own tile
    q, scale = quantize_per_tensor(x)
    per_tensor = relative_error(dequantize(q, scale)[ordinary], x[ordinary])
    q, scales = quantize_tiles(x, (1, 128))
    tiled = relative_error(dequantize_tiles(q, scales, (1, 128))[ordinary], x[ordinary])
    assert tiled < 0.05 < 0.5 < per_tensor  # tiles: e4m3's usual ~3%; one scale: most values lost


# --------------------------------------------------------------------------- the FP8 linear
def _linear_case(seed, tokens=(3, 50), fin=200, fout=300):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(fin, fout)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(fout, fin, generator=g) * 0.05)
        linear.bias.copy_(torch.randn(fout, generator=g))
    x = torch.randn(*tokens, fin, generator=g)
    dy = torch.randn(*tokens, fout, generator=g)
    return linear, x, dy


def _fp8_run(linear, x, dy, recipe):
    layer = FP8Linear.from_linear(linear, recipe)
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    out = y.detach(), x.grad, linear.weight.grad.clone(), linear.bias.grad.clone()
    linear.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("name", ["tensorwise", "tilewise"])
def test_fp8_linear_is_the_gemms_of_its_quantised_operands(name):
    """Forward and backward equal float32 matmuls of the dequantised FP8 operands, each
    quantised as the recipe says: only the order of float32 additions differs (rtol 1e-5)."""
    recipe = RECIPES[name]
    linear, x, dy = _linear_case(0)
    y, dx, dw, db = _fp8_run(linear, x, dy, recipe)
    x2, dy2, w = x.reshape(-1, 200), dy.reshape(-1, 300), linear.weight.detach()
    deq = lambda t, tile, dtype: Quantised.of(t, tile, dtype).dequantize()  # noqa: E731
    f, gd = recipe.forward_dtype, recipe.grad_dtype
    wq = deq(w, recipe.weight_tile, f)
    y_ref = deq(x2, recipe.activation_tile(), f) @ wq.t() + linear.bias.detach()
    dx_ref = deq(dy2, recipe.activation_tile(), gd) @ wq
    dw_ref = deq(dy2, recipe.activation_tile(True), gd).t() @ deq(x2, recipe.activation_tile(True), f)
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.reshape(-1, 300), y_ref, **close)
    torch.testing.assert_close(dx.reshape(-1, 200), dx_ref, **close)
    torch.testing.assert_close(dw, dw_ref, **close)
    torch.testing.assert_close(db, dy2.sum(0), **close)  # the bias stays in float32


@pytest.mark.parametrize("name", ["tensorwise", "tilewise"])
def test_fp8_linear_against_float32(name):
    """Against the float32 layer. Each e4m3 rounding moves an element by at most 2^-4 of
    itself (e5m2: 2^-3), but independent errors add in quadrature over a dot product: the
    relative error of a product of two quantised random matrices is about 3.6% (e4m3 x e4m3)
    or 5.8% (e5m2 x e4m3). We allow 10%, and require more than 1%: it must really be FP8."""
    linear, x, dy = _linear_case(1)
    y, dx, dw, _ = _fp8_run(linear, x, dy, name)
    xr = x.clone().requires_grad_()
    yr = linear(xr)
    yr.backward(dy)
    for got, want in ((y, yr.detach()), (dx, xr.grad), (dw, linear.weight.grad)):
        assert (
            0.01
            < relative_error(
                got - linear.bias.detach() if got is y else got, want - linear.bias.detach() if got is y else want
            )
            < 0.1
        )


def test_scaled_mm_and_the_tile_loop_agree_with_dequantised_matmul():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(48, 256, generator=g), torch.randn(256, 80, generator=g)
    for da, db in ((E4M3, E4M3), (E5M2, E4M3)):
        qa, qb = Quantised.of(a, None, da), Quantised.of(b, None, db)
        torch.testing.assert_close(fp8_gemm(qa, qb), qa.dequantize() @ qb.dequantize(), rtol=1e-5, atol=1e-5)
        # on a CPU fp8_gemm computes the FP8 product in float32: torch's own FP8 GEMM agrees
        theirs = torch._scaled_mm(
            qa.q,
            qb.q.t().contiguous().t(),
            scale_a=qa.scale.reshape(()),
            scale_b=qb.scale.reshape(()),
            out_dtype=torch.float32,
        )
        torch.testing.assert_close(fp8_gemm(qa, qb), theirs, rtol=1e-5, atol=1e-5)
    qa, qb = Quantised.of(a, (1, 128), E4M3), Quantised.of(b, (128, 128), E4M3)
    torch.testing.assert_close(tile_scaled_matmul(qa, qb), qa.dequantize() @ qb.dequantize(), rtol=1e-5, atol=1e-5)


def test_apply_fp8_swaps_the_blocks_linears_from_outside():
    torch.manual_seed(0)
    model = GPT(CFG)
    names = [n for n, _ in model.named_parameters()]
    apply_fp8(model, recipe="tilewise")
    fp8 = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert len(fp8) == CFG.layers * 6 and all(n.startswith("blocks.") for n in fp8)
    assert type(model.head) is nn.Linear and model.head.weight is model.embed.weight  # still tied
    assert [n for n, _ in model.named_parameters()] == names
    assert model.blocks[0].attn.q.recipe.name == "tilewise"
    with pytest.raises(ValueError, match="matches no nn.Linear"):
        apply_fp8(GPT(CFG), plan={"nothing.*": "tensorwise"})
    with pytest.raises(ValueError, match="choose one of"):
        apply_fp8(GPT(CFG), recipe="fp4")


def test_fp8_gpt_trains_like_float32():
    """A few Adam steps: FP8 moves the loss by its quantisation noise, not by a lot."""
    data = Batches(CFG, mbs=4, seed=0).global_stream()
    torch.manual_seed(0)
    ref = train_losses(GPT(CFG), data, 4, "adam")
    for recipe in ("tensorwise", FP8Recipe("small tiles", tiles=True, block=16)):
        torch.manual_seed(0)
        losses = train_losses(apply_fp8(GPT(CFG), recipe=recipe), data, 4, "adam")
        assert max(abs(a - b) for a, b in zip(losses, ref)) < 0.02, recipe


def test_train_losses_is_the_course_loop():
    data = Batches(CFG, mbs=2, seed=0)
    torch.manual_seed(0)
    model = GPT(CFG)
    losses = train_losses(model, data.global_stream(), 3, "sgd")
    torch.manual_seed(0)
    expected = train(GPT(CFG), data.global_stream(), 3, "sgd")
    assert len(losses) == 3 and losses[0] > losses[-1]
    for name, w in weights(model).items():
        assert torch.equal(w, expected[name]), name


# --------------------------------------------------------------------------- loss scaling
def test_update_rule_matches_pytorchs_kernel():
    g = torch.Generator().manual_seed(5)
    for interval in (1, 3, 2000):
        scale, tracker = 2.0**16, 0
        s, t = torch.tensor([scale]), torch.tensor([0], dtype=torch.int32)
        for found in (torch.rand(300, generator=g) < 0.1).tolist():
            scale, tracker = update_scale(scale, tracker, found, growth_interval=interval)
            torch._amp_update_scale_(s, t, torch.tensor([float(found)]), 2.0, 0.5, interval)
            assert (scale, tracker) == (s.item(), t.item())
    assert update_scale(2.0**127, 0, False, growth_interval=1) == (2.0**127, 0)  # never to inf


def test_dynamic_loss_scaler_equals_grad_scaler_bit_for_bit():
    data = Batches(CFG, mbs=2, seed=0).global_stream()
    runs = {}
    for name, scaler in (
        ("ours", DynamicLossScaler(2.0**24, growth_interval=3)),
        ("torch", torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=3)),
    ):
        torch.manual_seed(0)
        model = GPT(CFG)
        opt = ScaledOptimizer(make_optimizer(model.parameters(), "adam"), scaler)
        losses = train_losses(model, data, 8, opt, autocast=torch.float16)
        runs[name] = (weights(model), losses, opt.scales, opt.skipped)
    (w1, *rest1), (w2, *rest2) = runs["ours"], runs["torch"]
    assert rest1 == rest2
    assert any(rest1[2]), "the start scale should overflow at least once"
    assert all(torch.equal(w1[n], w2[n]) for n in w1)


def test_scaler_refuses_float16_gradients_and_a_missing_step():
    model = nn.Linear(2, 2).half()
    model(torch.ones(1, 2, dtype=torch.float16)).sum().backward()
    scaler = DynamicLossScaler()
    with pytest.raises(ValueError, match="float32 master weights"):
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="before unscale_"):
        DynamicLossScaler().update()


# --------------------------------------------------------------------------- recipes
def test_fp8_recipes_table():
    rows = [memory_row(r) for r in FP8_RECIPES]
    assert [(r["sum"], r["bytes"]) for r in rows] == [
        ("4+4+2+2+4+4 = 20", 20),
        ("4+2+2+4+4 = 16", 16),
        ("4+4+4+4 = 16", 16),
        ("2+2+1+1+1+2 = 9", 9),
        ("4+4+1+2+2+2 = 15", 15),
        ("2+4+1+1+1+1 = 10", 10),
    ]
    assert [round(100 * reduction(r)) for r in FP8_RECIPES] == [0, 20, 20, 55, 25, 50]
    assert [reduction(r) for r in FP8_RECIPES] == [0, 0.2, 0.2, 0.55, 0.25, 0.5]
    assert rows[4]["optimizer states"] == "bf16+bf16" and rows[2]["master weights"] == "n/a"
    # the course's memory model says the same for the two bf16 rows
    assert state_bytes(FP8_RECIPES[0], 10) == model_state_bytes(10, fp32_grad_accum=True)
    assert state_bytes(FP8_RECIPES[1], 10) == model_state_bytes(10)


def test_the_fp8_gemm_measurement_checks_its_product_before_it_times_it():
    from ultrascale.precision.gemm_speed import FP8_PRODUCT_TOLERANCE, check_fp8_product, fp8_matmul, fp8_operands

    assert check_fp8_product(64, "cpu") < 0.06  # e4m3's rounding: a few percent
    # the check must catch what a fast wrong GEMM would look like: an operand used transposed
    a, b = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)), torch.randn(64, 64)
    qa, sa, qb, sb = fp8_operands(a, b)
    transposed = fp8_matmul(qa, sa, qb.t(), sb).float()  # b^T, not b
    assert relative_error(transposed, a @ b) > 10 * FP8_PRODUCT_TOLERANCE
    unscaled = fp8_matmul(qa, torch.ones(()), qb, sb).float()  # a scale forgotten
    assert relative_error(unscaled, a @ b) > 10 * FP8_PRODUCT_TOLERANCE


def test_the_course_cast_saturates_e4m3_on_every_torch():
    """torch <= 2.12 casts a float32 past 464 to e4m3 as NaN, 2.13 saturates at 448: the
    course's cast clamps first, so both give the largest value; formats with an infinity
    still overflow to it, and NaN stays NaN."""
    from ultrascale.precision import to_format

    beyond = torch.tensor([-5.734e7, -1000.0, 464.0, 470.0, float("nan")])
    assert to_format(beyond, torch.float8_e4m3fn).float().tolist()[:4] == [-448.0, -448.0, 448.0, 448.0]
    assert to_format(beyond, torch.float8_e4m3fn).float()[4].isnan()
    assert to_format(beyond, torch.float8_e5m2).float().tolist()[:2] == [-math.inf, -1024.0]  # in range: rounded
    assert to_format(torch.tensor([1e6]), torch.float16).item() == math.inf
    assert decode(-5.734e7, torch.float8_e4m3fn).value == -448.0


def test_fp8_gemms_refused_with_the_reason_below_capability_8_9(monkeypatch):
    """An A100 (8.0) or a T4 has no FP8 tensor cores: torch._scaled_mm raises there, so the
    measurement refuses first and says why, and FP8Linear's GEMM falls back to the simulated
    product (as on a CPU)."""
    from ultrascale.precision import fp8_linear, gemm_speed

    assert "no CUDA GPU" in gemm_speed.fp8_gpu_refusal() or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    reason = gemm_speed.fp8_gpu_refusal()
    assert "A100" in reason and "8.0" in reason and "8.9" in reason
    with pytest.raises(RuntimeError, match="compute capability 8.0.*recorded"):
        gemm_speed.measure_fp8_gemm(1024)
    fake_cuda = type("FakeCuda", (), {"is_cuda": True, "device": 0, "dtype": torch.float8_e4m3fn, "shape": (16, 16)})()
    assert not fp8_linear._scaled_mm_runs(fake_cuda, fake_cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert gemm_speed.fp8_gpu_refusal() is None and fp8_linear._scaled_mm_runs(fake_cuda, fake_cuda)
