"""The chapter 7 exercises cannot be fooled: plausible wrong answers fail with a message that
says what to fix, and the solution notebook's own answers pass."""

from __future__ import annotations

import torch
import torch.distributed as dist
from test_grader_holes import _fails

from ultrascale_grading import PASS, check


# ---- 07.one_f_one_b ---------------------------------------------------------------------


def test_one_f_one_b_refuses_afab_wrong_warmups_and_the_library(ch07):
    def afab(p, m, rank):  # same bubble, but all m micro-batches in flight
        return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]

    def warmup_one_too_many(p, m, rank):  # p - rank forwards first: one more micro-batch held
        w = min(p - rank, m)
        out = [f"F{i}" for i in range(w)]
        for i in range(m):
            out += ([f"F{w + i}"] if w + i < m else []) + [f"B{i}"]
        return out

    def no_warmup(p, m, rank):  # F0 B0 F1 B1 ... on every rank: one micro-batch in the pipe at a time
        return [x for i in range(m) for x in (f"F{i}", f"B{i}")]

    def warmup_from_the_wrong_end(p, m, rank):  # rank forwards first: rank 0 waits for B0 before sending F1
        w = min(rank, m)
        out = [f"F{i}" for i in range(w)]
        for i in range(m):
            out += ([f"F{w + i}"] if w + i < m else []) + [f"B{i}"]
        return out

    def newest_backward_first(p, m, rank):  # the drain in reverse: B of the last micro-batch first
        out = ch07["one_f_one_b_list"](p, m, rank)
        forwards = [a for a in out if a.startswith("F")]
        return forwards + [f"B{i}" for i in reversed(range(m))]

    def library(p, m, rank):
        from ultrascale.schedule import one_f_one_b_rank

        return one_f_one_b_rank(p, m, rank)

    exercise = "07.one_f_one_b"
    _fails(check(exercise, afab), "that is AFAB", "p - 1 - rank forwards")
    _fails(check(exercise, warmup_one_too_many), "hold [", "min(p - rank, m)")
    _fails(check(exercise, no_warmup), "simulated bubble is 1.0000, not (p-1)/m = 0.2500", "too short a warm-up")
    _fails(check(exercise, warmup_from_the_wrong_end), "not a schedule that can run", "deadlocks")
    _fails(check(exercise, newest_backward_first), "p=2, m=4")
    _fails(check(exercise, library), "the course library's", "one_f_one_b_rank")
    assert check(exercise, ch07["one_f_one_b_list"]).status == PASS


# ---- 07.bubble_fraction -----------------------------------------------------------------


def test_bubble_refuses_share_of_the_step_own_windows_and_the_formula(ch07):
    def share_of_step(spans):  # idle / (p * makespan): the idle share, not r_bubble
        start = min(a for r in spans for a, _ in r)
        end = max(b for r in spans for _, b in r)
        busy = sum(b - a for r in spans for a, b in r)
        return (len(spans) * (end - start) - busy) / (len(spans) * (end - start))

    def own_windows(spans):  # each rank idles only between its own first and last action
        busy = sum(b - a for r in spans for a, b in r)
        return (sum(max(b for _, b in r) - min(a for a, _ in r) for r in spans) - busy) / busy

    def formula(spans):  # (p-1)/m counted from the spans: off wherever the book's premises fail
        p = len(spans)
        m = len(spans[0]) // 2
        return (p - 1) / m

    def one_micro_batch_more(spans):  # (p-1)/(m+1): the bubble off by one micro-batch
        return (len(spans) - 1) / (len(spans[0]) // 2 + 1)

    def library(spans):
        from ultrascale.schedule.simulate import bubble_fraction

        return bubble_fraction(
            [
                dict(rank=r, name=f"forward {i} stage 0", start=a, end=b)
                for r, spans_r in enumerate(spans)
                for i, (a, b) in enumerate(spans_r)
            ]
        )

    exercise = "07.bubble_fraction"
    _fails(check(exercise, share_of_step), "naive, p=3", "idle share of the step's time")
    _fails(check(exercise, own_windows), "naive, p=3", "its own first to its own last")
    _fails(check(exercise, formula), "which holds only when t_b = 2 t_f")
    _fails(check(exercise, one_micro_batch_more), "naive, p=3", "expected 2.0000")
    _fails(check(exercise, library), "the course library's", "bubble_fraction")
    assert check(exercise, ch07["bubble"]).status == PASS


# ---- 07.stage_step ----------------------------------------------------------------------


def test_stage_step_refuses_blocking_sends_lost_gradients_and_the_library(ch07):
    forward, backward = ch07["forward_step"], ch07["backward_step"]

    def blocking_send(stage, x, group, rank, p, shape, dtype):
        if rank > 0:
            x = torch.empty(shape, dtype=dtype)
            dist.recv(x, src=rank - 1, group=group)
            x.requires_grad_()
        y = stage(x)
        if rank < p - 1:
            dist.send(y.detach(), dst=rank + 1, group=group)  # waits for the receiver with NCCL
        return x, y, []

    def waits_for_its_send(stage_input, output, group, rank, p):
        works = backward(stage_input, output, group, rank, p)
        for work in works:
            work.wait()  # the step blocks until its send is done
        return works

    def input_without_grad(stage, x, group, rank, p, shape, dtype):  # the received activation is a constant
        if rank > 0:
            x = torch.empty(shape, dtype=dtype)
            dist.recv(x, src=rank - 1, group=group)
        y = stage(x)
        works = [dist.isend(y.detach(), dst=rank + 1, group=group)] if rank < p - 1 else []
        return x, y, works

    def loss_gradient_only(stage_input, output, group, rank, p):  # never receives: backward from a ones tensor
        output.backward(torch.ones_like(output))
        return [dist.isend(stage_input.grad, dst=rank - 1, group=group)] if rank > 0 else []

    def sends_to_itself(stage, x, group, rank, p, shape, dtype):  # dst= the rank, not the next one
        if rank > 0:
            x = torch.empty(shape, dtype=dtype)
            dist.recv(x, src=rank - 1, group=group)
            x.requires_grad_()
        y = stage(x)
        works = [dist.isend(y.detach(), dst=rank, group=group)] if rank < p - 1 else []
        return x, y, works

    def library_forward(stage, x, group, rank, p, shape, dtype):
        from ultrascale.parallel.pipeline_parallel import Pipeline

        Pipeline._F(None, None, None)

    exercise = "07.stage_step"
    _fails(check(exercise, blocking_send, backward), "a blocking dist.send", "use dist.isend")
    _fails(check(exercise, forward, waits_for_its_send), "waited for its own send")
    _fails(check(exercise, input_without_grad, backward), "raised")
    _fails(
        check(exercise, forward, loss_gradient_only),
        "0 receive(s); this step receives 1",
        "the output's gradient from rank + 1",
    )
    _fails(check(exercise, sends_to_itself, backward), "to this rank itself", "stage r sends its activations")
    _fails(check(exercise, library_forward, backward), "the course library's", "_F")
    assert check(exercise, forward, backward).status == PASS


def test_stage_step_with_a_receive_buffer_of_another_dtype_fails_at_once_under_a_gpu_nodes_rules(ch07, monkeypatch):
    # Under strict point-to-point mode the send refuses a receive buffer of another size; its
    # receive then fails too (zeros answer it), so the ranks agree to stop at once instead of
    # waiting out the grader's 60 s for a receive nothing would fill.
    monkeypatch.setenv("ULTRASCALE_STRICT_P2P", "1")

    def float32_buffer(stage, x, group, rank, p, shape, dtype):
        if rank > 0:
            x = torch.empty(shape, dtype=torch.float32)  # the activations are float64
            dist.recv(x, src=rank - 1, group=group)
            x = x.to(dtype).requires_grad_()
        y = stage(x)
        works = [dist.isend(y.detach(), dst=rank + 1, group=group)] if rank < p - 1 else []
        return x, y, works

    result = check("07.stage_step", float32_buffer, ch07["backward_step"])
    # the receiving rank's own words, not the grader's "waited for each other for 60 s"
    _fails(result, "MessageMismatch", "got zeros: rank 0 refused its send", "torch.empty_like")


# ---- 07.split_backward ------------------------------------------------------------------


def test_split_backward_refuses_whole_backwards_lost_graphs_and_overwrites(ch07):
    b_in, w = ch07["backward_input"], ch07["backward_weight"]

    def everything_in_b(output, stage_input, grad_output):  # B that also fills the weights' .grad
        torch.autograd.backward(output, grad_output, retain_graph=True)
        return stage_input.grad

    def nothing_in_w(output, params, grad_output):  # W recomputes nothing: B was meant to do it all
        return None

    def graph_freed(output, stage_input, grad_output):
        return torch.autograd.grad(output, stage_input, grad_output)[0]

    def overwrites(output, params, grad_output):  # p.grad = g: the earlier micro-batches are lost
        for p, g in zip(params, torch.autograd.grad(output, params, grad_output, allow_unused=True)):
            if g is not None:
                p.grad = g

    def returns_instead_of_setting(output, params, grad_output):  # the gradients returned, .grad left empty
        return torch.autograd.grad(output, params, grad_output, allow_unused=True)

    def library_b(output, stage_input, grad_output):
        from ultrascale.parallel.pipeline_parallel import backward_input

        return backward_input(output, stage_input, grad_output)

    exercise = "07.split_backward"
    _fails(check(exercise, everything_in_b, w), "shares memory with its argument `stage_input.grad`")  # contract
    _fails(check(exercise, b_in, nothing_in_w), "have no gradient", "W must set their .grad")
    _fails(check(exercise, graph_freed, w), "the graph was freed", "retain_graph=True")
    _fails(check(exercise, b_in, overwrites), "last micro-batch alone", "*add* to .grad")
    _fails(check(exercise, b_in, returns_instead_of_setting), "have no gradient")
    _fails(check(exercise, library_b, w), "the course library's", "backward_input")
    assert check(exercise, b_in, w).status == PASS
