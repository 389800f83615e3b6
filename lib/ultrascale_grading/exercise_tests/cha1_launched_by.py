"""Tests of the A1 exercise on reading a trace's kernel launches (solutions/a1_profiling_exercises.ipynb);
the other A1 exercises are tested in ``cha1.py``.

* ``a1.launched_by``: ``launched_by(events)`` lists, for every GPU kernel of a Chrome trace
  in order of start, the CPU operator that launched it. Graded on hand-made traces with
  two threads, nested operators, kernels without a launch, copies that are not kernels, two
  processes sharing a thread id, launches exactly on an operator's edge; on random traces; on
  a real CPU profile (no kernels); and on a real GPU profile when there is a GPU.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch

from ultrascale_grading import exercise
from ultrascale_grading.guards import call_learner


# ---- a1.launched_by --------------------------------------------------------------------


def reference_launched_by(events, *, own_process=True, edges_inside=True):
    """The answer; ``own_process=False`` or ``edges_inside=False`` give two classic mistakes (for
    recognising them): operators of any process on the launch's thread id, and ``<`` for ``<=``."""
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    launches = {}
    for e in events:
        corr = e.get("args", {}).get("correlation")
        if e.get("ph") == "X" and e.get("cat") != "kernel" and corr is not None:
            launches.setdefault(corr, e)
    out = []
    for kernel in sorted(kernels, key=lambda e: e["ts"]):  # sorted() keeps ties in list order
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        op = None
        if launch is not None:
            around = [
                o
                for o in ops
                if (o["pid"] == launch["pid"] or not own_process)
                and o["tid"] == launch["tid"]
                and (
                    o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]
                    if edges_inside
                    else o["ts"] < launch["ts"] < o["ts"] + o["dur"]
                )
            ]
            if around:
                op = min(around, key=lambda o: o["dur"])["name"]
        out.append((kernel["name"], op))
    return out


def complete_event(name, cat, ts, dur, pid=1, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def hand_made_trace():
    """Two CPU threads at overlapping times, nested operators, and a few traps."""
    return [
        complete_event("aten::linear", "cpu_op", 0, 100, tid=1),
        complete_event("aten::addmm", "cpu_op", 10, 80, tid=1),
        complete_event("cudaLaunchKernel", "cuda_runtime", 20, 5, tid=1, correlation=11),
        complete_event("aten::t", "cpu_op", 21, 3, tid=1),  # the innermost operator at 22 on thread 1, not thread 2
        complete_event("aten::softmax", "cpu_op", 15, 50, tid=2),
        complete_event("aten::_softmax", "cpu_op", 18, 40, tid=2),
        complete_event("cudaLaunchKernel", "cuda_runtime", 22, 4, tid=2, correlation=12),  # during thread 1's addmm
        complete_event("aten::copy_", "cpu_op", 120, 30, tid=1),
        complete_event("cudaMemcpyAsync", "cuda_runtime", 125, 5, tid=1, correlation=13),
        complete_event(
            "Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 140, 9, pid=0, tid=7, correlation=13
        ),  # not a kernel
        complete_event("cudaLaunchKernel", "cuda_runtime", 200, 3, tid=1, correlation=14),  # outside any operator
        # kernels, listed out of order; one without any launch in the trace
        complete_event("softmax_warp_forward", "kernel", 60, 12, pid=0, tid=7, correlation=12),
        complete_event("sm90_xmma_gemm_f32", "kernel", 30, 40, pid=0, tid=7, correlation=11),
        complete_event("lonely_kernel", "kernel", 80, 2, pid=0, tid=8, correlation=99),
        complete_event("elementwise_kernel", "kernel", 210, 1, pid=0, tid=7, correlation=14),
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 11, "pid": 1, "tid": 1, "ts": 20},  # flow arrows
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 11, "pid": 0, "tid": 7, "ts": 30, "bp": "e"},
        {
            "ph": "i",
            "cat": "cpu_instant_event",
            "name": "[memory]",
            "pid": 1,
            "tid": 1,
            "ts": 21,
            "args": {"Bytes": 64},
        },
    ]


HAND_MADE_EXPECTED = [
    ("sm90_xmma_gemm_f32", "aten::addmm"),
    ("softmax_warp_forward", "aten::_softmax"),
    ("lonely_kernel", None),
    ("elementwise_kernel", None),
]


def two_processes_trace():
    """Two processes whose threads share the id 1 (thread ids repeat across processes), and
    launches exactly at an operator's start and end (inside it: the clock's resolution)."""
    return [
        complete_event("aten::matmul", "cpu_op", 0, 100, pid=1),
        complete_event("aten::mm", "cpu_op", 10, 30, pid=1),
        complete_event("cudaLaunchKernel", "cuda_runtime", 10, 2, pid=1, correlation=21),  # at aten::mm's start
        complete_event("cudaLaunchKernel", "cuda_runtime", 40, 2, pid=1, correlation=22),  # at aten::mm's end
        complete_event("aten::add", "cpu_op", 50, 20, pid=2),  # process 2, same tid
        complete_event("cudaLaunchKernel", "cuda_runtime", 60, 2, pid=1, correlation=23),  # process 1: aten::matmul
        complete_event("aten::relu", "cpu_op", 200, 10, pid=2),
        complete_event("cudaLaunchKernel", "cuda_runtime", 205, 2, pid=1, correlation=24),  # no operator of process 1
        complete_event("aten::cat", "cpu_op", 290, 50, pid=2),
        complete_event("aten::view", "cpu_op", 295, 10, pid=1),
        complete_event("cudaLaunchKernel", "cuda_runtime", 300, 2, pid=2, correlation=25),  # process 2's own aten::cat
        complete_event("gemm_at_start", "kernel", 15, 5, pid=0, tid=7, correlation=21),
        complete_event("gemm_at_end", "kernel", 45, 5, pid=0, tid=7, correlation=22),
        complete_event("add_kernel", "kernel", 65, 3, pid=0, tid=7, correlation=23),
        complete_event("relu_kernel", "kernel", 210, 3, pid=0, tid=7, correlation=24),
        complete_event("cat_kernel", "kernel", 310, 3, pid=3, tid=7, correlation=25),
    ]


TWO_PROCESSES_EXPECTED = [
    ("gemm_at_start", "aten::mm"),
    ("gemm_at_end", "aten::mm"),
    ("add_kernel", "aten::matmul"),
    ("relu_kernel", None),
    ("cat_kernel", "aten::cat"),
]


def random_trace(seed: int):
    """Random nested operators on two threads of one process, launches inside them, kernels."""
    rng = random.Random(seed)
    events, corr = [], 0

    def ops(tid, start, end, depth):
        nonlocal corr
        t = start
        while t < end - 4:
            dur = rng.randint(2, max(2, (end - t) // 2))
            name = f"aten::op{depth}_{rng.randint(0, 99)}"
            events.append(complete_event(name, "cpu_op", t, dur, tid=tid))
            if depth < 3 and dur > 8:
                ops(tid, t + 1, t + dur - 1, depth + 1)
            if rng.random() < 0.7:
                corr += 1
                launch_ts = t + rng.randint(0, dur - 1) + 0.5  # never on an operator's edge
                events.append(
                    complete_event("cudaLaunchKernel", "cuda_runtime", launch_ts, 1, tid=tid, correlation=corr)
                )
                events.append(
                    complete_event(
                        f"kernel_{corr}",
                        "kernel",
                        launch_ts + rng.randint(1, 50),
                        rng.randint(1, 9),
                        pid=0,
                        tid=7,
                        correlation=corr,
                    )
                )
            t += dur + rng.randint(1, 5)

    ops(1, 0, 400, 0)
    ops(2, 3, 390, 0)
    rng.shuffle(events)
    return events


def _profiled_layer_norm_events(device: str):
    from ultrascale.profiling import chrome_trace_events, quiet_native_stderr

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    x = torch.randn(256, 256, device=device)
    with quiet_native_stderr(), torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            torch.nn.functional.layer_norm(x, x.shape[1:])
        if device == "cuda":
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return chrome_trace_events(path)


def _check_launched_by(launched_by, events, expected, what):
    got = call_learner(launched_by, events, call=f"launched_by(<{what}>)", expected=str(expected))
    assert got is not None, f"launched_by(<{what}>) returned None: return a list of (kernel, operator) pairs"
    got = [tuple(pair) for pair in got]
    if got == expected:
        return
    hint = ""
    if len(got) != len(expected):
        hint = (
            f" It has {len(got)} pairs for {len(expected)} kernels: one pair per event with cat 'kernel' "
            "(memory copies are not kernels), also for kernels whose launch is missing (operator None)."
        )
    elif [k for k, _ in got] != [k for k, _ in expected]:
        hint = " The kernels are in the wrong order: sort them by their start time ts."
    else:
        for i, ((kernel, op), (_, right)) in enumerate(zip(got, expected)):
            if op != right:
                hint = (
                    f" For {kernel} you named {op!r}, expected {right!r}: look only at operators on the "
                    "launch's own process and thread (pid and tid) that were running at the launch's start, "
                    "and take the innermost (shortest) one; None when there is no launch or no operator."
                    + _operator_hint(events, i, op)
                )
                break
    raise AssertionError(f"launched_by(<{what}>): expected {expected}, got {got}.{hint}")


def _operator_hint(events, i, op) -> str:
    """Name the mistake when the i-th kernel's operator ``op`` is what a classic mistake gives."""
    if op == reference_launched_by(events, own_process=False)[i][1]:
        return (
            " Yours belongs to another process: thread ids repeat across processes, so match the pid as well "
            "as the tid."
        )
    if op == reference_launched_by(events, edges_inside=False)[i][1]:
        return (
            " The launch starts exactly at that operator's start or end, which counts as inside it: "
            "op ts <= launch ts <= op ts + dur, with <= on both sides."
        )
    return ""


@exercise("a1.launched_by", points=1)
def test_launched_by(launched_by, quick: bool = True):
    """Hand-made and random traces, then real profiles (CPU: no kernels; GPU: layer_norm)."""
    events = hand_made_trace()
    assert reference_launched_by(events) == HAND_MADE_EXPECTED  # the test's own reference
    _check_launched_by(launched_by, events, HAND_MADE_EXPECTED, "a hand-made trace with two threads")
    events = two_processes_trace()
    assert reference_launched_by(events) == TWO_PROCESSES_EXPECTED
    _check_launched_by(launched_by, events, TWO_PROCESSES_EXPECTED, "a hand-made trace with two processes")
    for seed in range(5 if quick else 30):
        events = random_trace(seed)
        _check_launched_by(launched_by, events, reference_launched_by(events), f"random trace {seed}")
    cpu_events = _profiled_layer_norm_events("cpu")
    _check_launched_by(launched_by, cpu_events, [], "a CPU profile of layer_norm, which has no kernels")
    if torch.cuda.is_available():
        gpu_events = _profiled_layer_norm_events("cuda")
        expected = reference_launched_by(gpu_events)
        assert any("layer_norm" in k and op == "aten::native_layer_norm" for k, op in expected), expected
        _check_launched_by(launched_by, gpu_events, expected, "a GPU profile of layer_norm")
