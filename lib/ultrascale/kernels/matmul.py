"""Tiled matrix multiplication with grouped ("super-grouping") program order.

Tiling: each program instance computes one BLOCK_M x BLOCK_N tile of C. It
walks along K in steps of BLOCK_K, loading a BLOCK_M x BLOCK_K tile of A and a
BLOCK_K x BLOCK_N tile of B into on-chip memory and multiply-accumulating them
into an fp32 accumulator that stays in registers. Each element of A is then
read from global memory once per *tile column* of C instead of once per
*element* of C: BLOCK_N times fewer loads of A, BLOCK_M times fewer of B (see
``gpu_ideas.tiled_matmul_loads`` for the count).

Program order: the GPU runs many instances at once, and those that run together
share the L2 cache. If instance ids walk C row by row, the instances in flight
need one row-tile of A but *every* column-tile of B. Grouping GROUP_M
row-tiles and walking down the columns within a group makes the instances in
flight share a few tiles of A and a few of B, so more loads hit L2.
``grouped_tile_order`` and ``blocks_touched`` show the difference on paper.
"""

import torch
import triton
import triton.language as tl

from ultrascale.kernels._device import check_dot_dtype, check_tensors, kernel_device, on_gpu


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a flat instance id to the (row-tile, column-tile) of C it computes."""
    tiles_per_group = GROUP_M * num_pid_n  # a group is GROUP_M rows of tiles, all columns
    group = pid // tiles_per_group
    first_row = group * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_row, GROUP_M)  # the last group may be shorter
    index_in_group = pid % tiles_per_group
    # Inside a group, consecutive ids go *down* a column of tiles, then to the next column.
    pid_m = first_row + index_in_group % rows_in_group
    pid_n = index_in_group // rows_in_group
    return pid_m, pid_n


@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # fp32 accumulation whatever the input dtype
    for k0 in range(0, K, BLOCK_K):
        # Masked loads fill out-of-range entries with 0, which adds nothing to the dot product,
        # so M, N and K need not be multiples of the tile sizes.
        a = tl.load(a_ptrs, mask=(rows[:, None] < M) & (ks[None, :] + k0 < K), other=0.0)
        b = tl.load(b_ptrs, mask=(ks[:, None] + k0 < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def default_tiles(dtype: torch.dtype, gpu: bool | None = None) -> dict:
    """Tile sizes and launch options the wrapper uses when none are given."""
    if not (on_gpu() if gpu is None else gpu):
        # In the interpreter bigger tiles mean fewer Python-level instances; 32 keeps edges awkward.
        return dict(block_m=32, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1)
    # fp32 tiles take twice the shared memory of bf16 ones, so use a shorter K step for them.
    block_k = 32 if dtype == torch.float32 else 64
    return dict(block_m=128, block_n=128, block_k=block_k, group_m=8, num_warps=8, num_stages=3)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    block_m=None,
    block_n=None,
    block_k=None,
    group_m=None,
    num_warps=None,
    num_stages=None,
) -> torch.Tensor:
    """``a @ b`` for 2-D tensors with the tiled Triton kernel; tile sizes are parameters.

    On a GPU, ``tl.dot`` needs each tile side to be at least 16.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul needs (M, K) @ (K, N), got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul needs one dtype, got {a.dtype} and {b.dtype}")
    check_tensors(a, b)
    check_dot_dtype(a, b)
    cfg = default_tiles(a.dtype)
    given = dict(
        block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m, num_warps=num_warps, num_stages=num_stages
    )
    cfg.update({k: v for k, v in given.items() if v is not None})
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(M, cfg["block_m"]) * triton.cdiv(N, cfg["block_n"]),)  # one instance per C tile
    matmul_kernel[grid](
        a,
        b,
        c,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        GROUP_M=cfg["group_m"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return c


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() @ b.float()).to(a.dtype)


# ---- Program order, on paper and as the kernel computes it -----------------------------------


def grouped_tile_order(num_pid_m: int, num_pid_n: int, group_m: int) -> list[tuple[int, int]]:
    """The (row-tile, column-tile) of C that instance 0, 1, 2, ... computes (Python mirror of the kernel)."""
    order = []
    for pid in range(num_pid_m * num_pid_n):
        tiles_per_group = group_m * num_pid_n
        first_row = (pid // tiles_per_group) * group_m
        rows_in_group = min(num_pid_m - first_row, group_m)
        index_in_group = pid % tiles_per_group
        order.append((first_row + index_in_group % rows_in_group, index_in_group // rows_in_group))
    return order


@triton.jit
def _tile_order_kernel(pid_m_ptr, pid_n_ptr, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
    tl.store(pid_m_ptr + pid, pid_m)
    tl.store(pid_n_ptr + pid, pid_n)


def kernel_tile_order(num_pid_m: int, num_pid_n: int, group_m: int) -> list[tuple[int, int]]:
    """The same order, computed by the ``grouped_tile`` function that the matmul kernel itself uses."""
    n = num_pid_m * num_pid_n
    pid_m = torch.empty(n, dtype=torch.int32, device=kernel_device())
    pid_n = torch.empty_like(pid_m)
    _tile_order_kernel[(n,)](pid_m, pid_n, num_pid_m, num_pid_n, GROUP_M=group_m)
    return list(zip(pid_m.tolist(), pid_n.tolist()))


def blocks_touched(order: list[tuple[int, int]], in_flight: int) -> int:
    """Distinct A row-tiles plus B column-tiles needed by the first ``in_flight`` instances.

    A rough stand-in for L2 pressure: instances that run together and share tiles
    read them from L2 instead of global memory.
    """
    first = order[:in_flight]
    return len({m for m, _ in first}) + len({n for _, n in first})
