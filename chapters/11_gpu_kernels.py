# %% [markdown]
# # 11 · Inside the GPU: from a vector add to FlashAttention
#
# The previous chapters spread a model over many GPUs. This one looks inside a single GPU and
# asks why the same arithmetic can run ten times faster when it is written differently. The
# answer is almost always *memory*: where the data sits, how it is fetched, and how often it
# travels between the chip and its main memory.
#
# The plan:
# 1. **the hardware**: streaming multiprocessors, warps, blocks and the memory hierarchy, with the
#    H100's numbers, the tensor cores its peak FLOP/s comes from, and the index arithmetic every
#    kernel starts with;
# 2. **the tool ladder**: the same ELU in eager PyTorch, through `torch.compile` (we read the
#    code it generates) and as a hand-written Triton kernel;
# 3. **the performance ideas**, counted on paper so that a CPU can show them: memory coalescing,
#    tiling, thread coarsening and warp divergence; then the PTX a real H100 compile produces;
# 4. **every Triton kernel of the course library** run and checked against PyTorch: vector add,
#    ELU, softmax, RMSNorm (forward and backward), LayerNorm, tiled matmul, FlashAttention;
# 5. **FlashAttention explained by running it**: online softmax, the memory it saves, the HBM
#    traffic it avoids;
# 6. **real GPU numbers**: measured here when a GPU is present, otherwise the recorded run from
#    `results/`, labelled as such.
#
# **No GPU needed.** Triton normally compiles kernels for a GPU, but it also has an
# *interpreter* that runs the same kernel source on the CPU with numpy. The course library turns
# it on by itself when there is no CUDA device (`TRITON_INTERPRET=1`). The interpreter is slow
# and says nothing about speed, so on a CPU this chapter checks *correctness* and *counts*, and
# never passes a CPU timing off as a GPU one.

# %% tags=["parameters"]
WORLD_SIZE = 4  # kept so every chapter takes the same parameters; this one runs in a single process
QUICK = True  # True: small sizes, about 20 s on 2 CPU cores; False: larger sizes and longer sequences (longer)
SEED = 0

# %% [markdown]
# `WORLD_SIZE` is accepted but not used: a kernel runs on one device, so there are no ranks in
# this chapter. The results below are the same for any `WORLD_SIZE`.

# %%
import importlib.util
import inspect
import math
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time

# The course's kernel package comes first: with no CUDA device it sets TRITON_INTERPRET=1,
# which Triton reads when each kernel is defined.
import ultrascale.kernels as K  # noqa: I001
from ultrascale import records
from ultrascale.checks import nonempty
from ultrascale.kernels import gpu_ideas
from ultrascale.plan import datasheet
from ultrascale.viz.live import ProgressBar

import matplotlib.pyplot as plt
import numpy as np
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

assert WORLD_SIZE >= 1, "WORLD_SIZE must be a positive integer (this chapter does not use it)"
torch.manual_seed(SEED)
# One CPU thread: the tensors here are small, and with several threads their synchronisation
# costs more than the work (on a busy 2-core machine, up to 100x more). On a GPU this changes nothing.
torch.set_num_threads(1)
DEVICE = K.kernel_device()  # cuda on a GPU node, cpu (interpreter) elsewhere
ROOT = pathlib.Path.cwd().parent if pathlib.Path.cwd().name == "chapters" else pathlib.Path.cwd()

# Tolerances, and why. Element-wise and row-wise kernels compute in fp32 registers like PyTorch:
# only the summation order and exp rounding differ, a few ulps. Kernels built on tl.dot are exact
# fp32 products in the interpreter, but TF32 on a GPU (10-bit mantissa, ~5e-4 relative error).
ELEMENTWISE_TOL = dict(atol=1e-5, rtol=1e-5)
DOT_TOL = dict(atol=2e-2, rtol=2e-2) if K.on_gpu() else dict(atol=1e-4, rtol=1e-5)


def randn(*shape, seed=0, scale=1.0):
    """Reproducible random tensor on the kernels' device."""
    gen = torch.Generator().manual_seed(SEED * 1000 + seed)
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE)


print("kernels run", "compiled on a CUDA GPU" if K.on_gpu() else "in Triton's CPU interpreter (no CUDA GPU)")

# %% tags=["nbval-ignore-output"]
print(f"torch {torch.__version__}, triton {triton.__version__}, device {DEVICE}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")

# %% [markdown]
# ## 1. A GPU primer
#
# **Compute.** A GPU is made of many *streaming multiprocessors* (SMs; 132 on an H100), each a
# small processor with its own cores, registers and fast on-chip memory. A kernel launch creates a *grid* of
# *blocks* (Triton calls them *program instances*); the hardware hands whole blocks to SMs,
# and a block stays on its SM until it finishes. Inside a block, threads are grouped in
# **warps of 32** that execute one instruction at a time for all 32 lanes together.
#
# **Memory**, from fastest and smallest to slowest and largest:
#
# | level | where | H100 (SXM) size | who shares it |
# |---|---|---|---|
# | registers | in each SM | 256 KB per SM | one thread |
# | shared memory / L1 | in each SM | up to 228 KB of 256 KB per SM | the threads of one block |
# | L2 cache | on the chip | 50 MB | every SM |
# | global memory (HBM) | next to the chip | 80 GB at about 3.35 TB/s | every SM, and the host through copies |
#
# An SM can do far more arithmetic per second than HBM can feed it, so the art of writing a fast
# kernel is mostly keeping data in the upper rows of this table for as long as possible.

# %%
H100 = dict(sms=132, fp32_cores_per_sm=128, warp_size=32, hbm_gb=80)
cores = H100["sms"] * H100["fp32_cores_per_sm"]
assert cores == 16_896
print(f"H100: {H100['sms']} SMs x {H100['fp32_cores_per_sm']} FP32 cores = {cores:,} cores, {H100['hbm_gb']} GB of HBM")

threads_per_block = 256  # what the book's vector-add host code launches
warps_per_block = threads_per_block // H100["warp_size"]
assert warps_per_block * H100["warp_size"] == threads_per_block
print(f"a block of {threads_per_block} threads is {warps_per_block} warps of {H100['warp_size']}")

# %% [markdown]
# ### Tensor cores: where the 989 TFLOP/s comes from
# The 16,896 cores above are the *FP32 cores*: each does one fused multiply-add (FMA, two FLOPs)
# on two 32-bit numbers per clock. They are not where a transformer's matrix products run. Each SM
# also holds four **tensor cores**, units that each take small tiles of a matrix product in one go:
# they multiply 16-bit inputs (BF16 or FP16) and add the products into a 32-bit accumulator. A
# 16-bit multiplier is far smaller than a 32-bit one, so the chip fits many more of them; and the
# product of two BF16 numbers (8 significant bits each) fits exactly in FP32 (24 bits), so only
# the accumulation rounds, and it rounds in FP32. `tl.dot` in Triton and cuBLAS's BF16 kernels use
# them; chapter 12 is about what the 16-bit inputs cost in accuracy.
#
# The peak FLOP/s the whole course divides by (MFU in chapter 01, the planner in chapter 10) is the
# tensor cores' count times their rate times the clock. NVIDIA quotes the tensor-core figures at a
# boost clock of 1.83 GHz and the FP32 cores' at 1.98 GHz; the product, in code:

# %%
H100_TENSOR = dict(
    tensor_cores_per_sm=4, bf16_fma_per_tensor_core_per_clock=512, tensor_clock_hz=1.83e9, fp32_clock_hz=1.98e9
)
tensor_cores = H100["sms"] * H100_TENSOR["tensor_cores_per_sm"]
flops_per_clock = tensor_cores * 2 * H100_TENSOR["bf16_fma_per_tensor_core_per_clock"]  # an FMA is 2 FLOPs
tensor_peak = flops_per_clock * H100_TENSOR["tensor_clock_hz"]
fp32_peak = cores * 2 * H100_TENSOR["fp32_clock_hz"]
print(
    f"tensor cores: {H100['sms']} SMs x {H100_TENSOR['tensor_cores_per_sm']} = {tensor_cores} tensor cores, "
    f"x {2 * H100_TENSOR['bf16_fma_per_tensor_core_per_clock']} FLOPs per clock each = {flops_per_clock:,} FLOPs "
    f"per clock\n  x {H100_TENSOR['tensor_clock_hz'] / 1e9} GHz = {tensor_peak / 1e12:.1f} TFLOP/s dense BF16"
)
print(
    f"FP32 cores:   {cores:,} cores x 2 FLOPs (one FMA) x {H100_TENSOR['fp32_clock_hz'] / 1e9} GHz "
    f"= {fp32_peak / 1e12:.1f} TFLOP/s"
)
print(
    f"the tensor cores do {tensor_peak / fp32_peak:.1f}x the FP32 cores' work per second; the course's peak "
    f"(ultrascale.plan.datasheet('H100')) is {datasheet('H100').bf16_flops / 1e12:.0f} TFLOP/s"
)
assert round(tensor_peak / 1e12, 1) == 989.4 and round(fp32_peak / 1e12, 1) == 66.9
assert round(tensor_peak / 1e12) == datasheet("H100").bf16_flops / 1e12

# %% [markdown]
# Why the accumulator must be 32 bits: BF16 keeps 8 significant bits, so from 256 on it cannot
# tell `x` from `x + 1`. A dot product of 4096 ones, accumulated in BF16 one product at a time,
# stops growing at 256; accumulated in FP32, as a tensor core does, it reaches 4096 exactly.

# %%
ones = torch.ones(4096, dtype=torch.bfloat16)
acc16, acc32 = torch.zeros((), dtype=torch.bfloat16), torch.zeros((), dtype=torch.float32)
for a_i, b_i in zip(ones, ones):
    acc16 = acc16 + a_i * b_i  # multiply and add in 16 bits
    acc32 = acc32 + a_i.float() * b_i.float()  # 16-bit inputs, exact product, 32-bit accumulator
print(f"sum of 4096 products 1 x 1: accumulated in BF16 = {acc16.item():.0f}, in FP32 = {acc32.item():.0f}")
assert acc16.item() == 256 and acc32.item() == 4096

# %% [markdown]
# ### Which element does a thread own?
# A CUDA vector add is written for *one thread*. The host code allocates three device buffers
# (`cudaMalloc`), copies the inputs over (`cudaMemcpy`), launches the kernel with a grid size and
# a block size, copies the result back and frees the buffers. Inside the kernel, each thread
# computes its global index from where it sits in the grid:
#
# ```c
# __global__ void add_vectors(const float *x, const float *y, float *out, int n) {
#     int i = blockDim.x * blockIdx.x + threadIdx.x;   // this thread's element
#     if (i < n) out[i] = x[i] + y[i];                  // the last block runs past the end
# }
# // launch: add_vectors<<<(n + 255) / 256, 256>>>(x, y, out, n);
# ```
#
# The grid must have enough blocks to cover `n` elements, `blocksPerGrid = (n + threadsPerBlock - 1)
# / threadsPerBlock` in integer arithmetic, which is the ceiling of `n / threadsPerBlock`. When `n`
# is not a multiple of the block size, the last block has idle threads, and the bounds check keeps
# them from touching memory that is not theirs.


# %%
def global_thread_index(block_idx, block_dim, thread_idx):
    return block_dim * block_idx + thread_idx


def blocks_per_grid(n, threads_per_block):
    return (n + threads_per_block - 1) // threads_per_block


print(f"{'n':>12} {'blocks':>8} {'idle threads in the last block':>32}")
for n in (1, 255, 256, 257, 1000, 100_003, 100_000_000):
    blocks = blocks_per_grid(n, threads_per_block)
    assert blocks == math.ceil(n / threads_per_block) == triton.cdiv(n, threads_per_block)
    assert (blocks - 1) * threads_per_block < n <= blocks * threads_per_block  # enough, and no spare block
    print(f"{n:>12,} {blocks:>8,} {blocks * threads_per_block - n:>32}")

# Launch the whole grid for n = 1000 "by hand": every element is owned by exactly one thread.
n = 1000
owners = [
    global_thread_index(b, threads_per_block, t)
    for b in range(blocks_per_grid(n, threads_per_block))
    for t in range(threads_per_block)
]
active = [i for i in owners if i < n]  # the bounds check
assert sorted(active) == list(range(n)) and len(owners) - len(active) == 24

# %% [markdown]
# ### The same kernel in Triton
# Triton is written one level up: a program instance handles a whole *block of elements* at once,
# with vectors of offsets and a *mask* in place of the `if (i < n)`. The compiler decides how the
# block's lanes map onto threads and warps. Here is the course's kernel
# (`lib/ultrascale/kernels/vector_add.py`), then a launch over an awkward size.

# %%
from ultrascale.kernels.vector_add import vector_add_kernel  # noqa: E402

print(inspect.getsource(vector_add_kernel.fn))

# %%
x, y = randn(1000, seed=1), randn(1000, seed=2)
out = K.vector_add(x, y, block_size=128)  # a grid of ceil(1000 / 128) = 8 program instances
assert torch.equal(out, x + y)  # one fp32 addition per element on both sides: bit-identical
print(
    f"{triton.cdiv(1000, 128)} program instances; the last one has {1000 - 7 * 128} of its 128 lanes "
    "unmasked; result equals x + y exactly"
)

# %% [markdown]
# ## 2. The tool ladder: eager, `torch.compile`, Triton
#
# The example is the ELU activation: `x` where `x >= 0`, `alpha * (exp(x) - 1)` where `x < 0`.
#
# **Eager PyTorch** runs it as separate operators, each one a kernel that reads its inputs from
# memory and writes its output back. A dispatch hook lists what runs and how many bytes each
# operator moves.


# %%
def elu_eager(x, alpha=1.0):
    return torch.where(x < 0, alpha * (torch.exp(x) - 1), x)


class OperatorTraffic(TorchDispatchMode):
    """Records every operator PyTorch runs, with the bytes of its tensor inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))  # noqa: E731
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((func.__name__, nbytes(list(args) + list((kwargs or {}).values())), nbytes(outs)))
        return out


n = 1_000_003
x = randn(n, seed=3, scale=3.0)
with OperatorTraffic() as traffic:
    eager_out = elu_eager(x)
for name, read, written in traffic.ops:
    print(f"{name:>14}: reads {read / n:4.0f} bytes per element, writes {written / n:2.0f}")
eager_bytes = sum(r + w for _, r, w in traffic.ops)
fused_bytes = 2 * 4 * n  # one fp32 read and one fp32 write per element
print(
    f"eager: {len(traffic.ops)} kernels moving {eager_bytes / n:.0f} bytes per element; "
    f"a fused kernel moves {fused_bytes / n:.0f} ({eager_bytes / fused_bytes:.2f}x less)"
)
assert len(traffic.ops) == 5 and eager_bytes == 42 * n

# %% [markdown]
# Five kernels and 42 bytes per element, where one pass needs 8. An element-wise function does
# almost no arithmetic per byte, so its speed is set by memory traffic, and fusing the five
# operators into one kernel is worth about 5x on a GPU.
#
# **`torch.compile`** does that fusion automatically. Its backend, *inductor*, writes a new
# kernel for the whole function: Triton code on a GPU, C++ with vector instructions on a CPU
# (plus OpenMP threads when PyTorch may use several; this notebook uses one). `run_and_get_code`
# captures the generated source; setting `TORCH_LOGS=output_code` before starting Python prints
# the same thing. The first call compiles, which takes several seconds (longer on a fresh
# machine, whose compile cache is empty); later calls with the same shape reuse the kernel.

# %%
from torch._inductor.utils import run_and_get_code  # noqa: E402


def generated_kernel_source(module_code: str) -> str:
    """The kernel inside inductor's output module: the C++ or Triton source it hands to a compiler."""
    found = re.search(r"async_compile\.\w+\(.*?'''\n?(.*?)'''", module_code, flags=re.DOTALL)
    return found.group(1) if found else module_code


elu_compiled = torch.compile(elu_eager)
compile_start = time.perf_counter()
try:
    compiled_out, module_codes = run_and_get_code(elu_compiled, x)
    compile_error = None
except Exception as err:  # most often: no C++ compiler on a CPU machine
    compile_error = err
compile_seconds = time.perf_counter() - compile_start

if compile_error is None:
    kernel_source = generated_kernel_source(module_codes[0])
    torch.testing.assert_close(compiled_out, eager_out, **ELEMENTWISE_TOL)
    # Inductor specialises the kernel to the shape it saw: the element count is a constant in the code.
    assert str(n) in kernel_source, "expected the element count to be baked into the generated kernel"
    print(f"compiled ELU matches eager; its kernel has the size {n:,} written into it as a constant")
else:
    print(
        f"torch.compile could not build the kernel here: {type(compile_error).__name__}: {compile_error}\n"
        "On a CPU inductor needs a C++ compiler (install g++ or clang); the rest of the chapter does not."
    )

# %% tags=["nbval-ignore-output"]
# (generated code depends on the machine: the vector width on a CPU, the GPU's architecture)
if compile_error is None:
    print(f"first call (trace, generate, compile): {compile_seconds:.1f} s\n")
    lines = kernel_source.strip().splitlines()
    print("\n".join(lines[:45]) + (f"\n... ({len(lines) - 45} more lines)" if len(lines) > 45 else ""))

# %% [markdown]
# Read the generated code: one loop (or on a GPU, one `@triton.jit` kernel) that loads `x`,
# computes the comparison, the exponential and the select in registers, and stores the result:
# the five operators became one pass over memory. On a CPU the loop advances by as many floats
# as one vector register holds (8 or 16, depending on the processor), and a last, partial step
# handles the elements left over: the CPU's version of a mask. The element count appears as a
# literal, which is why a new shape triggers a new compile (after the second shape,
# `torch.compile` switches to a kernel with a symbolic size). The generated Triton kernel the
# book shows hard-codes its size in the same way.
#
# Timings on *this* machine (CPU timings if there is no GPU; they say nothing about a GPU):


# %% tags=["nbval-ignore-output"]
def wall_ms(fn, repeats=7):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


if K.on_gpu():
    import triton.testing

    big = torch.randn(2**26, device="cuda")
    bench = lambda fn: triton.testing.do_bench(fn, return_mode="median")  # noqa: E731
    rows = [
        ("eager (5 kernels)", lambda: elu_eager(big)),
        ("torch.compile", lambda: elu_compiled(big)),
        ("Triton elu_kernel", lambda: K.elu(big)),
    ]
    for name, fn in rows:
        ms = bench(fn)
        print(f"GPU {name:>20}: {ms:.3f} ms, {2 * big.numel() * 4 / ms / 1e6:.0f} GB/s of useful traffic")
elif compile_error is None:
    for name, fn in [("eager (5 kernels)", lambda: elu_eager(x)), ("torch.compile", lambda: elu_compiled(x))]:
        print(f"CPU {name:>18}: {wall_ms(fn):.2f} ms for {n:,} elements")
    print("(the Triton kernel runs in an interpreter here, so timing it would be meaningless)")

# %% [markdown]
# **Triton** is the next rung: you write the fused kernel yourself, at the level of blocks of
# elements, and keep full control of what is loaded and stored. This is the course's ELU
# (`lib/ultrascale/kernels/elu.py`), a readable version of what inductor generates:

# %%
from ultrascale.kernels.elu import elu_kernel  # noqa: E402

print(inspect.getsource(elu_kernel.fn))
for alpha in (1.0, 0.3):
    got = K.elu(x, alpha, block_size=1024)
    torch.testing.assert_close(got, K.elu_reference(x, alpha), **ELEMENTWISE_TOL)
    torch.testing.assert_close(got, torch.nn.functional.elu(x, alpha), **ELEMENTWISE_TOL)
print(f"Triton ELU matches torch.nn.functional.elu on {n:,} elements ({triton.cdiv(n, 1024)} program instances)")

# %% [markdown]
# | tool | effort | speed | flexibility |
# |---|---|---|---|
# | PyTorch eager | easiest | slowest: one kernel per operator | any model, any time |
# | `torch.compile` | one line | fast: fused kernels | limited to what the compiler can see and fuse |
# | Triton | you write blocks, masks, loads | faster when you know something the compiler does not | high |
# | CUDA | you write threads, shared memory, synchronisation | the ceiling | complete |
#
# The last rung, CUDA C++, is left out here: it needs a GPU to run. The ideas it exposes come
# next, made countable.

# %% [markdown]
# ## 3. Performance ideas, made visible on a CPU
#
# The book tunes a matrix multiplication step by step. We cannot time a GPU here, but every idea
# is at heart about *counting*: memory transactions, loads, instructions. `ultrascale.kernels.gpu_ideas`
# counts them under a small model of the hardware.
#
# ### 3.1 Memory coalescing
# When the 32 lanes of a warp load at once, the memory system serves the request in aligned
# segments (32-byte sectors). If the lanes read neighbouring addresses, a few segments serve the
# whole warp; if they read far-apart addresses, every lane costs its own segment.
#
# The naive matmul kernel uses a 2-D block and `x = blockIdx.x * blockDim.x + threadIdx.x` for
# the *row* of C. Since `threadIdx.x` varies fastest inside a warp, the 32 lanes of a warp take 32
# different rows: at each step of the inner loop they read 32 elements of A that are a whole row
# apart. The coalesced kernel remaps a 1-D block so that lanes share a row and take neighbouring
# columns: `x = blockIdx.x * BLOCKSIZE + threadIdx.x / BLOCKSIZE`,
# `y = blockIdx.y * BLOCKSIZE + threadIdx.x % BLOCKSIZE`.

# %%
n_mm = k_mm = 64
step = 5
naive = gpu_ideas.naive_matmul_warp_addresses(warp=0, step=step, n=n_mm, k=k_mm)
coalesced = gpu_ideas.coalesced_matmul_warp_addresses(warp=0, step=step, n=n_mm, k=k_mm)
for name, addr in (("naive", naive), ("coalesced", coalesced)):
    a_elems, b_elems = addr["A"] // 4, addr["B"] // 4
    a_cells = " ".join(str(divmod(int(e), k_mm)) for e in a_elems[:4])
    b_cells = " ".join(str(divmod(int(e), n_mm)) for e in b_elems[:4])
    print(f"{name:>9} warp 0, step {step}: lanes 0-3 read A at (row, col) {a_cells} ... and B at {b_cells} ...")
    print(f"{'':>9} segments: A {gpu_ideas.count_segments(addr['A'])}, B {gpu_ideas.count_segments(addr['B'])}")


def outputs_of_block(mapping, block_size=32, n=64, k=64):
    """(row, column) of C computed by each thread of block (0, 0), recovered from its addresses."""
    fn = dict(naive=gpu_ideas.naive_matmul_warp_addresses, coalesced=gpu_ideas.coalesced_matmul_warp_addresses)[mapping]
    cells = []
    for warp in range(block_size * block_size // 32):
        addr = fn(warp=warp, step=0, n=n, k=k, block_size=block_size)
        cells += zip((addr["A"] // 4 // k).tolist(), (addr["B"] // 4).tolist())
    return cells


# Both mappings give every output of the 32 x 32 block to exactly one thread; only the order differs.
for mapping in ("naive", "coalesced"):
    assert sorted(outputs_of_block(mapping)) == [(r, c) for r in range(32) for c in range(32)]

# %%
fig, axes = plt.subplots(1, 4, figsize=(13, 3.4))
for col, (name, addr) in enumerate((("naive", naive), ("coalesced", coalesced))):
    for j, (matrix, width) in enumerate((("A", k_mm), ("B", n_mm))):
        grid = np.zeros((32, 32))
        for e in np.unique(addr[matrix] // 4):
            r, c = divmod(int(e), width)
            if r < 32 and c < 32:
                grid[r, c] = 1
        ax = axes[2 * col + j]
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=1.3)
        segments = gpu_ideas.count_segments(addr[matrix])
        ax.set_title(f"{name}: {matrix} elements read\n({segments} segment{'s' if segments > 1 else ''})", fontsize=10)
        ax.set_xticks([]), ax.set_yticks([])
fig.suptitle("one warp, one step of the inner loop (top-left 32 x 32 corner of each matrix, row-major)")
fig.tight_layout()
plt.close(fig)
fig

# %% [markdown]
# Naive: a column of A, 32 separate segments (plus one element of B, broadcast to every lane).
# Coalesced: one element of A broadcast, and 32 consecutive floats of B, 128 bytes in 4 segments.
# Over a whole matmul:

# %%
size = 64 if QUICK else 128
transactions = {m: gpu_ideas.matmul_load_transactions(m, size, size, size) for m in ("naive", "coalesced")}
ratio = transactions["naive"] / transactions["coalesced"]
print(
    f"{size}^3 matmul, 32-byte segments: naive {transactions['naive']:,}, coalesced "
    f"{transactions['coalesced']:,} -> {ratio:.1f}x fewer memory transactions"
)
assert transactions["naive"] == 33 * (size // 32) ** 2 * 32 * size  # 33 segments per warp and step
assert ratio == 33 / 5

# %% [markdown]
# The book measures the same fix on an H100 with a profiler: about 10 times more memory
# throughput and a 10x shorter kernel. Our count (6.6x fewer transactions) is the same effect
# seen through a simpler model (no caches, one segment size).
#
# A CPU has its own version of this: it fetches memory in 64-byte cache lines. Reading floats
# one after another uses every byte of each line; reading every 16th float pays a whole line per
# float. The next cell copies the same number of floats at different strides (a timing on this
# CPU, so its output is not checked):


# %% tags=["nbval-ignore-output"]
def strided_read_ms(buffer, stride, count, repeats=5):
    """Median time to copy `count` floats spaced `stride` apart, each repeat from a fresh region."""
    times = []
    for rep in range(repeats + 1):
        start = (rep * count * stride) % (buffer.numel() - count * stride + 1)
        view = buffer[start : start + count * stride : stride]
        begin = time.perf_counter()
        view.clone()
        if rep:  # the first round is a warm-up
            times.append((time.perf_counter() - begin) * 1e3)
    return float(np.median(times))


cpu_buffer = torch.ones(2**24 if QUICK else 2**26)  # 64 MiB (256 MiB): larger than the CPU caches
count = 2**19
strided_read_ms(cpu_buffer, 1, count)  # touch the buffer once, so no measurement pays for first use
times = {stride: strided_read_ms(cpu_buffer, stride, count) for stride in (1, 2, 4, 8, 16)}
for stride, ms in times.items():
    print(f"stride {stride:>2}: {ms:6.2f} ms for {count:,} floats ({ms / times[1]:4.1f}x the contiguous time)")
del cpu_buffer

# %% [markdown]
# ### 3.2 Tiling with shared memory
# In a naive matmul every output element reads its whole row of A and column of B from global
# memory: `2 m n k` loads. A tiled kernel has a block copy a tile of A and a tile of B into shared
# memory (with a barrier, `__syncthreads()`, after the copy and another before the next copy), and
# every thread then reuses those tiles from on-chip memory. Each element of A is then read once
# per *column of tiles* of C rather than once per *column* of C: with square tiles of side T, T
# times fewer loads. `tiled_matmul_counting` does the blocked product in numpy and counts the
# loads into its "shared" buffer; sizes need not be multiples of the tile.

# %%
m_t, n_t, k_t = (96, 80, 72) if QUICK else (192, 160, 144)
rng = np.random.default_rng(SEED)
a_np, b_np = rng.standard_normal((m_t, k_t)), rng.standard_normal((k_t, n_t))
naive_loads = gpu_ideas.naive_matmul_loads(m_t, n_t, k_t)
assert gpu_ideas.tiled_matmul_loads(m_t, n_t, k_t, 1, 1) == naive_loads  # a 1 x 1 tile is the naive kernel
print(f"({m_t} x {k_t}) @ ({k_t} x {n_t}): naive {naive_loads:,} global loads")
tile_sides = [1, 2, 4, 8, 16, 32, 64]
for side in ProgressBar("counting loads").iterate((4, 8, 16, 32)):
    c_np, loads = gpu_ideas.tiled_matmul_counting(a_np, b_np, side, side, 16)
    np.testing.assert_allclose(c_np, a_np @ b_np, atol=1e-10)
    assert loads == gpu_ideas.tiled_matmul_loads(m_t, n_t, k_t, side, side)
    print(
        f"  tiles of {side:>2} x {side:<2}: {loads:>9,} loads ({naive_loads / loads:4.1f}x fewer), result equals a @ b"
    )

fig, ax = plt.subplots(figsize=(5.5, 3.4))
ax.loglog(
    tile_sides,
    [gpu_ideas.tiled_matmul_loads(m_t, n_t, k_t, s, s) for s in tile_sides],
    "o-",
    label="tiled (counted = closed form)",
)
ax.loglog(tile_sides, [naive_loads / s for s in tile_sides], "k:", label="naive / T")
ax.set_xlabel("tile side T"), ax.set_ylabel("global-memory loads"), ax.legend()
ax.set_title("tiling divides global loads by the tile side", fontsize=10)
fig.tight_layout()
plt.close(fig)
fig

# %% [markdown]
# Edge tiles are partial, so for tiles that do not divide the matrix the saving is a little
# below T. The tile side is bounded by shared memory: two fp32 tiles of 128 x 32 already take
# 32 KiB. In the book's measurements tiling brought the kernel to a memory throughput the book
# prints as 410 Gb/s, and 6.6 TFLOP/s, with a kernel time about 43% below the coalesced version's:
# reference points, not something we can reproduce without a GPU.
#
# ### 3.3 Thread coarsening
# After tiling, the profiler shows warps stalled on `mio_throttle`: the queue of memory
# instructions (loads from shared memory, here) is full. The remedy is to give each thread more
# work for each load. A thread that computes a `p x q` patch of C loads `p` values of A and `q`
# values of B per step of k, and does `p * q` multiply-adds with them.

# %%
a_small, b_small = rng.standard_normal((20, 9)), rng.standard_normal((9, 14))  # awkward sizes
for pm, pn in ((1, 1), (2, 2), (4, 3)):
    c_small, loads, n_threads = gpu_ideas.coarsened_matmul_counting(a_small, b_small, pm, pn)
    np.testing.assert_allclose(c_small, a_small @ b_small, atol=1e-10)
    assert loads == gpu_ideas.coarsened_matmul_loads(20, 14, 9, pm, pn)
    assert n_threads == math.ceil(20 / pm) * math.ceil(14 / pn)

side = 4096
macs = side**3
print(f"{side}^3 matmul, closed form:")
print(f"{'patch per thread':>17} {'threads':>11} {'register loads':>16} {'loads per multiply-add':>24}")
for p in (1, 2, 4, 8):
    loads = gpu_ideas.coarsened_matmul_loads(side, side, side, p, p)
    print(f"{f'{p} x {p}':>17} {(side // p) ** 2:>11,} {loads:>16,} {loads / macs:>24.2f}")
assert gpu_ideas.coarsened_matmul_loads(side, side, side, 4, 4) * 4 == gpu_ideas.coarsened_matmul_loads(
    side, side, side, 1, 1
)

# %% [markdown]
# One output per thread costs two loads per multiply-add; a 4 x 4 patch costs half a load.
# Fewer threads each doing more is the trade: fewer, more useful memory instructions, at the
# price of more registers per thread.
#
# ### 3.4 Control divergence
# A warp issues one instruction for all 32 lanes. When lanes disagree on an `if`, the warp runs
# the `then` side with the other lanes switched off, then the `else` side: the branch costs both
# sides. `run_divergent` runs a branch like a warp and records each pass's active lanes;
# `run_predicated` computes both sides for every lane and selects, which is what `tl.where` (and
# the `selp` instruction below) does.


# %%
def elu_negative_side(v):
    return math.exp(v) - 1


lanes = np.linspace(-2, 2, 32)  # half the warp negative, half positive
out_div, passes = gpu_ideas.run_divergent(lanes, lambda v: v < 0, elu_negative_side, lambda v: v)
out_pred, passes_pred = gpu_ideas.run_predicated(lanes, lambda v: v < 0, elu_negative_side, lambda v: v)
np.testing.assert_allclose(out_div, out_pred)
np.testing.assert_allclose(out_div, torch.nn.functional.elu(torch.from_numpy(lanes)).numpy())
print(f"divergent branch: {len(passes)} passes, active lanes per pass {[int(p.sum()) for p in passes]}")
print(f"predicated: {len(passes_pred)} pass, {int(passes_pred[0].sum())} active lanes (each computes both sides)")
assert [int(p.sum()) for p in passes] == [16, 16] and len(passes_pred) == 1

tid = np.arange(256)  # one block of 8 warps
signs = torch.randn(256, generator=torch.Generator().manual_seed(SEED)).numpy() < 0
patterns = {
    "tid % 2 == 0 (neighbours disagree)": tid % 2 == 0,
    "(tid // 32) % 2 == 0 (whole warps agree)": (tid // 32) % 2 == 0,
    "tid < 48 (one warp split)": tid < 48,
    "x < 0 for random data": signs,
}
for name, taken in patterns.items():
    print(f"  {name:>42}: {gpu_ideas.divergent_passes(taken):2d} passes for 8 warps")
assert [gpu_ideas.divergent_passes(p) for p in list(patterns.values())[:3]] == [16, 8, 9]

# %% [markdown]
# The same branch costs 8 passes or 16 depending on *which* threads take it: divergence is about
# lanes of one warp, not about the block. Data-dependent branches on random data split nearly
# every warp, which is why element-wise kernels select rather than branch.
#
# ### 3.5 What the compiler makes of it: PTX for an H100, compiled on this machine
# Triton can compile ahead of time for a named GPU, without having one: Python, then Triton IR,
# LLVM IR, and finally PTX, the GPU's assembly (`ultrascale.kernels.compile_check`). Here is the
# ELU kernel compiled for an H100 (`sm_90`). It shows three of the ideas above, done by the compiler:

# %% tags=["nbval-ignore-output"]
# (needs Triton's NVIDIA backend; the output depends on the Triton version)
env = dict(
    os.environ,
    TRITON_INTERPRET="0",
    TRITON_DEFAULT_FP_FUSION="1",
    PYTHONPATH=str(ROOT / "lib") + os.pathsep + os.environ.get("PYTHONPATH", ""),
)
done = subprocess.run(
    [
        sys.executable,
        "-m",
        "ultrascale.kernels.compile_check",
        "--arch",
        "90",
        "--only",
        "elu fp32",
        "--show-ptx",
        "elu",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
)
if done.returncode != 0:
    print("could not compile for an H100 here (this Triton has no NVIDIA backend?):\n", done.stderr[-2000:])
else:
    ptx = done.stdout
    instructions = [
        line.strip() for line in ptx.splitlines() if line.strip() and not line.strip().startswith(("//", "."))
    ]  # no comments, no directives
    loads = [i for i in instructions if "ld.global" in i]
    selects = [i for i in instructions if i.startswith("selp")]
    branches = [i for i in instructions if i.split()[0].startswith("bra")]
    threads_per_program = int(re.search(r"\.reqntid (\d+)", ptx).group(1))
    print(f"{threads_per_program} threads per program instance ({threads_per_program // 32} warps)")
    print(
        f"{len(loads)} predicated loads per thread: each thread handles {1024 // threads_per_program} "
        "of the block's 1024 elements (coarsening)"
    )
    print(f"{len(selects)} selects and {len(branches)} branches: the ELU's if/else is predicated, no divergence\n")
    for i in loads[:2] + [i for i in instructions if "ex2" in i][:1] + selects[:1]:
        print("   ", i)
    assert len(loads) * threads_per_program == 1024 and len(branches) == 0 and selects

# %% [markdown]
# * **coarsening**: 4 warps (128 threads) share a block of 1024 elements, so each thread loads 8;
# * **predication**: the mask becomes predicates (`@%p ld.global`), and `tl.where` becomes `selp`,
#   a select, with no branch at all;
# * **coalescing**: lane `t` reads element `t`, `t + 128`, `t + 256`, ...: at each load the 32
#   lanes of a warp read 32 neighbouring floats.
#
# **What only a GPU shows.** Everything in this section counts; none of it times. The time a
# transaction takes, how much the L1 and L2 caches recover from a bad access pattern, how many
# warps an SM keeps in flight to hide memory latency, which stall reason dominates
# (`mio_throttle` and the like, from `ncu`), and therefore the actual speed-ups (10x from
# coalescing, then 43% less time from tiling in the book's runs) need a real GPU and its profiler.
#
# ## 4. Every kernel of the library, checked against PyTorch
#
# Each kernel runs on sizes that are *not* multiples of its block sizes, so every mask is
# exercised. Each check below raises if the kernel disagrees with its PyTorch reference; the
# table at the end lists the largest difference found.

# %%
results = []


def check_kernel(name, shape, got, expected, tol):
    torch.testing.assert_close(got, expected, **tol, msg=lambda m: f"{name} {shape}: {m}")
    err = (got.double() - expected.double()).abs().max().item()
    results.append((name, str(shape), err, tol["atol"]))


# Vector add and ELU: one element per lane.
for n_el, block in ((1, 128), (1000, 128), (4097, 1024)):
    x, y = randn(n_el, seed=4), randn(n_el, seed=5)
    check_kernel("vector_add", (n_el,), K.vector_add(x, y, block_size=block), x + y, dict(atol=0, rtol=0))
for alpha in (1.0, 0.3):
    x = randn(3, 333, seed=6, scale=3)
    check_kernel(
        f"elu alpha={alpha}",
        tuple(x.shape),
        K.elu(x, alpha, block_size=256),
        torch.nn.functional.elu(x, alpha),
        ELEMENTWISE_TOL,
    )

# Softmax: one row per program instance; 1e4-sized logits overflow exp unless the max is subtracted.
for shape, scale in (((37, 300), 4), ((2, 5, 17), 4), ((4, 1), 1), ((3, 50), 1e4)):
    x = randn(*shape, seed=7, scale=scale)
    check_kernel(
        "softmax" + (" (huge logits)" if scale > 100 else ""),
        shape,
        K.softmax(x),
        torch.softmax(x, dim=-1),
        ELEMENTWISE_TOL,
    )

# RMSNorm forward and backward against autograd through the PyTorch reference.
x = randn(2, 19, 300, seed=8).requires_grad_()
w = (1 + 0.1 * randn(300, seed=9)).requires_grad_()
dy = randn(2, 19, 300, seed=10)
out = K.rms_norm(x, w)
dx, dw = torch.autograd.grad(out, (x, w), dy)
x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
out_ref = torch.nn.functional.rms_norm(x_ref, (300,), w_ref, eps=1e-6)
dx_ref, dw_ref = torch.autograd.grad(out_ref, (x_ref, w_ref), dy)
check_kernel("rms_norm forward", (2, 19, 300), out, out_ref, ELEMENTWISE_TOL)
check_kernel("rms_norm backward dx", (2, 19, 300), dx, dx_ref, ELEMENTWISE_TOL)
check_kernel("rms_norm backward dw", (300,), dw, dw_ref, dict(atol=1e-4, rtol=1e-5))  # a sum over 38 rows

# LayerNorm forward.
x, w, b = randn(37, 300, seed=11, scale=2) + 1, randn(300, seed=12), randn(300, seed=13)
check_kernel(
    "layer_norm",
    (37, 300),
    K.layer_norm(x, w, b),
    torch.nn.functional.layer_norm(x, (300,), w, b, eps=1e-5),
    ELEMENTWISE_TOL,
)

# Tiled matmul: plain order (group_m=1), grouped order with a short last group, one oversized tile.
a, b = randn(67, 53, seed=14), randn(53, 45, seed=15)
for tiles in (
    dict(block_m=16, block_n=16, block_k=16, group_m=1),
    dict(block_m=32, block_n=16, block_k=32, group_m=3),
    dict(block_m=64, block_n=64, block_k=64, group_m=8),
):
    check_kernel(
        f"matmul tiles {tiles['block_m']}x{tiles['block_n']}x{tiles['block_k']} group {tiles['group_m']}",
        (67, 53, 45),
        K.matmul(a, b, **tiles),
        a @ b,
        DOT_TOL,
    )
a_t, b_t = randn(53, 67, seed=16).t(), randn(45, 53, seed=17).t()  # transposed views: strides (1, rows)
check_kernel(
    "matmul, transposed (strided) inputs",
    (67, 53, 45),
    K.matmul(a_t, b_t, block_m=32, block_n=32, block_k=16),
    a_t @ b_t,
    DOT_TOL,
)

print(f"{len(results)} checks passed so far")

# %% [markdown]
# #### The order of the matmul's tiles
# Each program instance computes one tile of C. The GPU runs many at once, and the instances in
# flight share the L2 cache. In plain row-major order they need one row of tiles of A but *every*
# column of tiles of B. The library's kernel groups `GROUP_M` rows of tiles and walks down the
# columns within a group, so the instances in flight share a few tiles of A *and* of B. The
# picture numbers each tile by the instance that computes it, using the order computed by the
# Triton kernel's own `grouped_tile` function.

# %%
num_m, num_n, group, in_flight = 7, 6, 3, 6
orders = {
    "row-major (GROUP_M = 1)": K.kernel_tile_order(num_m, num_n, 1),
    f"grouped (GROUP_M = {group})": K.kernel_tile_order(num_m, num_n, group),
}
for gm, order in zip((1, group), orders.values()):
    assert order == K.grouped_tile_order(num_m, num_n, gm)  # kernel == Python mirror
    assert sorted(order) == [(i, j) for i in range(num_m) for j in range(num_n)]  # every tile once

fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
for ax, (title, order) in zip(axes, orders.items()):
    launch = np.zeros((num_m, num_n), dtype=int)
    for pid, (i, j) in enumerate(order):
        launch[i, j] = pid
    ax.imshow(launch, cmap="YlGnBu")
    for (i, j), pid in np.ndenumerate(launch):
        ax.text(
            j,
            i,
            pid,
            ha="center",
            va="center",
            fontsize=9,
            color="black" if pid < launch.size / 2 else "white",
            fontweight="bold" if pid < in_flight else None,
        )
        if pid < in_flight:
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2.5, ec="red"))
    touched = K.blocks_touched(order, in_flight)
    ax.set_title(f"{title}\nfirst {in_flight} instances (red) need {touched} tiles of A and B", fontsize=10)
    ax.set_xlabel("column of tiles of C (pid_n)"), ax.set_ylabel("row of tiles of C (pid_m)")
fig.tight_layout()
plt.close(fig)
fig

# %%
touched = {name: K.blocks_touched(order, in_flight) for name, order in orders.items()}
print(touched)
assert list(touched.values()) == [1 + in_flight, 3 + 2]  # 1 row + 6 columns, against 3 rows + 2 columns

# %% [markdown]
# #### FlashAttention forward and backward
# The attention kernels (section 5 explains them) against plain attention that builds the whole
# score matrix, with and without the causal mask, for head sizes 32 and 80 (not a power of two:
# padded to 128 inside the kernel and masked) and a sequence of 70 (not a block multiple).

# %%
flash_progress = ProgressBar("FlashAttention checks", total=6)  # 4 forward cases, then 2 backward
for causal in (False, True):
    for head_dim in (32, 80):
        q, k, v = (randn(1, 2, 70, head_dim, seed=s) for s in (20, 21, 22))
        out, lse = K.flash_attention_forward(q, k, v, causal)
        out_ref, lse_ref = K.attention_reference(q, k, v, causal)
        check_kernel(
            f"flash fwd {'causal' if causal else 'full'} d={head_dim}", (1, 2, 70, head_dim), out, out_ref, DOT_TOL
        )
        check_kernel(f"flash fwd logsumexp {'causal' if causal else 'full'}", (1, 2, 70), lse, lse_ref, DOT_TOL)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        check_kernel(f"flash fwd vs SDPA {'causal' if causal else 'full'}", (1, 2, 70, head_dim), out, sdpa, DOT_TOL)
        flash_progress.advance()

for causal in (False, True):
    q, k, v = (randn(1, 2, 70, 32, seed=s).requires_grad_() for s in (23, 24, 25))
    do = randn(1, 2, 70, 32, seed=26)
    grads = torch.autograd.grad(K.flash_attention(q, k, v, causal), (q, k, v), do)
    grads_ref = torch.autograd.grad(K.attention_reference(q, k, v, causal)[0], (q, k, v), do)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        check_kernel(f"flash bwd {name} {'causal' if causal else 'full'}", (1, 2, 70, 32), g, g_ref, DOT_TOL)
    flash_progress.advance()

print(f"all {len(nonempty(results, 'kernel checks'))} kernel checks passed:")
for name in dict.fromkeys(r[0].split(" d=")[0] for r in results):
    print("  ", name)

# %% tags=["nbval-ignore-output"]
# (the exact rounding differences depend on the CPU's vector instructions)
print(f"{'kernel':>48} {'shape':>16} {'max |diff|':>11} {'atol':>7}")
for name, shape, err, atol in nonempty(results, "kernel checks"):
    print(f"{name:>48} {shape:>16} {err:11.2e} {atol:7.0e}")

# %% [markdown]
# ## 5. FlashAttention, by running it
#
# Plain attention computes the scores `S = Q K^T` (an `s x s` matrix per head), the
# probabilities `P = softmax(S)` (another one), then `O = P V`. On a GPU each of these is a
# kernel that writes its `s x s` result to HBM and the next one reads it back. At `s = 32k` one
# head's S in fp32 is 4 GiB.
#
# FlashAttention never builds S. It takes a block of query rows, streams the keys and values
# past it in blocks, and keeps for each query row only three things in on-chip memory: the
# largest score seen so far `m`, the sum `l` of `exp(score - m)`, and the unnormalised output
# `acc`. When a new block raises the maximum, the old `l` and `acc` are scaled down by
# `exp(m_old - m_new)`: the **online softmax**. At the end, `acc / l` is exactly the sum of the
# values weighted by the softmax over all keys.
#
# One row of ten scores, in blocks of 4, 4 and 2:

# %%
scores = torch.tensor([0.5, 2.0, -1.0, 0.0, 3.5, 1.0, -2.0, 0.5, 4.0, 1.5])
values = torch.arange(10.0)  # a one-dimensional "value" per key, to see the weighted sum
m, l, acc = torch.tensor(float("-inf")), torch.tensor(0.0), torch.tensor(0.0)
for start, stop in ((0, 4), (4, 8), (8, 10)):
    block = scores[start:stop]
    m_new = torch.maximum(m, block.max())
    rescale = torch.exp(m - m_new)  # 0 on the first block (exp(-inf))
    p = torch.exp(block - m_new)
    l = l * rescale + p.sum()
    acc = acc * rescale + p @ values[start:stop]
    m = m_new
    print(
        f"keys {start}-{stop - 1}: max m = {m.item():.2f}, old sums scaled by {rescale.item():.4f}, "
        f"l = {l.item():.4f}, acc / l = {(acc / l).item():.4f}"
    )

exact = torch.softmax(scores, dim=0) @ values
print(f"softmax over all ten at once: {exact.item():.4f}")
torch.testing.assert_close(acc / l, exact)
torch.testing.assert_close(m + torch.log(l), torch.logsumexp(scores, dim=0))  # the statistic the backward keeps

# %% [markdown]
# The same loop over whole blocks of queries is `tiled_attention_reference` (pure PyTorch,
# `lib/ultrascale/kernels/tiled_attention.py`), and the Triton kernel
# (`flash_attention_forward_kernel`) is that loop again, with each block held in registers and
# shared memory. All three give the same answer as plain attention:

# %%
for causal in (False, True):
    q, k, v = (randn(2, 3, 70, 32, seed=s) for s in (30, 31, 32))
    naive_out, naive_lse = K.naive_attention(q, k, v, causal)
    tiled_out, tiled_lse = K.tiled_attention_reference(q, k, v, causal, None, block_m=16, block_n=24)
    flash_out, flash_lse = K.flash_attention_forward(q, k, v, causal)  # (batch 2, heads 3, seq 70, d 32)
    torch.testing.assert_close(tiled_out, naive_out, **ELEMENTWISE_TOL)
    torch.testing.assert_close(tiled_lse, naive_lse, **ELEMENTWISE_TOL)
    torch.testing.assert_close(flash_out, naive_out, **DOT_TOL)
    torch.testing.assert_close(flash_lse, naive_lse, **DOT_TOL)
    print(f"{'causal' if causal else 'full':>6}: tiled (PyTorch) == Triton FlashAttention == naive attention")

# %% [markdown]
# ### Memory: the s x s matrix is gone
# `peak_intermediate_bytes` watches every tensor PyTorch creates inside a function (through the
# operator dispatcher) and reports the most bytes alive at once, and a second hook below reports
# the single largest tensor. This is a measurement, on CPU, of the tensors the code builds.


# %%
class LargestTensor(TorchDispatchMode):
    """Remembers the largest number of elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


seq_lens = (128, 256, 512, 1024) if QUICK else (128, 256, 512, 1024, 2048, 4096)
head_dim, block = 32, 64
report = K.attention_memory_report(seq_lens, head_dim=head_dim, block=block)
print(
    f"{'seq':>6} {'naive peak':>12} {'tiled peak':>12} {'one s x s fp32':>15} "
    f"{'largest tensor: naive':>22} {'tiled':>7}"
)
for row in report:
    s = row["seq"]
    q, k, v = (torch.randn(1, s, head_dim) for _ in range(3))
    largest = {}
    for name, fn in (
        ("naive", lambda: K.naive_attention(q, k, v)),
        ("tiled", lambda: K.tiled_attention_reference(q, k, v, False, None, block, block)),
    ):
        with torch.no_grad(), LargestTensor() as probe:
            fn()
        largest[name] = probe.largest
    print(
        f"{s:>6} {row['naive_bytes'] / 2**20:>10.2f} MiB {row['tiled_bytes'] / 2**20:>8.2f} MiB "
        f"{row['score_matrix_bytes'] / 2**20:>11.2f} MiB {largest['naive']:>22,} {largest['tiled']:>7,}"
    )
    assert largest["naive"] >= s * s  # plain attention builds the whole score matrix...
    assert largest["tiled"] <= max(s * head_dim, block * block)  # ...the tiled loop never does
    assert row["naive_bytes"] >= row["score_matrix_bytes"]

assert report[-1]["tiled_bytes"] < report[-1]["score_matrix_bytes"] / 4

for prev, cur in zip(report, report[1:]):  # doubling s: tiled at most doubles (linear), naive ~quadruples
    assert cur["tiled_bytes"] <= 2 * prev["tiled_bytes"]
    assert cur["naive_bytes"] >= 3.5 * prev["naive_bytes"]

fig, ax = plt.subplots(figsize=(6, 3.8))
ax.loglog(seq_lens, [r["naive_bytes"] for r in report], "o-", label="naive attention (measured)")
ax.loglog(seq_lens, [r["tiled_bytes"] for r in report], "s-", label=f"tiled, blocks of {block} (measured)")
ax.loglog(seq_lens, [r["score_matrix_bytes"] for r in report], "k:", label="one s x s fp32 matrix")
ax.set_xlabel("sequence length s"), ax.set_ylabel("peak bytes of intermediates")
ax.set_title(f"one head, d = {head_dim}: quadratic against linear", fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
plt.close(fig)
fig

# %% [markdown]
# The tiled version's peak is its output (`s x d`) plus a few block-sized temporaries: it grows
# linearly. Naive attention holds S and P at once: quadratic.
#
# The same holds for what training keeps for the backward pass. Autograd through plain attention
# saves the `s x s` probabilities; the FlashAttention autograd function saves only Q, K, V, the
# output and one log-sum-exp per row, and rebuilds P block by block in the backward kernels.


# %%
def saved_for_backward_bytes(fn, *inputs):
    """Bytes autograd saves for the backward pass while running fn (each storage counted once)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


s_bwd = 256
q, k, v = (randn(1, 1, s_bwd, 32, seed=s).requires_grad_() for s in (33, 34, 35))
saved_naive = saved_for_backward_bytes(lambda *t: K.attention_reference(*t, True)[0], q, k, v)
saved_flash = saved_for_backward_bytes(lambda *t: K.flash_attention(*t, True), q, k, v)
print(
    f"s = {s_bwd}, d = 32: autograd saves {saved_naive / 2**10:.0f} KiB for plain attention, "
    f"{saved_flash / 2**10:.0f} KiB for FlashAttention (one s x s fp32 matrix: {s_bwd**2 * 4 / 2**10:.0f} KiB)"
)
assert saved_naive >= s_bwd * s_bwd * 4 > saved_flash
assert saved_flash == 4 * s_bwd * 32 * 4 + s_bwd * 4  # q, k, v, out and the log-sum-exp

# %% [markdown]
# ### HBM traffic, modelled
# Memory *size* is half of the story; the other half is *traffic*, the bytes moved between HBM
# and the chip, which sets the time of a memory-bound kernel. `attention_hbm_bytes` counts it for
# one head's forward pass (a model, not a measurement). Naive: read Q and K, write S, read S and
# write P, read P and V, write O: `4 s d + 4 s^2` elements. Flash: Q read once and O written
# once, and every block of `block_m` query rows streams all of K and V through the chip:
# `2 s d + 2 s d * ceil(s / block_m)` elements. The `s^2` term becomes `2 s^2 d / block_m`, and
# `block_m` (128 here) is as large as shared memory allows.

# %%
hbm_seqs = [1024 * 2**i for i in range(7)]  # 1k to 64k
block_m = 128
hbm = {d: [K.attention_hbm_bytes(s, head_dim=d, block_m=block_m, elem_bytes=2) for s in hbm_seqs] for d in (64, 128)}
print(f"{'':>7} {'d = 128':^34} {'d = 64':^15}")
print(f"{'seq':>7} {'naive':>11} {'flash':>11} {'naive/flash':>11} {'naive/flash':>15}")
for i, s in enumerate(hbm_seqs):
    t128, t64 = hbm[128][i], hbm[64][i]
    print(
        f"{s:>7,} {t128['naive'] / 2**20:>7.0f} MiB {t128['flash'] / 2**20:>7.0f} MiB "
        f"{t128['naive'] / t128['flash']:>10.2f}x {t64['naive'] / t64['flash']:>14.2f}x"
    )
# By hand for s = 1024, d = 128, blocks of 128, bf16: (4*1024*128 + 4*1024^2) * 2 and 2*1024*128 * (1 + 8) * 2.
assert hbm[128][0] == dict(naive=(4 * 1024 * 128 + 4 * 1024**2) * 2, flash=2 * 1024 * 128 * 9 * 2)
for d, rows in hbm.items():
    ratios = [t["naive"] / t["flash"] for t in rows]
    assert all(r > 1 for r in ratios) and ratios == sorted(ratios)
    assert abs(ratios[-1] / (2 * block_m / d) - 1) < 0.05  # long sequences: the ratio tends to 2 block_m / d

fig, ax = plt.subplots(figsize=(6, 3.8))
ax.loglog(hbm_seqs, [t["naive"] for t in hbm[128]], "o-", label="naive (S and P through HBM)")
ax.loglog(hbm_seqs, [t["flash"] for t in hbm[128]], "s-", label=f"FlashAttention, block_m = {block_m}")
ax.set_xlabel("sequence length s"), ax.set_ylabel("HBM bytes, one head's forward (bf16)")
ax.set_title("modelled HBM traffic, d = 128", fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
plt.close(fig)
fig

# %% [markdown]
# Both curves grow with `s^2`, since every query still meets every key. For long sequences the
# model's ratio tends to `2 block_m / d` (2x for d = 128, 4x for d = 64): FlashAttention reads each of K and V once per
# block of queries, while naive attention writes and reads `s x s` matrices twice. The model is a
# floor for the naive side: in practice S is often kept in fp32 and masking, scaling and dropout
# are separate kernels, each another round trip of an `s x s` matrix, which is where the large
# measured speed-ups come from. The *memory* saving above is the other half, and it is what lets
# long contexts fit at all. Exact attention became cheap enough that the approximate,
# linear-cost variants proposed before it saw little use.
#
# **What came after.** FlashAttention-2 cut the non-matmul work (rescaling once at the end
# rather than at every block), spread a single head's queries over several thread blocks, and
# divided the work among the warps of a block so they exchange less through shared memory.
# FlashAttention-3 targets the H100: asynchronous copies (TMA) overlapped with Tensor Core
# matmuls by specialised warps, and FP8. FlexAttention (in PyTorch) generates fused attention
# kernels from a small Python function that describes the mask or score modification.
#
# ## 6. Real GPU numbers
#
# `benchmarks/bench_kernels.py` times every kernel of the library against its PyTorch baseline
# with `triton.testing.do_bench` (warm-up, cache flush, CUDA events) and records the result with
# its provenance in `results/kernels_<device>.json`. On a GPU this notebook measures the same
# thing now; without one it shows the recorded file, labelled as recorded. The plot is a
# **roofline**: a kernel's achieved FLOP/s against its arithmetic intensity (FLOPs per byte of
# HBM traffic). Below the ridge point the ceiling is bandwidth x intensity; above it, the peak
# FLOP/s.


# %%
def load_bench_module():
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "benchmarks" / "bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLOPS_PER_ELEMENT = {"vector_add": 1, "elu": 3, "softmax": 5, "rms_norm": 4, "layer_norm": 7}  # rough counts


def roofline_point(row, rate):
    """(FLOPs per byte, FLOP/s) of one benchmark row, for the rate `rate` (ours or the baseline's)."""
    ms = row["ours_ms"]
    size = row["size"] if isinstance(row["size"], list) else [row["size"]]
    elem = 2 if "bf16" in row["kernel"] else 4
    if row["metric"] == "GB/s":  # memory-bound: bytes are known, FLOPs are a rough count per element
        nbytes = row["ours"] * 1e9 * ms * 1e-3
        flops = FLOPS_PER_ELEMENT[row["kernel"].split()[0]] * math.prod(size)
        return flops / nbytes, rate * 1e9 * flops / nbytes
    flops = row["ours"] * 1e12 * ms * 1e-3
    if row["kernel"].startswith("matmul"):
        nbytes = 3 * size[0] * size[1] * elem  # read A and B, write C, each once
    else:  # attention: q, k, v in and o out; the backward also reads o, dO and writes dq, dk, dv
        nbytes = (12 if "bwd" in row["kernel"] else 4) * math.prod(size) * elem
    return flops / nbytes, rate * 1e12


def show_kernel_results(record, label):
    bench = load_bench_module()
    print(label)
    print(f"measured device-to-device copy: {record['copy_gb_per_s']:.0f} GB/s\n")
    bench.print_rows(record["rows"])
    sheet = datasheet(record["device"])  # the roofline's ceilings: dense bf16 FLOP/s and HBM bytes/s
    fig, ax = plt.subplots(figsize=(8, 5))
    intensities = np.logspace(-2, 4, 200)
    copy_bw = record["copy_gb_per_s"] * 1e9
    ax.loglog(intensities, intensities * copy_bw, "k:", label=f"measured copy bandwidth ({copy_bw / 1e12:.2f} TB/s)")
    if sheet:
        bw, flops_peak = sheet.memory_bandwidth, sheet.bf16_flops
        ax.loglog(
            intensities,
            np.minimum(intensities * bw, flops_peak),
            "k-",
            lw=1,
            label=f"{sheet.label} datasheet: {bw / 1e12:.2f} TB/s, {flops_peak / 1e12:.0f} bf16 TFLOP/s",
        )
    for i, row in enumerate(record["rows"]):
        colour = f"C{i % 10}"
        xi, ours = roofline_point(row, row["ours"])
        _, base = roofline_point(row, row["baseline_value"])
        ax.loglog([xi], [ours], "o", color=colour, label=f"{row['kernel']} {row['size']}")
        ax.loglog([xi], [base], "x", color=colour)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte of HBM traffic, modelled)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title("\n".join(textwrap.wrap(label, 100)) + "\no = our Triton kernel, x = PyTorch baseline", fontsize=8)
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    plt.close(fig)
    return fig


if K.on_gpu():
    bench = load_bench_module()
    measured = bench.run("quick" if QUICK else "full")
    record = dict(records.provenance(torch.cuda.get_device_name(0)), **measured)
    shown = [(f"MEASURED NOW on {record['device']} (torch {record['torch']}, triton {record['triton']})", record)]
    figure = show_kernel_results(record, shown[0][0])
else:
    recorded = records.recorded("kernels")
    shown = [(records.label(record, path), record) for path, record in recorded]
    figure = None
    if not recorded:
        print(
            "No GPU here, and no GPU run has been recorded yet (no results/kernels_*.json).\n"
            "To record one, on a machine with a CUDA GPU run:\n"
            "    python benchmarks/bench_kernels.py\n"
            "It checks every kernel against PyTorch, times both with triton.testing.do_bench, and writes\n"
            "results/kernels_<device>.json with the device, torch/triton versions, commit and date.\n"
            "This notebook then shows it here, labelled as recorded."
        )
    for label, record in shown:
        figure = show_kernel_results(record, label)
figure

# %% [markdown]
# What those numbers say against the targets the course set itself, read from the run above
# (measured now on a GPU, else each recorded file, with its provenance):


# %%
def percent_range(values):
    low, high = min(values), max(values)
    return f"{low:.0%}" if round(low, 2) == round(high, 2) else f"{low:.0%}-{high:.0%}"


def times_range(values):
    low, high = min(values), max(values)
    return f"{low:.1f}x" if round(low, 1) == round(high, 1) else f"{low:.1f}-{high:.1f}x"


def kernel_findings(record):
    """The record's rows summed up: memory-bound kernels against a copy, compute-bound against PyTorch."""
    rows = record["rows"]
    print(f"  copy bandwidth {record['copy_gb_per_s'] / 1e3:.1f} TB/s (read plus write)")
    by_columns = {}
    for row in rows:
        if row["metric"] == "GB/s" and isinstance(row["size"], list):  # softmax, RMSNorm, LayerNorm
            by_columns.setdefault(row["size"][-1], []).append(row)
    for columns, group in sorted(by_columns.items()):
        print(
            f"  {', '.join(r['kernel'].split()[0] for r in group)} with {columns} columns: "
            f"{percent_range([r['fraction_of_copy'] for r in group])} of a copy, "
            f"{times_range([r['speedup_vs_baseline'] for r in group])} PyTorch's eager kernels, "
            f"{max(r['ours_ms'] for r in group) * 1e3:.0f} us at most per call"
        )
    for row in rows:
        if row["metric"] == "GB/s" and not isinstance(row["size"], list):  # vector add, ELU
            print(
                f"  {row['kernel']}: {row['fraction_of_copy']:.0%} of a copy, "
                f"{row['speedup_vs_baseline']:.2f}x {row['baseline']}"
            )
        elif row["metric"] == "TFLOP/s":
            print(
                f"  {row['kernel']} {'x'.join(map(str, row['size']))}: {row['ours']:.0f} TFLOP/s, "
                f"{row['speedup_vs_baseline']:.0%} of {row['baseline']}'s speed"
            )


for label, record in shown:
    print(label)
    kernel_findings(record)
if not shown:
    print("no GPU run measured here or recorded in results/: nothing to read")

# %% [markdown]
# * **Memory-bound kernels** should reach the copy bandwidth, and do when the rows are long. With
#   short rows each call lasts only tens of microseconds, and the fixed cost of a launch and of
#   the last wave of programs becomes a visible share of it. Vector add and ELU match PyTorch,
#   whose eager kernels also stream at the copy rate.
# * **Matmul** comes from a kernel of about forty lines with one fixed tile shape; cuBLAS picks
#   among many tuned kernels per shape, which is the gap left.
# * **FlashAttention**: the forward is close to SDPA's FlashAttention backend; forward plus
#   backward is further behind because our backward is the simple one of section 5: two kernels
#   that each recompute the scores, where FlashAttention-2 computes them once per tile.

# %% [markdown]
# ## Summary
#
# * A GPU is many SMs running warps of 32 lanes in lock-step; HBM is large and slow, registers and
#   shared memory are small and fast. Kernel index arithmetic (global index, blocks per grid, a
#   mask for the last block) is the same in CUDA and Triton.
# * The H100's 989 TFLOP/s is its 528 tensor cores (16-bit products, 32-bit sums) at 1.83 GHz,
#   about 15x what its FP32 cores can do; a 32-bit accumulator keeps a long sum from stalling.
# * Fusion removes round trips through memory: eager ELU moves 42 bytes per element in five
#   kernels, a fused kernel 8. `torch.compile` fuses automatically; Triton lets you do it by hand.
# * Coalescing, tiling and coarsening all cut memory transactions; predication avoids divergent
#   warps. The counts here show the direction and rough size; only a GPU shows the time.
# * FlashAttention is tiling plus online softmax: exact attention with memory linear in `s` and
#   far less HBM traffic, forward and backward.
#
# ## Your turn
# [exercises/11_gpu_kernels_exercises.ipynb](../exercises/11_gpu_kernels_exercises.ipynb), in the style of Triton-Puzzles, runs in
# the interpreter on any machine: a masked vector add, a row softmax, one tile of a matmul with
# `tl.dot`, and the online-softmax update at the heart of FlashAttention.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/11_gpu_kernels_exercises.ipynb` grades
# the whole notebook from a terminal.
