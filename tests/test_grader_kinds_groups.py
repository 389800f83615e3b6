"""Exercises whose function takes a process group are graded on groups that are not the world.

Issue 37, kind 1: graded only on the whole world (or on a group that starts at rank 0), a
function that leaves out ``group=``, reduces over the default group, takes its size from the
world or uses the global rank where the rank in the group is meant got full marks. Each test
submits several such answers (written inside the test, so that cloudpickle ships them by value
to the ranks) and expects a failure that says what is wrong; the solution notebook's own answer
must still pass. Also here: ``08.router``'s gradient (kind 4) and gradients left unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_grader_holes import _fails, _load

from ultrascale.grading import PASS, check

torch.set_num_threads(1)
GROUPS = "did you pass group="   # what every failure from an error or a hang on a split says


@pytest.fixture(scope="module")
def ch02():
    return _load("02_data_parallelism_exercises.ipynb")


@pytest.fixture(scope="module")
def ch06():
    return _load("06_context_parallelism_exercises.ipynb")


@pytest.fixture(scope="module")
def ch08():
    return _load("08_expert_parallelism_exercises.ipynb")


# ---- 02: data parallelism over a group ------------------------------------------------------

def test_overlapped_dp_hooks_average_over_the_group_given(ch02):
    class NoGroupPassed:   # keeps the group for its size, forgets it in the all-reduce
        def __init__(self, module, group=None):
            self.world_size, self.pending = dist.get_world_size(group), []
            for p in module.parameters():
                p.register_post_accumulate_grad_hook(self.grad_ready)

        def grad_ready(self, param):
            self.pending.append((param, dist.all_reduce(param.grad, async_op=True)))

        def finish(self):
            for param, work in self.pending:
                work.wait()
                param.grad.div_(self.world_size)
            self.pending.clear()

    class WorldSize(NoGroupPassed):   # the right group, the world's size
        def __init__(self, module, group=None):
            super().__init__(module, group)
            self.group, self.world_size = group, dist.get_world_size()

        def grad_ready(self, param):
            self.pending.append((param, dist.all_reduce(param.grad, group=self.group, async_op=True)))

    class IgnoresTheGroup(NoGroupPassed):   # the default group for everything: right on the world
        def __init__(self, module, group=None):
            super().__init__(module, None)

    exercise = "02.overlapped_dp_hooks"
    _fails(check(exercise, NoGroupPassed), "[1, 2]", "gradients of ranks outside the group got in", "group=")
    _fails(check(exercise, WorldSize), "[1, 2]", "divided by the world's size (3), not the group's (2)")
    _fails(check(exercise, IgnoresTheGroup), "[1, 2]", "outside the group got in")
    assert check(exercise, ch02["OverlappedGradSync"]).status == PASS


def test_bucket_manager_averages_over_the_group_given(ch02):
    def bucket_manager(all_reduce_group, size_of):
        """The solution's BucketManager, but reducing over ``all_reduce_group(group)`` and dividing
        by ``size_of(group)``: each wrong answer below changes one of them."""
        class Buckets(ch02["BucketManager"]):
            def __init__(self, params, bucket_cap_bytes, group=None):
                super().__init__(params, bucket_cap_bytes, group)
                self.group, self.world_size = all_reduce_group(group), size_of(group)
        return Buckets

    no_group = bucket_manager(lambda g: None, dist.get_world_size)
    world_size = bucket_manager(lambda g: g, lambda g: dist.get_world_size())
    exercise = "02.bucket_manager"
    _fails(check(exercise, no_group), "[1, 2]", "bucket_cap_bytes", "outside the group got in")
    _fails(check(exercise, world_size), "[1, 2]", "divided by the world's size (3)")
    assert check(exercise, ch02["BucketManager"]).status == PASS
