"""Compile every kernel for a real GPU, without needing one.

Triton can compile ahead of time for a named target: Python -> Triton IR ->
GPU IR -> LLVM IR -> PTX -> cubin (the last step with the ``ptxas`` that ships
inside the triton wheel). Doing it here, with the same tile sizes that the
wrappers pick on a GPU, catches what the CPU interpreter cannot: code the
compiler rejects, and tiles that need more shared memory than the chip has.
It also lets a learner read the generated PTX on a laptop.

Run:  TRITON_INTERPRET=0 python -m ultrascale.kernels.compile_check [--arch 90] [--only matmul] [--show-ptx elu]

Kernels must be imported with the interpreter off, so this is meant to run in
its own process (the test suite starts one).
"""

import argparse
import os
import sys

# An H100 (compute capability 9.0) allows up to 227 KiB of shared memory per block.
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def _kernel_specs():
    """(label, kernel, signature, constexprs, options) for each kernel at its GPU defaults."""
    import importlib

    import torch

    # importlib, because the package re-exports functions with the same names as these modules.
    elu, flash_attention, layernorm, matmul, rmsnorm, softmax, vector_add = (
        importlib.import_module(f"ultrascale.kernels.{name}")
        for name in ("elu", "flash_attention", "layernorm", "matmul", "rmsnorm", "softmax", "vector_add")
    )

    def sig(kernel, types, consts):
        full = dict(types)
        full.update({name: "constexpr" for name in consts})
        return {name: full[name] for name in kernel.arg_names}

    specs = []
    specs.append(
        (
            "vector_add fp32",
            vector_add.vector_add_kernel,
            dict(x_ptr="*fp32", y_ptr="*fp32", out_ptr="*fp32", n_elements="i32"),
            dict(BLOCK_SIZE=1024),
            dict(num_warps=4),
        )
    )
    specs.append(
        (
            "elu fp32",
            elu.elu_kernel,
            dict(x_ptr="*fp32", out_ptr="*fp32", n_elements="i32", alpha="fp32"),
            dict(BLOCK_SIZE=1024),
            dict(num_warps=4),
        )
    )
    block = 4096
    specs.append(
        (
            "softmax bf16 row 4096",
            softmax.softmax_kernel,
            dict(out_ptr="*bf16", in_ptr="*bf16", in_row_stride="i32", out_row_stride="i32", n_cols="i32"),
            dict(BLOCK_SIZE=block),
            dict(num_warps=softmax._num_warps(block)),
        )
    )
    specs.append(
        (
            "rms_norm forward bf16 4096",
            rmsnorm.rms_norm_forward_kernel,
            dict(
                x_ptr="*bf16",
                w_ptr="*bf16",
                y_ptr="*bf16",
                rstd_ptr="*fp32",
                row_stride="i32",
                n_cols="i32",
                eps="fp32",
            ),
            dict(BLOCK_SIZE=block),
            dict(num_warps=4),
        )
    )
    specs.append(
        (
            "rms_norm backward bf16 4096",
            rmsnorm.rms_norm_backward_kernel,
            dict(
                dy_ptr="*bf16",
                x_ptr="*bf16",
                w_ptr="*bf16",
                rstd_ptr="*fp32",
                dx_ptr="*bf16",
                dw_partial_ptr="*fp32",
                n_rows="i32",
                row_stride="i32",
                n_cols="i32",
            ),
            dict(BLOCK_SIZE=block),
            dict(num_warps=4),
        )
    )
    specs.append(
        (
            "layer_norm forward bf16 4096",
            layernorm.layer_norm_forward_kernel,
            dict(
                x_ptr="*bf16",
                w_ptr="*bf16",
                b_ptr="*bf16",
                y_ptr="*bf16",
                mean_ptr="*fp32",
                rstd_ptr="*fp32",
                row_stride="i32",
                n_cols="i32",
                eps="fp32",
            ),
            dict(BLOCK_SIZE=block),
            dict(num_warps=4),
        )
    )
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        cfg = matmul.default_tiles(dtype, gpu=True)
        ptr = f"*{name}"
        types = dict(
            a_ptr=ptr,
            b_ptr=ptr,
            c_ptr=ptr,
            M="i32",
            N="i32",
            K="i32",
            stride_am="i32",
            stride_ak="i32",
            stride_bk="i32",
            stride_bn="i32",
            stride_cm="i32",
            stride_cn="i32",
        )
        consts = dict(BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], GROUP_M=cfg["group_m"])
        specs.append(
            (
                f"matmul {name}",
                matmul.matmul_kernel,
                types,
                consts,
                dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
            )
        )
    for name in ("bf16", "fp32"):
        for head_dim in (64, 128):
            ptr, nbytes = f"*{name}", 2 if name == "bf16" else 4
            fwd = flash_attention.launch_config(head_dim, backward=False, gpu=True, dtype_bytes=nbytes)
            bwd = flash_attention.launch_config(head_dim, backward=True, gpu=True, dtype_bytes=nbytes)
            scalars = dict(seq_q="i32", seq_k="i32", head_dim="i32", sm_scale="fp32")
            specs.append(
                (
                    f"flash forward {name} d={head_dim}",
                    flash_attention.flash_attention_forward_kernel,
                    dict(q_ptr=ptr, k_ptr=ptr, v_ptr=ptr, o_ptr=ptr, lse_ptr="*fp32", **scalars),
                    dict(CAUSAL=True, **_consts(fwd)),
                    _options(fwd),
                )
            )
            specs.append(
                (
                    f"flash backward dk,dv {name} d={head_dim}",
                    flash_attention.flash_attention_backward_dkdv_kernel,
                    dict(
                        q_ptr=ptr,
                        k_ptr=ptr,
                        v_ptr=ptr,
                        do_ptr=ptr,
                        lse_ptr="*fp32",
                        delta_ptr="*fp32",
                        dk_ptr=ptr,
                        dv_ptr=ptr,
                        **scalars,
                    ),
                    dict(CAUSAL=True, **_consts(bwd)),
                    _options(bwd),
                )
            )
            specs.append(
                (
                    f"flash backward dq {name} d={head_dim}",
                    flash_attention.flash_attention_backward_dq_kernel,
                    dict(
                        q_ptr=ptr,
                        k_ptr=ptr,
                        v_ptr=ptr,
                        do_ptr=ptr,
                        lse_ptr="*fp32",
                        delta_ptr="*fp32",
                        dq_ptr=ptr,
                        **scalars,
                    ),
                    dict(CAUSAL=True, **_consts(bwd)),
                    _options(bwd),
                )
            )
    return [
        (label, kernel, sig(kernel, types, consts), consts, options) for label, kernel, types, consts, options in specs
    ]


def _consts(cfg):
    return {k: v for k, v in cfg.items() if k.startswith("BLOCK")}


def _options(cfg):
    return {k: v for k, v in cfg.items() if not k.startswith("BLOCK")}


def compile_all(arch: int = 90, only=None):
    """Compile each kernel (or those whose label starts with one of ``only``) for ``sm_<arch>``.

    Returns a list of (label, shared memory bytes, registers per thread, compiled kernel).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    results = []
    for label, kernel, signature, consts, options in _kernel_specs():
        if only and not any(label.startswith(prefix) for prefix in only):
            continue
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=consts), target=target, options=options)
        results.append((label, compiled.metadata.shared, getattr(compiled, "n_regs", None), compiled))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100)")
    parser.add_argument("--only", nargs="+", metavar="LABEL_PREFIX", help="compile only the matching kernels")
    parser.add_argument("--show-ptx", metavar="LABEL_PREFIX", help="print the PTX of the first matching kernel")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("set TRITON_INTERPRET=0: the interpreter does not compile kernels", file=sys.stderr)
        return 2
    limit = SHARED_MEMORY_LIMIT.get(args.arch)
    failures = 0
    for label, shared, _, compiled in compile_all(args.arch, args.only):
        fits = limit is None or shared <= limit
        failures += not fits
        print(f"{label:40s} shared memory {shared / 1024:7.1f} KiB {'ok' if fits else 'TOO MUCH'}")
        if args.show_ptx and label.startswith(args.show_ptx):
            print(compiled.asm["ptx"])
            args.show_ptx = None
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
