"""Properties of the A4 exercises (checkpoints and failures; see ``exercise_tests.properties`` for how
they run). Each drawn input is judged against the exercise test's reference in ``cha4``.

What the draws reach that the fixed cases do not:

* ``a4.reshard_optimizer_state``: any list of parameter shapes (0-d, size 1, more ranks than
  elements), old world sizes up to 16 (names from ``rank10`` on sort before ``rank2`` as strings),
  new ones up to 9, float32, float64 and bf16, one to three states of any names;
* ``a4.resume_samples``: positions far past 2**53, meshes up to dp 64 with pp and tp, global batches
  the dp ranks do not divide (a ``ValueError``);
* ``a4.flat_boxes``: shapes of up to 4 dimensions with size-1 sides, some of them huge (a loop over
  the elements would not finish), runs anywhere in them, empty ones included;
* ``a4.checkpoint_interval``: checkpoint times from milliseconds to days, node MTBFs up to centuries
  and a million nodes, both sides of C = 2M.

Every draw is a few small tensors or a formula: 25 of them cost each exercise well under a second.

``a4.atomic_save``'s property, a run on ranks, is in ``properties_last``.
"""

from __future__ import annotations

import math

from ultrascale_grading.guards import expect_value_error
from ultrascale_grading.properties import Property, floats
from ultrascale_grading.properties import strategies as _st

# ---- a4.reshard_optimizer_state ----------------------------------------------------------------

STATE_NAMES = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def _reshard_cases():
    st = _st()
    shape = st.lists(st.integers(1, 4), min_size=0, max_size=3)  # [] is a 0-d parameter
    return st.fixed_dictionaries(
        dict(
            shapes=st.lists(shape, min_size=1, max_size=4),
            old=st.integers(1, 16),
            new=st.integers(1, 9),
            keys=st.lists(st.sampled_from(STATE_NAMES), min_size=1, max_size=3, unique=True),
            dtype=st.sampled_from(floats()),
            seed=st.integers(0, 99),
        )
    )


def _reshard_args(case):
    from ultrascale_grading.exercise_tests.cha4 import saved_states

    shapes = [tuple(s) for s in case["shapes"]]
    return saved_states(shapes, case["old"], case["keys"], case["dtype"], case["seed"]), shapes, case["new"]


def _judge_reshard(fn, case):
    from ultrascale_grading.exercise_tests.cha4 import judge_reshard as judge

    states, shapes, new = _reshard_args(case)
    judge(fn(states, shapes, new), states, shapes, new, "the call")  # raises what is wrong
    return None


def _describe_reshard(case):
    shapes = [tuple(s) for s in case["shapes"]]
    return (
        f"reshard_optimizer_state(<{case['old']} ranks' {', '.join(case['keys'])} of {case['dtype']}>, "
        f"shapes={shapes}, new_world_size={case['new']})"
    )


# ---- a4.resume_samples ---------------------------------------------------------------------


def _resume_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            dp=st.sampled_from((1, 2, 3, 5, 8, 64)),
            pp=st.integers(1, 3),
            tp=st.integers(1, 4),
            per_rank=st.integers(1, 4),
            ragged=st.sampled_from((0, 0, 0, 1)),  # 1: a batch dp does not divide
            next_sample=st.one_of(st.integers(0, 10**4), st.integers(2**53, 2**62)),
            step=st.integers(0, 10**6),
            old=st.integers(1, 4096),
            rank_seed=st.integers(0, 10**6),
        )
    )


def _resume_args(case):
    batch = case["dp"] * case["per_rank"] + case["ragged"]
    checkpoint = dict(step=case["step"], next_sample=case["next_sample"], world_size=case["old"])
    rank = case["rank_seed"] % (case["dp"] * case["pp"] * case["tp"])
    return checkpoint, batch, rank


def _judge_resume(fn, case):
    from ultrascale_grading.exercise_tests.cha4 import check_samples, resume_mistakes, reference_resume

    checkpoint, batch, rank = _resume_args(case)
    dp, pp, tp = case["dp"], case["pp"], case["tp"]
    if batch % dp:
        expect_value_error(
            fn,
            dict(checkpoint),
            batch,
            rank,
            dp,
            pp=pp,
            tp=tp,
            call="the call",
            why=f"{dp} dp ranks cannot split a global batch of {batch} samples evenly",
        )
        return None
    want = reference_resume(checkpoint, batch, rank, dp, pp, tp)
    got = fn(dict(checkpoint), batch, rank, dp, pp=pp, tp=tp)
    check_samples("the call", got, want, resume_mistakes(checkpoint, batch, rank, dp, pp, tp))  # raises
    return None


def _describe_resume(case):
    checkpoint, batch, rank = _resume_args(case)
    return (
        f"resume_samples(checkpoint={checkpoint}, global_batch={batch}, rank={rank}, dp={case['dp']}, "
        f"pp={case['pp']}, tp={case['tp']})"
    )


# ---- a4.flat_boxes -------------------------------------------------------------------------


def _box_cases():
    st = _st()
    side = st.one_of(st.integers(1, 6), st.sampled_from((1, 1, 2**20 + 3)))
    return st.lists(side, min_size=0, max_size=4).flatmap(
        lambda shape: st.fixed_dictionaries(
            dict(shape=st.just(shape), a=st.integers(0, math.prod(shape)), b=st.integers(0, math.prod(shape)))
        )
    )


def _judge_boxes(fn, case):
    from ultrascale_grading.exercise_tests.cha4 import check_flat_boxes

    shape, (start, stop) = tuple(case["shape"]), sorted((case["a"], case["b"]))
    check_flat_boxes(fn(shape, start, stop), shape, start, stop, "the call")  # raises what is wrong
    return None


def _describe_boxes(case):
    start, stop = sorted((case["a"], case["b"]))
    return f"flat_boxes(shape={tuple(case['shape'])}, start={start}, stop={stop})"


# ---- a4.checkpoint_interval ----------------------------------------------------------------


def _interval_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            checkpoint_exp=st.integers(-3, 5),
            checkpoint_mantissa=st.integers(1, 99),
            mtbf_exp=st.integers(0, 10),
            mtbf_mantissa=st.integers(1, 99),
            nodes=st.integers(1, 10**6),
        )
    )


def _interval_args(case):
    c = case["checkpoint_mantissa"] * 10.0 ** case["checkpoint_exp"]
    return c, case["mtbf_mantissa"] * 10.0 ** case["mtbf_exp"], case["nodes"]


def _judge_interval(fn, case):
    from ultrascale_grading.exercise_tests.cha4 import reference_interval

    c, m, nodes = _interval_args(case)
    want = reference_interval(c, m, nodes)
    got = fn(c, m, nodes)
    if isinstance(got, (int, float)) and not isinstance(got, bool) and math.isclose(got, want, rel_tol=1e-9):
        return None
    side = "C >= 2M: the interval is M" if c >= 2 * m / nodes else "C < 2M"
    return f"expected {want!r} s ({side}, with M = node_mtbf_s / nodes = {m / nodes:.6g} s), got {got!r}"


def _describe_interval(case):
    c, m, nodes = _interval_args(case)
    return f"checkpoint_interval(checkpoint_s={c!r}, node_mtbf_s={m!r}, nodes={nodes})"


PROPERTIES: dict = {
    "a4.reshard_optimizer_state": Property(
        _reshard_cases,
        _judge_reshard,
        _describe_reshard,
        examples=(dict(shapes=[[2, 2], []], old=16, new=9, keys=["exp_avg"], dtype=floats()[2], seed=3),),
    ),
    "a4.resume_samples": Property(
        _resume_cases,
        _judge_resume,
        _describe_resume,
        examples=(
            dict(dp=64, pp=2, tp=4, per_rank=4, ragged=0, next_sample=2**62 + 1, step=10**6, old=4096, rank_seed=511),
        ),
    ),
    "a4.flat_boxes": Property(
        _box_cases,
        _judge_boxes,
        _describe_boxes,
        examples=(dict(shape=[3, 2**20 + 3, 1, 2], a=2**21 + 5, b=5 * 2**20 + 1),),
    ),
    "a4.checkpoint_interval": Property(
        _interval_cases,
        _judge_interval,
        _describe_interval,
        examples=(dict(checkpoint_exp=0, checkpoint_mantissa=20, mtbf_exp=0, mtbf_mantissa=40, nodes=4),),
    ),  # C = 2M
}
