"""Properties of ``11.masked_add``, ``11.matmul_tile``, ``06.ring_step`` and
``a1.communication_overlap``. Each names what its draws reach that the exercise's fixed cases do not:

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
  fractions of a microsecond, four transfer threads, empty lists.

The Triton kernels are not drawn over the operands' dtype beyond these: under the interpreter
``tl.dot`` computes in float32 whatever a kernel asks, and bfloat16 is not modelled, so such a
draw would test the interpreter, not the learner.
"""

from __future__ import annotations

import torch

from ultrascale.grading.properties import Property
from ultrascale.grading.properties import seeded_values as _values
from ultrascale.grading.properties import strategies as _st

# ---- 11.masked_add (under Triton's interpreter, or on a GPU) -----------------------------------


def _add_cases():
    st = _st()
    return st.fixed_dictionaries(dict(
        n=st.integers(1, 700), block=st.sampled_from((16, 32, 64, 128, 256)),
        dtype=st.sampled_from((torch.float32, torch.float64, torch.float16)), lead=st.integers(0, 3),
        seed=st.integers(0, 99)))


def _judge_add(kernel, case):
    from ultrascale.exercise_tests.ch11 import _device, check_add

    x, y = (_values(case["seed"] + i, (case["n"],), case["dtype"]).to(_device()) for i in range(2))
    check_add(kernel, x, y, case["block"], lead=case["lead"])   # raises what is wrong
    return None


def _describe_add(case):
    return (f"{case['n']} element(s) of {case['dtype']}, BLOCK_SIZE={case['block']}"
            + (f", each input after {case['lead']} NaN in its buffer" if case["lead"] else ""))


# ---- 11.matmul_tile (under Triton's interpreter, or on a GPU) ----------------------------------

LAYOUTS = ("", "A", "B", "C", "AB", "AC", "BC", "ABC")


def _matmul_cases():
    st = _st()
    return st.fixed_dictionaries(dict(
        M=st.integers(1, 40), N=st.integers(1, 40), K=st.integers(1, 70),
        blocks=st.tuples(*(st.sampled_from((16, 32)) for _ in range(3))), layout=st.sampled_from(LAYOUTS),
        operands=st.sampled_from((torch.float32, torch.float16)), magnitude=st.sampled_from((1.0, 100.0)),
        seed=st.integers(0, 99)))


def _judge_matmul(kernel, case):
    from ultrascale.exercise_tests.ch11 import _device, check_matmul

    a = _values(case["seed"], (case["M"], case["K"]), case["operands"], case["magnitude"]).to(_device())
    b = _values(case["seed"] + 1, (case["K"], case["N"]), case["operands"], case["magnitude"]).to(_device())
    check_matmul(kernel, a, b, case["blocks"], case["layout"])
    return None


def _describe_matmul(case):
    return (f"({case['M']} x {case['K']}) @ ({case['K']} x {case['N']}) in {case['operands']} of size "
            f"~{case['magnitude']:g}, tiles {' x '.join(map(str, case['blocks']))}, "
            + (f"{' and '.join(case['layout'])} column-major" if case["layout"] else "all row-major"))


PROPERTIES: dict = {
    "11.masked_add": Property(_add_cases, _judge_add, _describe_add, draws=(12, 60), examples=(
        dict(n=37, block=16, dtype=torch.float64, lead=1, seed=0),)),
    "11.matmul_tile": Property(_matmul_cases, _judge_matmul, _describe_matmul, draws=(8, 40), examples=(
        dict(M=9, N=20, K=40, blocks=(16, 16, 16), layout="AC", operands=torch.float16, magnitude=100.0, seed=0),)),
}


# ---- a1.communication_overlap ---------------------------------------------------------------

COMPUTE_NAMES = ("autograd::engine::evaluate_function: MmBackward0", "aten::mm", "aten::add_", "Optimizer.step")
COMMUNICATION_NAMES = ("gloo:all_reduce", "gloo:reduce_scatter", "gloo:send",
                       "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                       "nccl:all_gather", "record_param_comms")
EPOCH = 1_732_000_000_000.0   # microseconds since the epoch, as a real trace's timestamps are
UNIT = 0.125                  # a fraction of a microsecond that every sum keeps exactly (a power of two)


def _overlap_cases():
    st = _st()

    def events(names, start, tids):
        return st.lists(st.tuples(st.integers(*start), st.integers(0, 400), st.integers(0, len(names) - 1),
                                  st.sampled_from(tids)), max_size=8)
    return st.fixed_dictionaries(dict(
        compute=events(COMPUTE_NAMES, (0, 800), (1,)), communication=events(COMMUNICATION_NAMES, (-100, 900),
                                                                             (5, 6, 7, 8)),
        epoch=st.booleans()))


def _overlap_events(case):
    from ultrascale.exercise_tests.cha1 import _ev

    base = EPOCH if case["epoch"] else 0.0
    return tuple([_ev(names[name], base + UNIT * start, UNIT * dur, tid=tid) for start, dur, name, tid in case[key]]
                 for key, names in (("compute", COMPUTE_NAMES), ("communication", COMMUNICATION_NAMES)))


def _judge_overlap(fn, case):
    from ultrascale.exercise_tests.cha1 import _check_overlap

    compute, communication = _overlap_events(case)
    _check_overlap(fn, compute, communication, "drawn trace")   # raises what is wrong
    return None


def _describe_overlap(case):
    compute, communication = _overlap_events(case)
    names = sorted({e["name"].split("(")[0] for e in communication})
    return (f"{len(compute)} compute and {len(communication)} communication event(s)"
            + (f" named {', '.join(names)}" if names else "")
            + (", timestamps since the epoch" if case["epoch"] else "")
            + f", in steps of {UNIT} us, zero-length ones included")


PROPERTIES["a1.communication_overlap"] = Property(_overlap_cases, _judge_overlap, _describe_overlap, examples=(
    dict(compute=[(0, 400, 0, 1), (40, 100, 1, 1)], communication=[(200, 300, 3, 5), (350, 0, 2, 6)], epoch=True),))


# ---- 06.ring_step (on ranks) ------------------------------------------------------------------

def _ring_cases():
    st = _st()
    return st.fixed_dictionaries(dict(
        world_size=st.sampled_from((2, 3)), dtype=st.sampled_from((torch.float32, torch.float64)),
        batch=st.integers(1, 2), heads=st.integers(1, 3), chunk=st.integers(1, 3), head_dim=st.integers(1, 5),
        causal=st.booleans(), layout=st.sampled_from(("zigzag", "contiguous")), seed=st.integers(0, 99)))


def _ring_on_rank(ctx, fn, case):
    from ultrascale.exercise_tests.ch06 import _close, _judge_step, _run_ring

    n = ctx.world_size
    shape = (case["batch"], case["heads"], 2 * n * case["chunk"], case["head_dim"])
    q, k, v = (_values(case["seed"] + i, shape, case["dtype"]).to(ctx.device) for i in range(3))
    steps, out, reference = _run_ring(fn, ctx.group, list(range(n)), q, k, v, case["causal"], case["layout"],
                                      ctx.rank, n)
    for s in steps:
        problem = _judge_step(s, n)
        if problem:
            return f"rank {ctx.rank}: {problem}"
    if not _close(out, reference):
        return f"rank {ctx.rank}: after {n} steps out differs from attention over the whole sequence"
    return None


def _judge_ring(fn, case):
    from ultrascale.runtime import grading_cluster

    problems = grading_cluster(case["world_size"]).run(_ring_on_rank, fn, case)
    return next((p for p in problems if p), None)


def _describe_ring(case):
    b, h, c, d = (case[k] for k in ("batch", "heads", "chunk", "head_dim"))
    return (f"a ring of {case['world_size']} ranks, q and K/V blocks of {case['dtype']} (batch {b}, {h} head(s) of "
            f"size {d}, {2 * c} tokens per rank), {'causal' if case['causal'] else 'no mask'}, {case['layout']} "
            "layout")


PROPERTIES["06.ring_step"] = Property(_ring_cases, _judge_ring, _describe_ring, draws=(4, 20), examples=(
    dict(world_size=3, dtype=torch.float32, batch=1, heads=2, chunk=1, head_dim=3, causal=True, layout="contiguous",
         seed=0),))
