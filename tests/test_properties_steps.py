"""Issue 53, item 2, for the exercises of ``exercise_tests.properties_steps`` (a whole training step
on ranks): wrong answers that pass every fixed case (each written as a learner might, on an
assumption the fixed cases happen to satisfy) fail on a drawn input with a message that names the
mistake. The solutions pass their checks with the property cases added (graded as every solution
is, by test_grading's run of solutions/).

Each wrong answer is defined inside its test, so that cloudpickle ships it by value to the ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from test_grader_holes import _fails

from ultrascale_grading.exercise_tests import properties_steps
from ultrascale_grading.exercise_tests.properties import PROPERTIES
from ultrascale_grading import check

COVERED = {"02.overlapped_dp_hooks", "03.zero1_step", "03.zero3_gather_free", "07.stage_step"}
DRAWN = "the fixed cases pass, but an input they do not cover fails"


def test_every_exercise_here_has_a_property_in_the_merged_table():
    assert set(properties_steps.PROPERTIES) == COVERED
    for exercise_id, prop in properties_steps.PROPERTIES.items():
        assert PROPERTIES[exercise_id] is prop


# ---- 02.overlapped_dp_hooks: a model may hold a frozen weight, or a layer its loss does not use --------


def test_hooks_on_every_parameter_fail_on_a_frozen_weight():
    class OverlappedGradSync:
        def __init__(self, module, group=None):
            self.group, self.world_size, self.pending = group, dist.get_world_size(group), []
            for param in module.parameters():  # every parameter of the course GPT trains
                param.register_post_accumulate_grad_hook(self.grad_ready)

        def grad_ready(self, param):
            self.pending.append((param, dist.all_reduce(param.grad, group=self.group, async_op=True)))

        def finish(self):
            for param, work in self.pending:
                work.wait()
                param.grad.div_(self.world_size)
            self.pending.clear()

    _fails(
        check("02.overlapped_dp_hooks", OverlappedGradSync),
        DRAWN,
        "its first weight frozen",
        "refuses a hook on a tensor that requires no gradient",
        "`if param.requires_grad`",
    )


def test_a_finish_that_averages_every_parameter_fails_on_a_layer_the_loss_does_not_use():
    class OverlappedGradSync:
        def __init__(self, module, group=None):
            self.group, self.world_size, self.works = group, dist.get_world_size(group), []
            self.params = [p for p in module.parameters() if p.requires_grad]
            for param in self.params:
                param.register_post_accumulate_grad_hook(self.grad_ready)

        def grad_ready(self, param):
            self.works.append(dist.all_reduce(param.grad, group=self.group, async_op=True))

        def finish(self):
            for work in self.works:
                work.wait()
            self.works.clear()
            for param in self.params:  # every parameter that trains has a gradient by now
                param.grad.div_(self.world_size)

    _fails(
        check("02.overlapped_dp_hooks", OverlappedGradSync),
        DRAWN,
        "a layer `spare` the loss does not use",
        "'NoneType'",
        "only the gradients whose all-reduce grad_ready launched",
    )


# ---- 03.zero1_step: bf16 parameters with fp32 masters --------------------------------------------


def _zero1(gradient_to_master, gather=None):
    """A ZeRO-1 step as the solution writes it, but for how the reduced slice becomes the master's
    gradient and how the updated slices are gathered for the parameters (the two mistakes)."""
    from ultrascale.parallel import all_gather_into, reduce_scatter_into

    def in_the_parameters_dtype(master, params, n):
        full = torch.empty(master.numel() * n, dtype=params[0].dtype, device=master.device)
        all_gather_into(full, master.detach().to(full.dtype))
        return full

    gather = gather or in_the_parameters_dtype

    def zero1_step(ctx, params, master, optimizer):
        n = ctx.world_size
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        grads = torch.cat([flat, flat.new_zeros(-flat.numel() % n)]) / n
        grad_slice = grads.new_empty(master.numel())
        reduce_scatter_into(grad_slice, grads)
        master.grad = gradient_to_master(grad_slice)
        optimizer.step()
        full = gather(master, params, n)
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(full[offset : offset + p.numel()].view_as(p))  # copy_ casts to the parameter's dtype
                offset += p.numel()

    return zero1_step


def test_a_reduced_slice_given_to_the_fp32_master_as_it_is_fails_on_bf16_parameters():
    def as_it_is(grad_slice):
        return grad_slice  # the check's parameters are fp32, as the master is

    _fails(
        check("03.zero1_step", _zero1(as_it_is)),
        DRAWN,
        "in torch.bfloat16",
        "raised RuntimeError",
        "the masters fp32",
        "(the reduced slice .float())",
    )


def test_an_all_gather_of_the_fp32_masters_fails_on_bf16_parameters():
    def in_fp32(grad_slice):
        return grad_slice.float()

    def gather_the_masters(master, params, n):
        from ultrascale.parallel import all_gather_into

        full = master.new_empty(master.numel() * n)  # the masters' dtype: fp32
        all_gather_into(full, master.detach())
        return full

    _fails(
        check("03.zero1_step", _zero1(in_fp32, gather_the_masters)),
        DRAWN,
        "in torch.bfloat16",
        "moved 4 bytes per element",
        "cast the updated slice to the parameters' dtype",
    )


# ---- 03.zero3_gather_free: blocks in float64 and bf16 -------------------------------------------------


def _zero3(empty_buffer, empty_parameter):
    """The solution's hooks, but for how the gathered buffer and a freed parameter are made."""
    from ultrascale.parallel import all_gather_into

    def install_zero3_hooks(ctx, module):
        def gather(module, args):
            shard = module.zero3_shard
            full = empty_buffer(shard.numel() * ctx.world_size, shard)
            all_gather_into(full, shard)
            for p, offset, shape in module.zero3_layout:
                p.data = full[offset : offset + math.prod(shape)].view(shape)

        def free(module, args, output):
            for p, _, _ in module.zero3_layout:
                p.data = empty_parameter(p)

        return [module.register_forward_pre_hook(gather), module.register_forward_hook(free)]

    return install_zero3_hooks


def test_a_gathered_buffer_made_without_dtype_fails_on_float64_blocks():
    def without_dtype(numel, shard):
        return torch.empty(numel, device=shard.device)  # the check's blocks are fp32

    def freed(p):
        return torch.empty(0, dtype=p.dtype, device=p.device)

    _fails(
        check("03.zero3_gather_free", _zero3(without_dtype, freed)),
        DRAWN,
        "in torch.float64",
        "raised RuntimeError",
        "Make the gathered buffer in the shard's dtype",
    )


def test_parameters_freed_to_float32_fail_on_float64_blocks():
    def in_the_shards_dtype(numel, shard):
        return torch.empty(numel, dtype=shard.dtype, device=shard.device)

    def without_dtype(p):
        return torch.empty(0, device=p.device)  # "an empty tensor": float32, as the check's blocks

    _fails(
        check("03.zero3_gather_free", _zero3(in_the_shards_dtype, without_dtype)),
        DRAWN,
        "in torch.float64",
        "is an empty torch.float32 tensor",
        "an empty tensor of its own dtype",
    )


# ---- 07.stage_step: a pipeline of one stage, where rank 0 is also the last ------------------------------


def test_first_middle_last_branches_fail_on_a_pipeline_of_one_stage():
    def forward_step(stage, x, group, rank, p, shape, dtype):
        if rank == 0:  # the first stage: tokens in, an activation out
            output = stage(x)
            return x, output, [dist.isend(output.detach(), dst=1, group=group)]
        x = torch.empty(shape, dtype=dtype, device=x.device)
        dist.recv(x, src=rank - 1, group=group)
        x.requires_grad_()
        output = stage(x)
        if rank == p - 1:  # the last stage: its output is the loss
            return x, output, []
        return x, output, [dist.isend(output.detach(), dst=rank + 1, group=group)]

    def backward_step(stage_input, output, group, rank, p):
        if rank == p - 1:
            output.backward()
            return [dist.isend(stage_input.grad, dst=rank - 1, group=group)]
        grad = torch.empty_like(output)
        dist.recv(grad, src=rank + 1, group=group)
        torch.autograd.backward(output, grad)
        return [] if rank == 0 else [dist.isend(stage_input.grad, dst=rank - 1, group=group)]

    _fails(
        check("07.stage_step", forward_step, backward_step, world_size=3),
        DRAWN,
        "on p=1 rank(s)",
        "rank 0 is also the last rank",
        "not first / middle / last branches",
    )
