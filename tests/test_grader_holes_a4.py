"""The A4 exercises (checkpoints and failures) cannot be fooled: a reshard that mis-orders the old
shards, keeps the old padding or forgets Adam's step count, a resume that restarts the data at
sample 0 or reads the wrong rows for its mesh, a checkpoint interval that is Young's or uses one
node's MTBF, and a save that is not atomic (written under the final name, renamed before every
rank's file, by the wrong rank, over the world instead of its group) each fail with a message that
names the mistake; the solution notebook's answers pass. In-process (no papermill): the formula
exercises in a few seconds, the saves on one shared 3-rank grading cluster, under a second each once
it has started.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_grader_holes import _fails

from ultrascale_grading.exercise_tests import properties_checkpoints
from ultrascale_grading.exercise_tests.properties import PROPERTIES
from ultrascale_grading import PASS, check

RESHARD, RESUME, INTERVAL = "a4.reshard_optimizer_state", "a4.resume_samples", "a4.checkpoint_interval"
BOXES, ATOMIC = "a4.flat_boxes", "a4.atomic_save"


def test_every_a4_exercise_has_a_property_in_the_merged_table():
    assert set(properties_checkpoints.PROPERTIES) == {RESHARD, RESUME, INTERVAL, BOXES}
    for exercise_id, prop in properties_checkpoints.PROPERTIES.items():
        assert PROPERTIES[exercise_id] is prop


def test_the_solutions_pass_their_fixed_cases_and_properties(a4):
    assert check(RESHARD, a4["reshard_optimizer_state"]).status == PASS
    assert check(RESUME, a4["resume_samples"]).status == PASS
    assert check(INTERVAL, a4["checkpoint_interval"]).status == PASS
    assert check(BOXES, a4["flat_boxes"]).status == PASS
    assert check(ATOMIC, a4["save_atomically"]).status == PASS


# ---- a4.reshard_optimizer_state ------------------------------------------------------------


def _reshard(states, shapes, n, *, names=None, strip=True, pad=True, step="keep", pad_with=torch.zeros):
    """A reshard written as a learner might, each keyword one mistake."""
    names = names(states) if names else [f"rank{r}" for r in range(len(states))]
    old = [states[name] for name in names]
    numel = sum(math.prod(s) for s in shapes)
    shard = -(-numel // n) if pad else numel // n
    new = [{} if step == "drop" else {"step": 0 if step == "zero" else old[0]["step"]} for _ in range(n)]
    for key in (k for k in old[0] if k != "step"):
        flat = torch.cat([s[key] for s in old])
        flat = flat[:numel] if strip else flat
        missing = max(0, shard * n - flat.numel())
        flat = torch.cat([flat, pad_with(missing, dtype=flat.dtype)])
        for r in range(n):
            new[r][key] = flat[r * shard : (r + 1) * shard].clone()
    return new


def test_reshard_refuses_shards_out_of_rank_order():
    def listed(states, shapes, new_world_size):  # the dict's order: a directory listing's
        return _reshard(states, shapes, new_world_size, names=list)

    def as_strings(states, shapes, new_world_size):  # 'rank10' < 'rank2'
        return _reshard(states, shapes, new_world_size, names=sorted)

    _fails(check(RESHARD, listed), "in the order the dict lists them", "by the number in each name")
    _fails(check(RESHARD, as_strings), "sorted as strings", "'rank10' before 'rank2'")


def test_reshard_refuses_a_dropped_or_kept_padding():
    def old_padding_kept(states, shapes, new_world_size):
        return _reshard(states, shapes, new_world_size, strip=False)

    def no_new_padding(states, shapes, new_world_size):
        return _reshard(states, shapes, new_world_size, pad=False)

    def padding_left_uninitialised(states, shapes, new_world_size):  # new_empty: whatever memory held
        return _reshard(
            states, shapes, new_world_size, pad_with=lambda n, dtype: torch.full((n,), float("nan"), dtype=dtype)
        )

    def padding_in_float32(states, shapes, new_world_size):  # torch.zeros without dtype=
        return _reshard(states, shapes, new_world_size, pad_with=lambda n, dtype: torch.zeros(n))

    _fails(check(RESHARD, old_padding_kept), "the value the old layout left in its padding", "cut it off")
    _fails(check(RESHARD, no_new_padding), "rounded down", "pad the flat state with zeros")
    _fails(check(RESHARD, padding_left_uninitialised), "its padding (the last 2) holds [nan, nan]", "with zeros")
    _fails(check(RESHARD, padding_in_float32), "keep the saved dtype, torch.bfloat16")


def test_reshard_refuses_a_forgotten_step_count():
    def no_step(states, shapes, new_world_size):
        return _reshard(states, shapes, new_world_size, step="drop")

    def step_restarted(states, shapes, new_world_size):
        return _reshard(states, shapes, new_world_size, step="zero")

    _fails(check(RESHARD, no_step), "has no 'step'", "bias correction", "Carry it over")
    _fails(check(RESHARD, step_restarted), "step is 0", "forgetting the optimizer's step")


def test_reshard_refuses_named_states_only_whole_states_and_changed_inputs():
    def adam_only(states, shapes, new_world_size):  # exp_avg and exp_avg_sq by name
        kept = {name: {k: s[k] for k in ("step", "exp_avg", "exp_avg_sq")} for name, s in states.items()}
        return _reshard(kept, shapes, new_world_size)

    def whole_state_everywhere(states, shapes, new_world_size):
        out = _reshard(states, shapes, 1)[0]
        return [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in out.items()} for _ in range(new_world_size)]

    def pops_the_step(states, shapes, new_world_size):  # changes the caller's checkpoint
        step = [s.pop("step") for s in states.values()][0]
        return [
            dict(s, step=step)
            for s in _reshard({k: dict(v, step=step) for k, v in states.items()}, shapes, new_world_size)
        ]

    def same_layout_returns_the_saved_tensors(states, shapes, new_world_size):
        if new_world_size == len(states):
            return [states[f"rank{r}"] for r in range(new_world_size)]
        return _reshard(states, shapes, new_world_size)

    _fails(check(RESHARD, adam_only), "raised KeyError")
    _fails(check(RESHARD, whole_state_everywhere), "the whole flat state", "only its own slice")
    _fails(check(RESHARD, pops_the_step), "changed its argument `states`")
    _fails(check(RESHARD, same_layout_returns_the_saved_tensors), "shares memory")


# ---- a4.resume_samples ---------------------------------------------------------------------


def _resume(
    checkpoint,
    global_batch,
    rank,
    dp,
    pp=1,
    tp=1,
    *,
    start=None,
    index=None,
    share_over=None,
    interleave=False,
    refuse=True,
    floats=False,
):
    """A resume written as a learner might, each keyword one mistake."""
    if refuse and global_batch % dp:
        raise ValueError("dp does not divide the global batch")
    share = global_batch // (share_over(checkpoint, dp) if share_over else dp)
    d = index(rank, dp, pp, tp) if index else rank // (pp * tp)
    first = start(checkpoint, global_batch) if start else checkpoint["next_sample"]
    if interleave:
        return list(range(first + d, first + global_batch, dp))
    if floats:
        first = int(float(first) + d * global_batch / dp)
        return [first + i for i in range(share)]
    return list(range(first + d * share, first + (d + 1) * share))


@pytest.mark.parametrize(
    "mistake, phrases",
    [
        (dict(start=lambda c, b: 0), ("started again at sample 0", "next_sample")),
        (dict(start=lambda c, b: c["step"] * b), ("step count times today's global batch", "warm-up")),
        (dict(index=lambda r, dp, pp, tp: r), ("global rank was taken", "same rows")),
        (dict(index=lambda r, dp, pp, tp: r % dp), ("rank % dp is not the dp coordinate",)),
        (dict(index=lambda r, dp, pp, tp: r // tp), ("forgets the pipeline axis",)),
        (dict(share_over=lambda c, dp: c["world_size"]), ("computed for the checkpoint's world size",)),
        (dict(interleave=True), ("interleaved", "contiguous block")),
        (dict(floats=True), ("expected the samples [1152921504606846979", "keep the arithmetic in integers")),
        (dict(refuse=False), ("should raise ValueError", "cannot split a global batch")),
    ],
    ids=[
        "sample-0",
        "from-the-step",
        "global-rank",
        "rank-mod-dp",
        "no-pp",
        "old-world",
        "interleaved",
        "float",
        "no-refusal",
    ],
)
def test_resume_refuses_each_mistake(mistake, phrases):
    def resume_samples(checkpoint, global_batch, rank, dp, pp=1, tp=1):
        return _resume(checkpoint, global_batch, rank, dp, pp, tp, **mistake)

    _fails(check(RESUME, resume_samples), *phrases)


def test_resume_refuses_a_changed_checkpoint():
    def consumes_the_position(checkpoint, global_batch, rank, dp, pp=1, tp=1):
        samples = _resume(checkpoint, global_batch, rank, dp, pp, tp)
        checkpoint["next_sample"] += global_batch  # moves the caller's position on
        return samples

    _fails(check(RESUME, consumes_the_position), "changed its argument `checkpoint`")


def test_resume_through_a_float_past_2_61_passes_the_fixed_cases_and_fails_a_drawn_position():
    """Every fixed position lies below 2**61, where this answer keeps integers; the property's first
    example starts at 2**62 + 1, which a float rounds to 2**62."""

    def resume_samples(checkpoint, global_batch, rank, dp, pp=1, tp=1):
        if global_batch % dp:
            raise ValueError("dp does not divide the global batch")
        share = global_batch // dp
        first = checkpoint["next_sample"] + (rank // (pp * tp)) * share
        if first > 2**61:  # written for "huge" positions as if a float were enough
            first = int(float(first))
        return list(range(first, first + share))

    _fails(
        check(RESUME, resume_samples),
        "an input they do not cover fails",
        "'next_sample': 4611686018427387905",
        "keep the arithmetic in integers",
    )


# ---- a4.checkpoint_interval ----------------------------------------------------------------


def _daly(c, m, *, minus_c=True, branch=True, half=True):
    if branch and c >= 2 * m:
        return m
    x = c / (2 * m) if half else c / m
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - (c if minus_c else 0)


@pytest.mark.parametrize(
    "wrong, phrases",
    [
        (lambda c, m, n: math.sqrt(2 * c * m / n), ("Young's first-order interval",)),
        (lambda c, m, n: _daly(c, m / n, minus_c=False), ("- C of Daly's formula is missing",)),
        (lambda c, m, n: _daly(c, m), ("one node's MTBF", "node_mtbf_s / nodes")),
        (lambda c, m, n: _daly(c, m * n), ("multiplied by the number of nodes",)),
        (lambda c, m, n: _daly(c, m / n, branch=False), ("For C >= 2M Daly's interval is M",)),
        (lambda c, m, n: _daly(c, m / n, half=False), ("in C/(2M), not C/M",)),
        (
            lambda c, m, n: _daly(c, m / n) if c != 2 * m / n else _daly(c, m / n, branch=False),
            ("checkpoint_s=150", "expected 75 s"),
        ),  # the boundary C = 2M belongs to the M branch
    ],
    ids=["young", "no-minus-c", "node-mtbf", "times-nodes", "no-branch", "c-over-m", "boundary"],
)
def test_interval_refuses_each_mistake(wrong, phrases):
    def checkpoint_interval(checkpoint_s, node_mtbf_s, nodes):
        return wrong(checkpoint_s, node_mtbf_s, nodes)

    _fails(check(INTERVAL, checkpoint_interval), *phrases)


def test_interval_refuses_the_library():
    def library(checkpoint_s, node_mtbf_s, nodes):
        from ultrascale.checkpoint.failures import daly_interval

        return daly_interval(checkpoint_s, node_mtbf_s / nodes)

    _fails(check(INTERVAL, library), "your code called the course library's", "daly_interval")


# ---- a4.flat_boxes -------------------------------------------------------------------------


def _runs_from(shape, start) -> list:
    """The ends of every box that starts at flat element ``start`` and is one run of consecutive elements."""
    coords, rest = [], start
    for d in reversed(shape):
        coords.insert(0, rest % d)
        rest //= d
    ends = [start + 1] if not shape else []
    for k in range(len(shape)):
        if any(coords[j] for j in range(k + 1, len(shape))):
            continue  # not at the start of a whole sub-tensor of dimension k
        inner = math.prod(shape[k + 1 :])
        ends += [start + n * inner for n in range(1, shape[k] - coords[k] + 1)]
    return ends


def _fewest(shape, start, stop) -> int:
    """The fewest boxes of a run, by dynamic programming over its elements (small shapes only)."""
    best = {stop: 0}
    for p in range(stop - 1, start - 1, -1):
        best[p] = min(best[q] + 1 for q in _runs_from(shape, p) if q in best)
    return best[start]


def test_the_library_count_the_check_holds_answers_to_is_the_fewest_possible():
    """The check compares a learner's number of boxes with the library's flat_boxes: on every run of
    every shape up to 4 x 4 x 4 (0-d to 3-D), that number is the true minimum."""
    from ultrascale.checkpoint.pieces import flat_boxes

    runs = 0
    for dims in range(4):
        for shape in itertools.product(range(1, 5), repeat=dims):
            n = math.prod(shape)
            for start in range(n):
                for stop in range(start + 1, n + 1):
                    assert len(flat_boxes(shape, start, stop)) == _fewest(shape, start, stop), (shape, start, stop)
                    runs += 1
    assert runs > 10_000


def _coords(shape, i) -> tuple:
    out = []
    for d in reversed(shape):
        out.insert(0, i % d)
        i //= d
    return tuple(out)


def test_flat_boxes_refuses_boxes_too_many_too_flat_or_out_of_order(a4):
    right = a4["flat_boxes"]

    def per_element(shape, start, stop):
        return [(_coords(shape, i), (1,) * len(shape)) for i in range(start, stop)]

    def flat_view(shape, start, stop):  # a box of the flattened tensor, not of the global one
        return [((start,), (stop - start,))] if stop > start else []

    def whole_rows_around(shape, start, stop):  # rounds the run out to whole rows
        if len(shape) < 2 or stop <= start:
            return right(shape, start, stop)
        row = math.prod(shape[1:])
        return [((start // row,) + (0,) * (len(shape) - 1), (-(-stop // row) - start // row,) + tuple(shape[1:]))]

    def reversed_order(shape, start, stop):
        return right(shape, start, stop)[::-1]

    def two_d_only(shape, start, stop):  # partial rows cut along the last dimension only
        if len(shape) < 3:
            return right(shape, start, stop)
        return [
            ((0,) * (len(shape) - 2) + box[0], (1,) * (len(shape) - 2) + box[1])
            for box in right((math.prod(shape[:-1]), shape[-1]), start, stop)
        ]

    _fails(check(BOXES, per_element), "2 boxes where 1 cover the run", "Take as much as one box can hold")
    _fails(check(BOXES, flat_view), "should hold 2 integer offsets and 2 integer sizes", "not of its flattened view")
    _fails(check(BOXES, whole_rows_around), "starts at flat element 0, but the run starts at 2")
    _fails(
        check(BOXES, reversed_order), "flat_boxes(shape=(4, 5), start=3, stop=17): box 0", "boxes come in flat order"
    )
    _fails(check(BOXES, two_d_only), "shape=(2, 3, 4)")


# ---- a4.atomic_save ------------------------------------------------------------------------


def _saver(
    *,
    into_final=False,
    barrier_between=True,
    group_of=lambda group: group,
    name_rank=None,
    renamer=None,
    copy=False,
    every_rank_renames=False,
):
    """A save written as a learner might, each keyword one mistake."""

    def save_atomically(root, step, tensor, group):
        rank = dist.get_rank(group)
        final = Path(root) / f"step-{step:08d}"
        temporary = final if into_final else final.with_name(final.name + ".partial")
        temporary.mkdir(parents=True, exist_ok=True)
        torch.save(tensor, temporary / f"rank{name_rank() if name_rank else rank}.pt")
        if barrier_between:
            dist.barrier(group=group_of(group))
        commits = renamer() if renamer else rank == 0
        if not into_final and (commits or every_rank_renames):
            if copy:
                shutil.copytree(temporary, final)
                shutil.rmtree(temporary)
            else:
                os.replace(temporary, final)
        dist.barrier(group=group_of(group))
        return final

    return save_atomically


def test_a_save_under_the_final_name_or_renamed_too_early_is_refused():
    """A rank that renames without waiting is caught every time: the watch holds the others' writes
    back until the first rank has written and entered a collective, so the rename sees them missing."""

    def barrier_before_the_writes_only(root, step, tensor, group):
        rank = dist.get_rank(group)
        final = Path(root) / f"step-{step:08d}"
        temporary = final.with_name(final.name + ".partial")
        temporary.mkdir(parents=True, exist_ok=True)
        dist.barrier(group=group)
        torch.save(tensor, temporary / f"rank{rank}.pt")
        if rank == 0:
            os.replace(temporary, final)
        return final

    _fails(
        check(ATOMIC, _saver(into_final=True)),
        "wrote rank0.pt straight into step-00000007",
        "Write into a temporary directory",
    )
    _fails(
        check(ATOMIC, _saver(barrier_between=False)),
        "group of ranks [1, 2]",
        "while it held ['rank0.pt']",
        "without the file(s) of rank(s) [1]",
        "a barrier over the group between the writes and the rename",
    )
    _fails(
        check(ATOMIC, barrier_before_the_writes_only),
        "without the file(s) of rank(s) [1]",
        "the rename must wait until every rank has written",
    )
    _fails(check(ATOMIC, _saver(copy=True)), "appeared without a rename", "Only a rename")
    _fails(check(ATOMIC, _saver(every_rank_renames=True)), "rank 1 of the group renamed", "made once")


def test_a_save_that_takes_the_world_for_its_group_is_refused():
    _fails(
        check(ATOMIC, _saver(group_of=lambda group: None)),
        "dist.barrier went over the default group",
        "pass group=group",
    )
    _fails(
        check(ATOMIC, _saver(name_rank=dist.get_rank)),
        "held ['rank1.pt', 'rank2.pt']",
        "named by the global rank",
        "dist.get_rank(group)",
    )
    _fails(
        check(ATOMIC, _saver(renamer=lambda: dist.get_rank() == 0)),
        "group of ranks [1, 2]",
        "no step-00000007 in root",
        "global rank 1",
        "dist.get_rank(group) == 0",
    )


def test_a_save_that_leaves_files_behind_or_returns_another_path_is_refused():
    def lock_left(root, step, tensor, group):
        final = _saver()(root, step, tensor, group)
        if dist.get_rank(group) == 0:
            (Path(root) / "save.lock").touch()
        return final

    def returns_the_temporary(root, step, tensor, group):
        final = _saver()(root, step, tensor, group)
        return final.with_name(final.name + ".partial")

    _fails(check(ATOMIC, lock_left), "['save.lock'] left in root")
    _fails(check(ATOMIC, returns_the_temporary), "returned", "step-00000007.partial", "return the checkpoint's final")


def test_a_save_through_the_library_is_refused():
    def library(root, step, tensor, group):
        from ultrascale.checkpoint.store import save_checkpoint

        return save_checkpoint(
            root, step, torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)], lr=1.0), group=group
        )

    _fails(check(ATOMIC, library), "your code called the course library's", "save_checkpoint")
