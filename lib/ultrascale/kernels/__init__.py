"""Triton kernels for the GPU chapter, runnable on a laptop.

Every kernel here has three parts: the ``@triton.jit`` function, a Python
wrapper that takes ordinary torch tensors and launches it, and a plain PyTorch
reference that the tests compare it with.

Running without a GPU
---------------------
Triton normally compiles kernels for a GPU. It also ships an *interpreter*
that runs the same kernel source on the CPU, one program instance at a time,
with numpy doing the block arithmetic. The interpreter is switched on by the
environment variable ``TRITON_INTERPRET=1``, and Triton reads that variable
when each ``@triton.jit`` decorator runs, i.e. when our kernel modules are
imported (so it works even if ``triton`` itself was imported earlier). This
package sets it (in ``_device``) *before* importing any kernel module, when
there is no CUDA device and the learner has not chosen a value themselves. On
a GPU node nothing is changed and the kernels are compiled.

The interpreter is slow (each program instance is a Python loop iteration),
so on a CPU use small sizes; it is meant for checking correctness and for
reading, not for timing.

Names
-----
Each wrapper is re-exported here under its module's name, so
``ultrascale.kernels.softmax`` is the *function*. To read or launch a kernel
itself, import it from its module: ``from ultrascale.kernels.softmax import
softmax_kernel``. ``gpu_ideas`` (counting models, no Triton) and
``compile_check`` (compile every kernel for an H100 without one) are modules.
"""

# Must come first: it sets TRITON_INTERPRET (when needed) before Triton is imported.
from ultrascale.kernels._device import interpreted, kernel_device, on_gpu  # noqa: I001

# Imported only now, after the environment variable is settled (see above).
from ultrascale.kernels.elu import elu, elu_reference  # noqa: E402
from ultrascale.kernels.flash_attention import (  # noqa: E402
    attention_reference,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
)
from ultrascale.kernels.layernorm import layer_norm, layer_norm_reference  # noqa: E402
from ultrascale.kernels.matmul import (  # noqa: E402
    blocks_touched,
    grouped_tile_order,
    kernel_tile_order,
    matmul,
    matmul_reference,
)
from ultrascale.kernels.rmsnorm import (  # noqa: E402
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
    rms_norm_reference,
)
from ultrascale.kernels.softmax import softmax, softmax_reference  # noqa: E402
from ultrascale.kernels.tiled_attention import (  # noqa: E402
    attention_hbm_bytes,
    attention_memory_report,
    naive_attention,
    peak_intermediate_bytes,
    tiled_attention_reference,
)
from ultrascale.kernels.vector_add import vector_add, vector_add_reference  # noqa: E402

from ultrascale.kernels import gpu_ideas  # noqa: E402  (pure numpy; no Triton)

__all__ = [
    "attention_hbm_bytes",
    "attention_memory_report",
    "attention_reference",
    "blocks_touched",
    "elu",
    "elu_reference",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_forward",
    "gpu_ideas",
    "grouped_tile_order",
    "interpreted",
    "kernel_device",
    "kernel_tile_order",
    "layer_norm",
    "layer_norm_reference",
    "matmul",
    "matmul_reference",
    "naive_attention",
    "on_gpu",
    "peak_intermediate_bytes",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "rms_norm_reference",
    "softmax",
    "softmax_reference",
    "tiled_attention_reference",
    "vector_add",
    "vector_add_reference",
]
