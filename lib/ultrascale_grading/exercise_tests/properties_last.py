"""Properties of ``11.masked_add``, ``11.matmul_tile``, ``06.ring_step``, ``a1.communication_overlap``,
``10.smallest_pp`` and ``a4.atomic_save``. Each names what its draws reach that the exercise's fixed
cases do not:

* ``11.masked_add``: float64 and float16 vectors as well as float32 (the sum is exact only in the
  inputs' own dtype: a kernel that adds in float32 loses a float64 vector's last 29 bits), inputs
  that start after NaN in their buffers, any length and block size, fewer elements than one block;
* ``11.matmul_tile``: every one of the eight layouts (A, B and C each row- or column-major; the
  fixed cases have three), M or N smaller than one tile, and float16 operands of size up to
  100 into a float32 C (tl.dot's float32 result must be kept, not rounded back to float16 per
  block: an error of 2^-11 of each block's sum, or an overflow past 65,504);
* ``06.ring_step``: float32 blocks as well as float64 (the receive buffer must follow ``kv``'s dtype,
  never a dtype written down), any batch, heads, head size and tokens per chunk, the causal mask
  with either layout, on 2 and 3 ranks;
* ``a1.communication_overlap``: events named as any trace names them (NCCL kernels, other gloo
  collectives, point-to-point transfers: the lists are given, not to be filtered again by name),
  zero-length events, timestamps of a real trace (about 1.7e12 microseconds since the epoch) with
  fractions of a microsecond, four transfer threads, empty lists;
* ``10.smallest_pp``: budgets at which the answer is 1 (no pipeline at all) or 5 (no power of two:
  80 layers divide by 5), on the fixed case's model and layout, whose dry runs are remembered;
* ``a4.atomic_save``: a root that does not exist yet, or that holds earlier checkpoints (to be left
  as they were), steps of 0 and of nine digits, tensors 0-d, empty, bf16.

The Triton kernels are not drawn over the operands' dtype beyond these: under the interpreter
``tl.dot`` computes in float32 whatever a kernel asks, and bfloat16 is not modelled, so such a
draw would test the interpreter, not the learner.
"""

from __future__ import annotations

import math

import torch

from ultrascale_grading.properties import Property
from ultrascale_grading.properties import seeded_values as _values
from ultrascale_grading.properties import strategies as _st

# ---- 11.masked_add (under Triton's interpreter, or on a GPU) -----------------------------------


def _add_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            n=st.integers(1, 700),
            block=st.sampled_from((16, 32, 64, 128, 256)),
            dtype=st.sampled_from((torch.float32, torch.float64, torch.float16)),
            lead=st.integers(0, 3),
            seed=st.integers(0, 99),
        )
    )


def _judge_add(kernel, case):
    from ultrascale_grading.exercise_tests.ch11 import kernel_device, check_add

    x, y = (_values(case["seed"] + i, (case["n"],), case["dtype"]).to(kernel_device()) for i in range(2))
    check_add(kernel, x, y, case["block"], lead=case["lead"])  # raises what is wrong
    return None


def _describe_add(case):
    return f"{case['n']} element(s) of {case['dtype']}, BLOCK_SIZE={case['block']}" + (
        f", each input after {case['lead']} NaN in its buffer" if case["lead"] else ""
    )


# ---- 11.matmul_tile (under Triton's interpreter, or on a GPU) ----------------------------------

LAYOUTS = ("", "A", "B", "C", "AB", "AC", "BC", "ABC")


def _matmul_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            M=st.integers(1, 40),
            N=st.integers(1, 40),
            K=st.integers(1, 70),
            blocks=st.tuples(*(st.sampled_from((16, 32)) for _ in range(3))),
            layout=st.sampled_from(LAYOUTS),
            operands=st.sampled_from((torch.float32, torch.float16)),
            magnitude=st.sampled_from((1.0, 100.0)),
            seed=st.integers(0, 99),
        )
    )


def _judge_matmul(kernel, case):
    from ultrascale_grading.exercise_tests.ch11 import kernel_device, check_matmul

    a = _values(case["seed"], (case["M"], case["K"]), case["operands"], case["magnitude"]).to(kernel_device())
    b = _values(case["seed"] + 1, (case["K"], case["N"]), case["operands"], case["magnitude"]).to(kernel_device())
    check_matmul(kernel, a, b, case["blocks"], case["layout"])
    return None


def _describe_matmul(case):
    return (
        f"({case['M']} x {case['K']}) @ ({case['K']} x {case['N']}) in {case['operands']} of size "
        f"~{case['magnitude']:g}, tiles {' x '.join(map(str, case['blocks']))}, "
        + (f"{' and '.join(case['layout'])} column-major" if case["layout"] else "all row-major")
    )


PROPERTIES: dict = {
    "11.masked_add": Property(
        _add_cases,
        _judge_add,
        _describe_add,
        draws=(12, 60),
        examples=(dict(n=37, block=16, dtype=torch.float64, lead=1, seed=0),),
    ),
    "11.matmul_tile": Property(
        _matmul_cases,
        _judge_matmul,
        _describe_matmul,
        draws=(8, 40),
        examples=(
            dict(M=9, N=20, K=40, blocks=(16, 16, 16), layout="AC", operands=torch.float16, magnitude=100.0, seed=0),
        ),
    ),
}


# ---- a1.communication_overlap ---------------------------------------------------------------

COMPUTE_NAMES = ("autograd::engine::evaluate_function: MmBackward0", "aten::mm", "aten::add_", "Optimizer.step")
COMMUNICATION_NAMES = (
    "gloo:all_reduce",
    "gloo:reduce_scatter",
    "gloo:send",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
    "nccl:all_gather",
    "record_param_comms",
)
EPOCH = 1_732_000_000_000.0  # microseconds since the epoch, as a real trace's timestamps are
UNIT = 0.125  # a fraction of a microsecond that every sum keeps exactly (a power of two)


def _overlap_cases():
    st = _st()

    def events(names, start, tids):
        return st.lists(
            st.tuples(st.integers(*start), st.integers(0, 400), st.integers(0, len(names) - 1), st.sampled_from(tids)),
            max_size=8,
        )

    return st.fixed_dictionaries(
        dict(
            compute=events(COMPUTE_NAMES, (0, 800), (1,)),
            communication=events(COMMUNICATION_NAMES, (-100, 900), (5, 6, 7, 8)),
            epoch=st.booleans(),
        )
    )


def _overlap_events(case):
    from ultrascale_grading.exercise_tests.cha1 import trace_event

    base = EPOCH if case["epoch"] else 0.0
    return tuple(
        [trace_event(names[name], base + UNIT * start, UNIT * dur, tid=tid) for start, dur, name, tid in case[key]]
        for key, names in (("compute", COMPUTE_NAMES), ("communication", COMMUNICATION_NAMES))
    )


def _judge_overlap(fn, case):
    from ultrascale_grading.exercise_tests.cha1 import check_overlap

    compute, communication = _overlap_events(case)
    check_overlap(fn, compute, communication, "drawn trace")  # raises what is wrong
    return None


def _describe_overlap(case):
    compute, communication = _overlap_events(case)
    names = sorted({e["name"].split("(")[0] for e in communication})
    return (
        f"{len(compute)} compute and {len(communication)} communication event(s)"
        + (f" named {', '.join(names)}" if names else "")
        + (", timestamps since the epoch" if case["epoch"] else "")
        + f", in steps of {UNIT} us, zero-length ones included"
    )


PROPERTIES["a1.communication_overlap"] = Property(
    _overlap_cases,
    _judge_overlap,
    _describe_overlap,
    examples=(
        dict(compute=[(0, 400, 0, 1), (40, 100, 1, 1)], communication=[(200, 300, 3, 5), (350, 0, 2, 6)], epoch=True),
    ),
)


# ---- 06.ring_step (on ranks) ------------------------------------------------------------------


def _ring_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            dtype=st.sampled_from((torch.float32, torch.float64)),
            batch=st.integers(1, 2),
            heads=st.integers(1, 3),
            chunk=st.integers(1, 3),
            head_dim=st.integers(1, 5),
            causal=st.booleans(),
            layout=st.sampled_from(("zigzag", "contiguous")),
            seed=st.integers(0, 99),
        )
    )


def _ring_on_rank(ctx, fn, case):
    from ultrascale_grading.exercise_tests.ch06_ring_step import run_ring, ring_problem

    n = ctx.world_size
    shape = (case["batch"], case["heads"], 2 * n * case["chunk"], case["head_dim"])
    q, k, v = (_values(case["seed"] + i, shape, case["dtype"]).to(ctx.device) for i in range(3))
    problem = ring_problem(
        *run_ring(fn, ctx.group, list(range(n)), q, k, v, case["causal"], case["layout"], ctx.rank, n), n
    )
    return problem and f"rank {ctx.rank}: {problem}"


def _judge_ring(fn, case):
    from ultrascale.runtime import grading_cluster

    problems = grading_cluster(case["world_size"]).run(_ring_on_rank, fn, case)
    return next((p for p in problems if p), None)


def _describe_ring(case):
    b, h, c, d = (case[k] for k in ("batch", "heads", "chunk", "head_dim"))
    return (
        f"a ring of {case['world_size']} ranks, q and K/V blocks of {case['dtype']} (batch {b}, {h} head(s) of "
        f"size {d}, {2 * c} tokens per rank), {'causal' if case['causal'] else 'no mask'}, {case['layout']} "
        "layout"
    )


PROPERTIES["06.ring_step"] = Property(
    _ring_cases,
    _judge_ring,
    _describe_ring,
    draws=(4, 20),
    examples=(
        dict(
            world_size=3,
            dtype=torch.float32,
            batch=1,
            heads=2,
            chunk=1,
            head_dim=3,
            causal=True,
            layout="contiguous",
            seed=0,
        ),
    ),
)


# ---- 10.smallest_pp (dry runs at full size) -------------------------------------------------------
# Every draw is the fixed case's model and layout on another GPU: dry runs are remembered by their
# arguments, so the draws cost only the depths the fixed case did not measure (pp = 5: 2 s).

PP_DEPTHS = (1, 2, 4, 5)  # the first divisors of Llama 3 70B's 80 layers


def _pp_cases():
    st = _st()
    return st.fixed_dictionaries(dict(answer=st.sampled_from(PP_DEPTHS), at=st.sampled_from((0.0, 0.5, 0.99))))


def _pp_problem(case):
    """(model, layout, seq, memory_bytes) at which the answer is ``case['answer']``: a budget ``at`` of
    the way from the answer's measured total up to that of the depth before it (for pp = 1, up to
    twice its total)."""
    from ultrascale_grading.exercise_tests.ch10 import PP_CASES, measured_first_stage
    from ultrascale.parallel.compose import ParallelConfig as Layout

    model, fields, seq, _ = PP_CASES[0]
    layout = Layout(**fields)
    i = PP_DEPTHS.index(case["answer"])
    low = measured_first_stage(model, layout, seq, PP_DEPTHS[i]).total_bytes
    high = 2 * low if i == 0 else measured_first_stage(model, layout, seq, PP_DEPTHS[i - 1]).total_bytes
    return model, layout, seq, float(math.ceil(low + case["at"] * (high - low)))


def _judge_pp(fn, case):
    from ultrascale_grading.exercise_tests.ch10 import check_smallest_pp

    check_smallest_pp(fn, *_pp_problem(case))  # raises what is wrong
    return None


def _describe_pp(case):
    *_, memory_bytes = _pp_problem(case)
    return (
        f"Llama 3 70B, TP 8 with SP, DP 4 with ZeRO-1, 4096 tokens, on {memory_bytes / 1e9:.2f} GB: the smallest "
        f"depth that fits is pp = {case['answer']}"
    )


PROPERTIES["10.smallest_pp"] = Property(
    _pp_cases, _judge_pp, _describe_pp, draws=(2, 8), examples=(dict(answer=5, at=0.0), dict(answer=1, at=0.5))
)


# ---- a4.atomic_save (on ranks, in a scratch folder) ----------------------------------------------


def _atomic_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            split=st.sampled_from((0, 1)),
            step=st.sampled_from((0, 3, 99_999_999, 123_456_789)),
            earlier=st.lists(st.integers(0, 50), max_size=2, unique=True),
            root_exists=st.booleans(),
            shape=st.sampled_from(((), (0,), (5,), (2, 3, 1))),
            dtype=st.sampled_from((torch.float32, torch.float64, torch.bfloat16)),
        )
    )


def _judge_atomic(fn, case):
    import shutil
    import tempfile
    from pathlib import Path

    from ultrascale_grading.exercise_tests.cha4_atomic_save import FINAL, SPLITS, atomic_on_rank
    from ultrascale_grading.exercise_tests.cha4_atomic_save import judge_atomic as judge_directories

    split, step = SPLITS[case["split"]], case["step"]
    payload = dict(shape=case["shape"], dtype=case["dtype"])
    scratch = Path(tempfile.mkdtemp(prefix="a4-atomic-drawn-"))
    try:
        root, flags = scratch / "root", scratch / "flags"
        before = {}
        for earlier in case["earlier"]:  # checkpoints an earlier run left: to be kept as they are
            name = FINAL.format(earlier)
            before[name] = ("rank0.pt", f"checkpoint of step {earlier}".encode())
        for index in range(len(split.groups)):
            (flags / f"group{index}").mkdir(parents=True)
            if case["root_exists"] or before:
                (root / f"group{index}").mkdir(parents=True)
            for name, (inner, content) in before.items():
                (root / f"group{index}" / name).mkdir()
                (root / f"group{index}" / name / inner).write_bytes(content)
        per_rank = split.run(
            atomic_on_rank, fn, split, str(root), str(flags), step, payload, what="a4.atomic_save", timeout=60
        )
        judge_directories(per_rank, split, root, flags, step, payload, before)  # raises what is wrong
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return None


def _describe_atomic(case):
    split = ("3 ranks cut into [0] and [1, 2]", "the 3 ranks together")[case["split"]]
    root = (
        f"a root already holding the checkpoints of steps {case['earlier']}"
        if case["earlier"]
        else "a root that exists, empty"
        if case["root_exists"]
        else "a root that does not exist yet"
    )
    return f"step {case['step']} on {split}, {root}, each rank's tensor of shape {case['shape']} in {case['dtype']}"


PROPERTIES["a4.atomic_save"] = Property(
    _atomic_cases,
    _judge_atomic,
    _describe_atomic,
    draws=(3, 12),
    examples=(
        dict(split=0, step=12, earlier=[7], root_exists=True, shape=(), dtype=torch.bfloat16),
        dict(split=1, step=0, earlier=[], root_exists=False, shape=(5,), dtype=torch.float32),
    ),
)
