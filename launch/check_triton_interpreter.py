"""Exit 0 if Triton's interpreter (the course's kernels on a CPU) runs a kernel whose loop bound
is a runtime argument, as chapter 11's matmul and FlashAttention kernels have; 1 if not.

Triton 3.6's interpreter (the one torch 2.11's CUDA build pins) converts such a bound with int()
of a one-element numpy array, which numpy 2.4 refuses ("only 0-dimensional arrays can be
converted to Python scalars", triton-lang/triton#9171); launch/setup.sh then keeps numpy below
2.4. A file of its own, since triton.jit reads the kernel's source.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def count_up(out_ptr, n):
    for i in range(0, n, 1):
        tl.store(out_ptr + i, i)


def main() -> int:
    out = torch.zeros(3)
    try:
        count_up[(1,)](out, 3)
    except Exception as error:  # the interpreter wraps the TypeError in its own error
        print(
            f"[setup] triton {triton.__version__}'s interpreter failed a kernel with a runtime loop bound: "
            f"{type(error).__name__}: {error}"
        )
        return 1
    return 0 if out.tolist() == [0.0, 1.0, 2.0] else 1


if __name__ == "__main__":
    sys.exit(main())
