"""GPU performance ideas, counted on paper so they can be seen on a CPU.

Nothing here times anything. Each function counts what the hardware would do
(memory transactions, global loads, serialized passes) under a simple model,
so the effect of a change can be checked by hand and by a test:

* memory coalescing: how many memory segments one warp's 32 loads touch;
* shared-memory tiling: how many global loads a matmul makes with and without tiles;
* warp divergence: how many serialized passes a branch costs a warp, against predication;
* thread coarsening: how many loads per output a thread makes when it computes several outputs.

The models are deliberately small. Real GPUs add caches, several segment sizes
and scheduling details; the counts here show the direction and rough size of
each effect, not exact profiler numbers.
"""

import math

import numpy as np

WARP_SIZE = 32


# ---- Memory coalescing -----------------------------------------------------------------------


def count_segments(byte_addresses, segment_bytes: int = 32) -> int:
    """Memory transactions for one warp-wide load: the number of distinct aligned segments touched.

    When the 32 lanes of a warp load at once, the hardware serves the request in
    aligned segments (32-byte sectors; 128 bytes is a full cache line). Lanes
    reading neighbouring addresses share segments ("coalesced"); lanes reading
    far-apart addresses each need their own. Lanes reading the same address
    share one (a broadcast).
    """
    return len({int(a) // segment_bytes for a in byte_addresses})


def naive_matmul_warp_addresses(
    warp: int, step: int, n: int, k: int, block_size: int = 32, block=(0, 0), elem_bytes: int = 4
) -> dict:
    """Byte addresses that one warp of the *naive* matmul kernel reads at inner-loop step ``step``.

    Naive kernel: a 2-D block of block_size x block_size threads, with
        x = blockIdx.x * blockDim.x + threadIdx.x    (row of C)
        y = blockIdx.y * blockDim.y + threadIdx.y    (column of C)
        C[x][y] += A[x][step] * B[step][y]
    threadIdx.x varies fastest within a warp, so the 32 lanes of a warp have 32
    *different rows* x and the same column y: their reads of A are k elements apart.
    """
    lanes = np.arange(warp * WARP_SIZE, (warp + 1) * WARP_SIZE)  # linear thread ids in the block
    thread_x, thread_y = lanes % block_size, lanes // block_size
    x = block[0] * block_size + thread_x
    y = block[1] * block_size + thread_y
    return dict(A=(x * k + step) * elem_bytes, B=(step * n + y) * elem_bytes)


def coalesced_matmul_warp_addresses(
    warp: int, step: int, n: int, k: int, block_size: int = 32, block=(0, 0), elem_bytes: int = 4
) -> dict:
    """The same for the *coalesced* kernel: a 1-D block of block_size^2 threads, remapped as

        x = blockIdx.x * BLOCKSIZE + threadIdx.x / BLOCKSIZE    (row of C)
        y = blockIdx.y * BLOCKSIZE + threadIdx.x % BLOCKSIZE    (column of C)

    Now neighbouring lanes share a row x and take neighbouring columns y: they all
    read the same element of A (one broadcast) and consecutive elements of B.
    """
    lanes = np.arange(warp * WARP_SIZE, (warp + 1) * WARP_SIZE)
    x = block[0] * block_size + lanes // block_size
    y = block[1] * block_size + lanes % block_size
    return dict(A=(x * k + step) * elem_bytes, B=(step * n + y) * elem_bytes)


def matmul_load_transactions(
    mapping: str, m: int, n: int, k: int, block_size: int = 32, segment_bytes: int = 32, elem_bytes: int = 4
) -> int:
    """Total segments read from A and B by every warp of a (m x k) @ (k x n) matmul, over all k steps.

    ``mapping`` is "naive" or "coalesced". m and n must be multiples of
    block_size (as in the book's kernels), and block_size^2 a multiple of 32.
    """
    if m % block_size or n % block_size or (block_size * block_size) % WARP_SIZE:
        raise ValueError("m and n must be multiples of block_size, and block_size^2 a multiple of 32")
    addresses = dict(naive=naive_matmul_warp_addresses, coalesced=coalesced_matmul_warp_addresses)[mapping]
    warps_per_block = block_size * block_size // WARP_SIZE
    total = 0
    for bx in range(m // block_size):
        for by in range(n // block_size):
            for warp in range(warps_per_block):
                for step in range(k):
                    touched = addresses(warp, step, n, k, block_size, (bx, by), elem_bytes)
                    total += count_segments(touched["A"], segment_bytes) + count_segments(touched["B"], segment_bytes)
    return total


# ---- Shared-memory tiling --------------------------------------------------------------------


def naive_matmul_loads(m: int, n: int, k: int) -> int:
    """Global-memory element loads when each output reads its whole row of A and column of B: 2*m*n*k."""
    return 2 * m * n * k


def tiled_matmul_loads(m: int, n: int, k: int, block_m: int, block_n: int) -> int:
    """Closed form of what ``tiled_matmul_counting`` counts.

    Each element of A is loaded once per column-tile of C (ceil(n / block_n) times)
    and each element of B once per row-tile (ceil(m / block_m) times). With
    square tiles of side T that is 2*m*n*k / T: T times fewer than naive.
    """
    return m * k * math.ceil(n / block_n) + k * n * math.ceil(m / block_m)


def tiled_matmul_counting(a: np.ndarray, b: np.ndarray, block_m: int, block_n: int, block_k: int):
    """Blocked matmul that copies tiles into a 'shared memory' buffer and counts global loads.

    Returns ``(c, loads)``. Sizes need not be multiples of the tiles: edge tiles are
    smaller, and only real elements are counted.
    """
    m, k = a.shape
    n = b.shape[1]
    c = np.zeros((m, n), dtype=np.result_type(a, b))
    loads = 0
    for i in range(0, m, block_m):
        for j in range(0, n, block_n):
            acc = np.zeros((min(block_m, m - i), min(block_n, n - j)), dtype=c.dtype)  # stays "in registers"
            for p in range(0, k, block_k):
                shared_a = a[i : i + block_m, p : p + block_k].copy()  # global -> shared
                shared_b = b[p : p + block_k, j : j + block_n].copy()
                loads += shared_a.size + shared_b.size
                acc += shared_a @ shared_b  # every element of the tiles is reused from shared memory
            c[i : i + block_m, j : j + block_n] = acc
    return c, loads


# ---- Warp divergence -------------------------------------------------------------------------


def run_divergent(values, condition, then_fn, else_fn):
    """Execute ``then_fn(v) if condition(v) else else_fn(v)`` the way one warp runs a branch.

    A warp issues one instruction for all its lanes. If lanes disagree on the
    branch, it runs the ``then`` side with the other lanes masked off, then the
    ``else`` side with the first lanes masked off: one *pass* per side taken.
    Returns ``(results, passes)``, where ``passes`` lists each pass's active-lane mask.
    """
    values = np.asarray(values)
    take_then = np.asarray([bool(condition(v)) for v in values])
    results = np.empty(values.shape, dtype=float)
    passes = []
    for active, fn in ((take_then, then_fn), (~take_then, else_fn)):
        if active.any():  # a side that no lane takes is skipped entirely
            results[active] = [fn(v) for v in values[active]]
            passes.append(active)
    return results, passes


def run_predicated(values, condition, then_fn, else_fn):
    """The branch-free version (``tl.where``): every lane computes both sides, then selects.

    Always one pass and no idle lanes, but always the work of both sides.
    Returns ``(results, passes)`` like ``run_divergent``.
    """
    values = np.asarray(values)
    take_then = np.asarray([bool(condition(v)) for v in values])
    both = np.asarray([then_fn(v) for v in values]), np.asarray([else_fn(v) for v in values])
    return np.where(take_then, *both), [np.ones(values.shape, dtype=bool)]


def divergent_passes(branch_taken) -> int:
    """Serialized passes a whole thread block needs for an if/else: summed over its warps.

    ``branch_taken`` holds one bool per thread (thread id order). A warp whose
    lanes all agree needs 1 pass; a warp that disagrees needs 2.
    """
    taken = np.asarray(branch_taken, dtype=bool)
    if taken.size % WARP_SIZE:
        raise ValueError(f"a block has a whole number of warps of {WARP_SIZE} threads, got {taken.size}")
    warps = taken.reshape(-1, WARP_SIZE)
    return int(sum(len(set(warp.tolist())) for warp in warps))


# ---- Thread coarsening -----------------------------------------------------------------------


def coarsened_matmul_loads(m: int, n: int, k: int, per_thread_m: int = 1, per_thread_n: int = 1) -> int:
    """Loads into registers when each thread computes a per_thread_m x per_thread_n patch of C.

    At each k step a thread loads per_thread_m values of A's column and
    per_thread_n values of B's row, and forms their outer product: pm*pn
    multiply-adds from pm + pn loads. One output per thread (1 x 1) costs 2 loads
    per multiply-add; a 4 x 4 patch costs 0.5. Fewer, more useful loads is what
    relieves a full memory-instruction queue (the MIO-throttle stall).
    Closed form of what ``coarsened_matmul_counting`` counts.
    """
    return k * (m * math.ceil(n / per_thread_n) + n * math.ceil(m / per_thread_m))


def coarsened_matmul_counting(a: np.ndarray, b: np.ndarray, per_thread_m: int, per_thread_n: int):
    """Matmul where each simulated thread owns a patch of C and caches operands in 'registers'.

    Returns ``(c, loads, threads)``; sizes need not be multiples of the patch.
    """
    m, k = a.shape
    n = b.shape[1]
    c = np.zeros((m, n), dtype=np.result_type(a, b))
    loads = threads = 0
    for i in range(0, m, per_thread_m):
        for j in range(0, n, per_thread_n):
            threads += 1
            acc = np.zeros((min(per_thread_m, m - i), min(per_thread_n, n - j)), dtype=c.dtype)
            for p in range(k):
                a_regs = a[i : i + per_thread_m, p]  # per_thread_m loads
                b_regs = b[p, j : j + per_thread_n]  # per_thread_n loads
                loads += a_regs.size + b_regs.size
                acc += np.outer(a_regs, b_regs)  # reused pm*pn times
            c[i : i + per_thread_m, j : j + per_thread_n] = acc
    return c, loads, threads
