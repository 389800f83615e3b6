"""Tests of the chapter 11 exercises (solutions/11_gpu_kernels_exercises.ipynb) that write a
kernel; FlashAttention's update (``11.online_softmax_update``) is tested in ``ch11_online_softmax.py``.

* ``11.masked_add``: a vector-add Triton kernel whose mask keeps the last block in bounds.
* ``11.row_softmax``: a fused, numerically stable softmax kernel, one program instance per row.
* ``11.matmul_tile``: one program instance computes one tile of C, accumulating ``tl.dot`` over K.

The kernel tests launch the learner's ``@triton.jit`` function themselves, on sizes that are
not multiples of the block sizes, with inputs and outputs that are windows into larger
buffers: a missing mask then reads NaN or writes over a sentinel, and the test says which.
Where a masked store hides an unmasked load (the vector add), the interpreter's loads are
watched: an address past the inputs fails. Operands and results of the matmul are row- and
column-major, so that no stride can be taken as 1. The exercise notebook turns on Triton's
interpreter, so these run on a CPU; a kernel compiled for a GPU is tested on CUDA tensors instead.
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np
import torch

from ultrascale_grading import exercise

SENTINEL = -12345.0  # written around every output; a kernel that stores out of bounds overwrites it


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def kernel_device() -> torch.device:
    if torch.cuda.is_available() and not _interpreted():
        return torch.device("cuda")
    return torch.device("cpu")


def _randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(kernel_device())


def padded_window(values: torch.Tensor, pad_rows: int, pad_cols: int, fill: float) -> tuple:
    """A buffer bigger than ``values`` (filled with ``fill``) and the view of it holding ``values``."""
    if values.dim() == 1:
        buf = torch.full((values.shape[0] + pad_cols,), fill, dtype=values.dtype, device=values.device)
        view = buf[: values.shape[0]]
    else:
        rows, cols = values.shape
        buf = torch.full((rows + pad_rows, cols + pad_cols), fill, dtype=values.dtype, device=values.device)
        view = buf[:rows, :cols]
    view.copy_(values)
    return buf, view


def launch_kernel(kernel, grid, *args, loads_per_program: int | None = None, **kwargs):
    """``kernel[grid](*args, **kwargs)``, under the interpreter as a GPU would run it: a masked
    load without ``other=`` gives garbage (NaN) in its masked lanes, not the interpreter's zeros,
    and a program instance may make at most ``loads_per_program`` loads (a vector load per
    operand, not one load per element)."""
    if not hasattr(kernel, "__getitem__") or not hasattr(kernel, "fn"):
        raise AssertionError(
            f"expected a @triton.jit kernel, got {type(kernel).__name__}: "
            "pass the kernel itself (the decorated function), not a wrapper"
        )
    with _as_on_a_gpu() as loads:
        kernel[grid](*args, **kwargs)
    programs = math.prod(grid)
    if loads is not None and loads_per_program is not None and loads[0] > loads_per_program * programs:
        raise AssertionError(
            f"the kernel made {loads[0] / programs:g} loads per program instance, where this one needs at most "
            f"{loads_per_program}: it reads element by element (a loop of scalar tl.load calls). Load the whole "
            "block at once, tl.load(ptr + offsets, mask=...) with offsets = start + tl.arange(0, BLOCK_SIZE): one "
            "vector load that the GPU coalesces into a few wide memory transactions"
        )


@contextlib.contextmanager
def _as_on_a_gpu():
    """Under Triton's interpreter: masked-off lanes of a load without ``other=`` read NaN (or an
    integer's largest value), since on a GPU they are undefined; yields ``[loads made]``. ``None``
    on a GPU or a Triton whose interpreter differs (then not checked)."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    current = getattr(builder, "create_masked_load", None)
    to_numpy = getattr(interpreter, "_get_np_dtype", None)
    if not _interpreted() or current is None or to_numpy is None or not hasattr(interpreter, "TensorHandle"):
        yield None
        return
    count = [0]

    def undefined_when_masked(ptrs, mask, other=None, *args, **kwargs):
        count[0] += 1
        if other is None:
            dtype = to_numpy(ptrs.get_element_ty())
            fill = np.nan if np.issubdtype(dtype, np.floating) else (True if dtype == np.bool_ else np.iinfo(dtype).max)
            other = interpreter.TensorHandle(np.full(np.shape(ptrs.data), fill, dtype=dtype), ptrs.get_element_ty())
        return current(ptrs, mask, other, *args, **kwargs)

    had_own = "create_masked_load" in vars(builder)
    builder.create_masked_load = undefined_when_masked
    try:
        yield count
    finally:
        if had_own:
            builder.create_masked_load = current  # _loads_seen's watcher, still open around us
        else:
            del builder.create_masked_load


def outside_view(buf: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The elements of ``buf`` that are not part of ``view``."""
    inside = torch.zeros_like(buf, dtype=torch.bool)
    if view.dim() == 1:
        inside[: view.shape[0]] = True
    else:
        inside[: view.shape[0], : view.shape[1]] = True
    return buf[~inside]


@contextlib.contextmanager
def _loads_seen():
    """Under Triton's interpreter, the addresses of every element the kernels load while open (the
    lanes their mask lets through); ``None`` elsewhere. A masked store hides an unmasked load in the
    values, but on a GPU that load reads memory past the tensor: garbage, or an illegal-address crash."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    original = getattr(builder, "create_masked_load", None)
    if not _interpreted() or original is None:  # a GPU, or another Triton: not checked
        yield None
        return
    addresses = []

    def watched(ptrs, mask, *args, **kwargs):  # create_load (no mask) calls this with a mask of ones
        data = np.asarray(ptrs.data)
        addresses.append(data[np.broadcast_to(np.asarray(mask.data, dtype=bool), data.shape)])
        return original(ptrs, mask, *args, **kwargs)

    builder.create_masked_load = watched
    try:
        yield addresses
    finally:
        del builder.create_masked_load  # the class's method again


def _read_past(addresses, tensors) -> bool:
    """Whether a load in ``addresses`` fell outside every one of ``tensors`` (contiguous, 1-D)."""
    if not addresses:
        return False
    seen = np.concatenate(addresses).astype(np.int64)
    inside = np.zeros(seen.shape, dtype=bool)
    for t in tensors:
        start = t.data_ptr()
        inside |= (seen >= start) & (seen < start + t.numel() * t.element_size())
    return not inside.all()


# ---- 11.masked_add ---------------------------------------------------------------------------

ADD_CASES = [(1, 16), (7, 16), (100, 32), (128, 128), (1000, 128), (1025, 256), (4099, 1024)]


@exercise("11.masked_add", points=1)
def test_masked_add(masked_add_kernel, quick: bool = True, seed: int = 0):
    """out[i] = x[i] + y[i] for i < n, launched on ceil(n / BLOCK_SIZE) program instances."""
    for case, (n, block) in enumerate(ADD_CASES):
        check_add(masked_add_kernel, _randn(n, seed=seed + 2 * case), _randn(n, seed=seed + 2 * case + 1), block)


def check_add(masked_add_kernel, x: torch.Tensor, y: torch.Tensor, block: int, lead: int = 0) -> None:
    """Launch the kernel on ``x + y`` (``lead`` elements of NaN before each input); raise what is wrong."""
    import triton

    n = x.shape[0]
    # Past the end of the inputs lies NaN, past the end of the output a sentinel.
    x_view, y_view = (
        padded_window(torch.cat([t.new_full((lead,), float("nan")), t]), 0, block, float("nan"))[1][lead:]
        for t in (x, y)
    )
    out_buf, out = padded_window(torch.zeros_like(x), 0, block, SENTINEL)
    grid = (triton.cdiv(n, block),)
    with _loads_seen() as loads:
        launch_kernel(masked_add_kernel, grid, x_view, y_view, out, n, BLOCK_SIZE=block, loads_per_program=4)
    where = f"n={n}, BLOCK_SIZE={block} ({grid[0]} program instance{'s' if grid[0] > 1 else ''}), {x.dtype}"
    if _read_past(loads, (x_view, y_view)):
        raise AssertionError(
            f"{where}: the kernel loaded past element n-1 of x or y. The masked store hides "
            "it here, but on a GPU that load reads memory that is not the tensor's (garbage, "
            "or an illegal-address crash). Mask the loads too: "
            "tl.load(x_ptr + offsets, mask=offsets < n_elements)"
        )
    if not (outside_view(out_buf, out) == SENTINEL).all():
        raise AssertionError(
            f"{where}: the kernel wrote past element n-1. Mask the store: "
            "tl.store(out_ptr + offsets, ..., mask=offsets < n_elements)"
        )
    expected = x + y
    if not torch.equal(out, expected):
        wrong = (out != expected).nonzero().flatten().tolist()
        first = wrong[0]
        hint = ""
        if torch.equal(out[:block], expected[:block]) and first >= block:
            hint = " Only the first program instance is right: offsets must start at pid * BLOCK_SIZE."
        elif (out == 0).all():
            hint = " Nothing was stored."
        elif x.dtype == torch.float64 and torch.equal(out, (x.float() + y.float()).double()):
            hint = (
                " The sum was rounded to float32: add in the inputs' own dtype (tl.load gives the pointer's "
                "element type; no .to(tl.float32)), so a float64 vector keeps its 53 bits."
            )
        raise AssertionError(
            f"{where}: {len(wrong)} wrong elements, the first at index {first} "
            f"(got {out[first].item():.17g}, expected {expected[first].item():.17g}).{hint}"
        )


# ---- 11.row_softmax --------------------------------------------------------------------------

SOFTMAX_CASES = [  # (rows, cols, scale of the logits)
    (1, 1, 1.0),
    (3, 7, 1.0),
    (5, 100, 3.0),
    (17, 300, 3.0),
    (2, 1000, 1.0),
    (4, 33, 1e4),  # exp(1e4) overflows unless each row's maximum is subtracted first
    (3, 20, -1e4),
]


@exercise("11.row_softmax", points=1)
def test_row_softmax(softmax_kernel, quick: bool = True, seed: int = 0):
    """Softmax of each row, one program instance per row, rows further apart than their length."""
    import triton

    for case, (rows, cols, scale) in enumerate(SOFTMAX_CASES):
        x = _randn(rows, cols, seed=seed + 10 + case, scale=abs(scale))
        if scale < 0:
            x = x.abs() * -1  # every logit hugely negative: exp underflows to 0 without the shift
        # Rows of the input are cols + 5 apart, rows of the output cols + 3: the strides matter.
        _, x_view = padded_window(x, 0, 5, float("nan"))
        out_buf, out = padded_window(torch.zeros(rows, cols, device=x.device), 1, 3, SENTINEL)
        block = triton.next_power_of_2(cols)
        launch_kernel(
            softmax_kernel,
            (rows,),
            out,
            x_view,
            x_view.stride(0),
            out.stride(0),
            cols,
            BLOCK_SIZE=block,
            loads_per_program=4,
        )
        where = f"shape ({rows}, {cols}), logits of size ~{abs(scale):g}, BLOCK_SIZE={block}"
        if not (outside_view(out_buf, out) == SENTINEL).all():
            raise AssertionError(
                f"{where}: the kernel wrote outside the output rows (mask the store with "
                "cols < n_cols, and use out_row_stride for the row start)"
            )
        expected = torch.softmax(x, dim=-1)
        if torch.isnan(out).any():
            if scale < -100:  # exp underflows here, it does not overflow
                raise AssertionError(
                    f"{where}: the output has NaN: every logit is hugely negative, so exp "
                    "underflows to 0 across the row and the division is 0/0. Subtract the row "
                    "maximum (tl.max(x, axis=0)) before tl.exp, so the largest term is exp(0) = 1; "
                    "padding lanes loaded as 0 instead of -inf would win that maximum."
                )
            if abs(scale) > 100:
                raise AssertionError(
                    f"{where}: the output has NaN: exp overflowed. Subtract the row maximum "
                    "(tl.max(x, axis=0)) before tl.exp, and load padding lanes as -inf."
                )
            raise AssertionError(
                f"{where}: the output has NaN: a lane read outside its row (the gaps between "
                "rows hold NaN here). Mask the load with cols < n_cols, and start row r at "
                "in_ptr + r * in_row_stride."
            )
        if not torch.allclose(out, expected, rtol=1e-5, atol=1e-6):
            err = (out - expected).abs().max().item()
            sums = out.sum(-1)
            hint = ""
            if not torch.allclose(sums, torch.ones_like(sums), atol=1e-4):
                hint = (
                    f" Rows sum to {sums.min().item():.4g}..{sums.max().item():.4g}, not 1: do padding lanes "
                    "count in the sum (load them as -inf, so exp gives 0)?"
                )
            elif rows > 1 and torch.allclose(out[0], expected[0], rtol=1e-5, atol=1e-6):
                hint = " The first row is right: use in_row_stride and out_row_stride to find each row."
            raise AssertionError(f"{where}: largest difference from torch.softmax {err:.3g}.{hint}")


# ---- 11.matmul_tile --------------------------------------------------------------------------

MATMUL_CASES = [  # (M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, the operands stored column-major)
    (16, 16, 16, 16, 16, 16, ""),
    (67, 45, 53, 32, 16, 16, ""),
    (33, 17, 70, 16, 16, 32, ""),
    (20, 50, 9, 16, 32, 16, "A"),
    (64, 64, 64, 64, 32, 32, "A"),
    (37, 29, 40, 16, 16, 16, "BC"),  # stride_bn and stride_cn are not 1: a kernel that assumes 1 fails
]


def _operand(values, pad_rows: int, pad_cols: int, column_major: bool, fill: float) -> tuple:
    """``padded_window`` of ``values``, stored transposed when ``column_major`` (then ``stride(0) == 1``):
    the buffer, the window as stored, and the matrix view the kernel gets."""
    if not column_major:
        buf, view = padded_window(values, pad_rows, pad_cols, fill)
        return buf, view, view
    buf, stored = padded_window(values.t().contiguous(), pad_cols, pad_rows, fill)
    return buf, stored, stored.t()


@exercise("11.matmul_tile", points=1)
def test_matmul_tile(matmul_tile_kernel, quick: bool = True, seed: int = 0):
    """C = A @ B with a 2-D grid: program (i, j) computes the (i, j) tile of C, looping over K."""
    for case, (M, N, K, bm, bn, bk, column_major) in enumerate(MATMUL_CASES):
        a, b = _randn(M, K, seed=seed + 20 + case), _randn(K, N, seed=seed + 40 + case)
        check_matmul(matmul_tile_kernel, a, b, (bm, bn, bk), column_major)


def check_matmul(matmul_tile_kernel, a: torch.Tensor, b: torch.Tensor, blocks: tuple, column_major: str = "") -> None:
    """Launch the kernel on ``a @ b`` into a float32 C, with tiles ``blocks`` (BLOCK_M, BLOCK_N, BLOCK_K)
    and the operands named in ``column_major`` stored so; raise what is wrong."""
    import triton

    (M, K), N, (bm, bn, bk) = a.shape, b.shape[1], blocks
    # Operands are windows into NaN-filled buffers: a load that strays past M, N or K picks up
    # NaN, and NaN * 0 is still NaN, so every mask has to be right. A column-major A has
    # stride_am = 1 and stride_ak = M + 3; likewise B and C.
    _, _, a_view = _operand(a, 2, 3, "A" in column_major, float("nan"))
    _, _, b_view = _operand(b, 4, 1, "B" in column_major, float("nan"))
    c_buf, c_stored, c = _operand(torch.zeros(M, N, device=a.device), 2, 2, "C" in column_major, SENTINEL)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    launch_kernel(
        matmul_tile_kernel,
        grid,
        a_view,
        b_view,
        c,
        M,
        N,
        K,
        a_view.stride(0),
        a_view.stride(1),
        b_view.stride(0),
        b_view.stride(1),
        c.stride(0),
        c.stride(1),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        loads_per_program=2 * triton.cdiv(K, bk) + 4,
    )
    where = (
        f"({M} x {K}) @ ({K} x {N}), tiles {bm} x {bn} x {bk}, grid {grid}"
        + (
            f", {' and '.join(column_major)} column-major (strides {a_view.stride()}, {b_view.stride()}, {c.stride()})"
            if column_major
            else ""
        )
        + (f", A and B in {a.dtype}, C in float32" if a.dtype != torch.float32 else "")
    )
    if not (outside_view(c_buf, c_stored) == SENTINEL).all():
        raise AssertionError(
            f"{where}: the kernel wrote outside C. Mask the store with (rows < M) & (cols < N)"
            + (
                ", and address C with both strides passed in: stride_cn is not 1 when C is column-major"
                if "C" in column_major
                else ""
            )
            + "."
        )
    # what a kernel gives that rounds each BLOCK_K's product to the operands' dtype (None: float32 operands)
    rounded = _rounded_per_block(a, b, bk) if a.dtype != torch.float32 else None
    if not torch.isfinite(c).all() and rounded is not None and not torch.isfinite(rounded).all():
        raise AssertionError(
            f"{where}: C has inf or NaN, as it has when each BLOCK_K's product is rounded to "
            f"{a.dtype} before it is added: {a.dtype} ends at {torch.finfo(a.dtype).max:,.0f}. "
            f"{_KEEP_FLOAT32}"
        )
    if torch.isnan(c).any():
        raise AssertionError(
            f"{where}: C has NaN: some loads read past the edge of A or B, or kept masked "
            "lanes without a value (a load with mask= but no other= leaves them undefined on a "
            "GPU: here NaN, as garbage would be). Mask the A tile with rows < M and k < K, the "
            "B tile with k < K and cols < N, with other=0."
            + (
                " Use the strides passed in for every operand: with a column-major operand its column stride is not 1"
                if column_major
                else ""
            )
        )
    close, want = _matmul_close(a, b, c), a.double() @ b.double()
    if not close(c, want):
        err = (c.double() - want).abs().max().item()
        hint = ""
        tile = (slice(0, min(bm, M)), slice(0, min(bn, N)))
        if close(c[tile], want[tile], tile):
            hint = " Tile (0, 0) is right: use the program ids (axis 0 for rows, axis 1 for columns)."
        elif K > bk and close(c, a[:, :bk].double() @ b[:bk].double()):
            hint = " Only the first BLOCK_K of K was used: loop over K, advancing the pointers by BLOCK_K."
        elif rounded is not None and close(c, rounded):
            hint = f" Each BLOCK_K's product was rounded to {a.dtype} before it was added. {_KEEP_FLOAT32}"
        elif column_major or b_view.stride(0) != N:
            hint = " Use the strides passed in, not the matrix sizes, to address rows and columns."
        raise AssertionError(f"{where}: largest difference from A @ B {err:.3g}.{hint}")


_KEEP_FLOAT32 = (
    "Keep tl.dot's result and the accumulator in float32 (acc = tl.zeros(..., dtype=tl.float32); "
    "acc += tl.dot(a, b)), whatever the operands' dtype."
)


def _matmul_close(a, b, c):
    """``close(got, want[, tile])``: whether ``got`` is ``want`` up to the rounding a right kernel makes.
    Under the interpreter tl.dot is an exact float32 product and C holds the float32 sums rounded to
    its dtype: within K float32 ulps of the sum of magnitudes, plus one ulp of C's dtype. On a GPU,
    tl.dot on float32 operands uses TF32 (10 bits), so the tolerance is TF32's there."""
    gpu = kernel_device().type != "cpu"
    unit = 2.0**-11 if gpu else a.shape[1] * 2.0**-24
    magnitudes = a.double().abs() @ b.double().abs()

    def close(got, want, tile=(slice(None), slice(None))):
        bound = magnitudes[tile] * (4 * unit) + want.abs() * torch.finfo(c.dtype).eps + 1e-300
        return got.shape == want.shape and bool(((got.double() - want).abs() <= bound).all())

    return close


def _rounded_per_block(a, b, bk: int) -> torch.Tensor:
    """What a kernel gives whose every BLOCK_K product is rounded to the operands' dtype before it is added."""
    parts = [
        (a[:, k : k + bk].double() @ b[k : k + bk].double()).to(a.dtype).double() for k in range(0, a.shape[1], bk)
    ]
    return torch.stack(parts).sum(0)
