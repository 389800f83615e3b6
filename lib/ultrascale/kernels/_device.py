"""Where the kernels run: compiled on a CUDA GPU, or in Triton's CPU interpreter.

This module must be imported before ``triton``: it sets ``TRITON_INTERPRET=1``
when there is no CUDA device (and the learner has not set the variable), because
Triton decides between compiling and interpreting when each ``@triton.jit``
decorator runs. The package ``__init__`` imports it first for that reason.
"""

import os

import torch


def _choose_interpreter_if_no_gpu() -> None:
    # Respect an explicit choice (e.g. TRITON_INTERPRET=1 on a GPU node to debug a kernel).
    if "TRITON_INTERPRET" in os.environ:
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_choose_interpreter_if_no_gpu()


def interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter instead of being compiled."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def on_gpu() -> bool:
    """True when kernels are compiled for, and run on, a CUDA GPU."""
    return torch.cuda.is_available() and not interpreted()


def kernel_device() -> torch.device:
    """The device whose tensors the kernels accept: ``cuda`` on a GPU, else ``cpu``."""
    return torch.device("cuda") if on_gpu() else torch.device("cpu")


def check_tensors(*tensors: torch.Tensor) -> None:
    """Fail early, with a message that says what to do, if a kernel cannot take these tensors."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = tensors[0].device
    if on_gpu() and device.type != "cuda":
        raise ValueError(
            f"Triton compiles these kernels for the GPU, but the tensors are on {device}. "
            "Move them with .cuda(), or set TRITON_INTERPRET=1 before importing "
            "ultrascale.kernels to run them in the CPU interpreter."
        )
    if not on_gpu() and device.type != "cpu":
        raise ValueError(
            f"Triton runs in its CPU interpreter here, but the tensors are on {device}. "
            "Move them with .cpu() (or unset TRITON_INTERPRET on a GPU node)."
        )


def check_dot_dtype(*tensors: torch.Tensor) -> None:
    """Refuse bf16 for kernels that use ``tl.dot`` when running in the interpreter.

    Triton's interpreter keeps bf16 values as raw 16-bit integers and its ``tl.dot``
    multiplies those bit patterns, giving numbers around 1e10 instead of an error
    (triton-lang/triton issue 11584; not supported yet upstream). A wrong answer that
    looks like a number is worse than a clear refusal.
    """
    if interpreted() and any(t.dtype == torch.bfloat16 for t in tensors):
        raise ValueError(
            "Triton's CPU interpreter cannot run tl.dot on bfloat16 (it multiplies the raw bits). "
            "Use float32 or float16 on CPU; bfloat16 works on a GPU."
        )
