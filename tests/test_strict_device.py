"""Strict-device mode (runtime/strict_device.py): a CPU run fails where a GPU node would.

Each fault below is one a GPU node with one GPU per rank (NCCL) raises on, and each correct
idiom one it accepts; the mode must tell them apart on a CPU. The chapters and the graders run
in this mode in ``make test`` (tests/test_notebooks.py's papermill runs, the graded course).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ultrascale.runtime import Cluster, RankError


@pytest.fixture(scope="module")
def strict():
    with Cluster(2, strict_device=True) as c:
        yield c


def _raises(cluster, fn, *needles):
    with pytest.raises(RankError) as caught:
        cluster.run(fn)
    message = str(caught.value)
    assert "DeviceError" in message and "strict device" in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# ------------------------------------------------------------------ what a GPU node accepts
def _the_course_idiom(ctx):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g).to(ctx.device)  # seeded on the host, then moved
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).to(ctx.device)
    buf = torch.zeros(4, device=ctx.device)  # made on the device
    follows = torch.zeros_like(x) + x.new_ones(()) + torch.ones(1, device=x.device)
    loss = model(x + follows).square().mean()
    loss.backward()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)  # its step counters stay on the CPU
    opt.step()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    dist.all_reduce(buf)
    out = [torch.empty_like(buf) for _ in range(ctx.world_size)]
    dist.all_gather(out, buf)
    host = loss.detach().cpu()  # results back to the host: fine
    dev = torch.empty(4, device=ctx.device)
    dev.copy_(torch.arange(4.0))  # a copy across devices: fine
    return host.item() + dev.sum().item() + (x[torch.arange(2)].sum() * 0).item()


def test_the_course_idiom_runs(strict):
    a, b = strict.run(_the_course_idiom)
    assert a == b and a > 6


# ------------------------------------------------------------------ what a GPU node refuses
def test_a_tensor_made_without_a_device_in_a_collective(strict):
    def fault(ctx):
        t = torch.tensor([float(ctx.rank)])  # on the CPU on a GPU node
        dist.all_reduce(t)

    _raises(strict, fault, "dist.all_reduce at `fault` line", "made on the host at `fault` line")


def test_a_non_contiguous_tensor_in_a_collective(strict):  # gloo's own sends refuse one already
    def fault(ctx):
        t = torch.ones(3, 4, device=ctx.device).t()  # a view with swapped strides
        dist.all_reduce(t)

    _raises(strict, fault, "dist.all_reduce at `fault` line", "non-contiguous", "Tensors must be contiguous")


def test_a_model_left_unmoved(strict):
    def fault(ctx):
        model = torch.nn.Linear(4, 4)  # never .to(ctx.device)
        return model(torch.ones(2, 4, device=ctx.device)).sum().item()

    _raises(strict, fault, "mixes a tensor made on the host")


def test_data_left_on_the_host(strict):
    def fault(ctx):
        model = torch.nn.Linear(4, 4).to(ctx.device)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))  # not moved
        return model(x).sum().item()

    _raises(strict, fault, "torch.linear", "mixes a tensor made on the host")


def test_gradients_of_an_unmoved_model(strict):
    def fault(ctx):  # everything on the host, until NCCL sees it
        model = torch.nn.Linear(4, 4)
        model(torch.ones(2, 4)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)

    _raises(strict, fault, "dist.all_reduce")


def test_cpu_undoes_a_move(strict):
    def fault(ctx):
        t = torch.ones(4, device=ctx.device).cpu()
        dist.broadcast(t, 0)

    _raises(strict, fault, "dist.broadcast")


def test_point_to_point_and_imported_names(strict):
    def fault(ctx):
        from torch.distributed import P2POp, batch_isend_irecv

        peer = 1 - ctx.rank
        send, recv = torch.ones(3), torch.empty(3, device=ctx.device)
        for w in batch_isend_irecv([P2POp(dist.isend, send, peer), P2POp(dist.irecv, recv, peer)]):
            w.wait()

    _raises(strict, fault, "dist.batch_isend_irecv")


def test_a_buffer_in_a_library_style_helper(strict):
    def fault(ctx):
        def ring_buffer(like):
            return torch.zeros(like.numel())  # forgot device=like.device

        x = torch.ones(4, device=ctx.device)
        return (x + ring_buffer(x)).sum().item()

    _raises(strict, fault, "add at `fault` line", "made on the host at `ring_buffer` line")


def test_the_mode_is_what_catches_them():
    """The same fault passes on a plain CPU cluster: only the mode tells it from a GPU node."""
    with Cluster(2, strict_device=False) as plain:

        def fault(ctx):
            t = torch.tensor([1.0])
            dist.all_reduce(t)
            return t.item()

        assert plain.run(fault) == [2.0, 2.0]


def test_a_device_taken_from_a_tensor_follows_that_tensor(strict):
    """``device=x.device`` and ``.to(x)`` mean the host when x is on the host (as on a GPU
    node), and the device when x is there."""

    def follows(ctx):
        host = torch.ones(3)  # an unmoved model's weights, say
        assert (host + torch.ones(3).to(host.device)).sum() == 6  # all on the host: fine
        assert (host + torch.zeros(3, device=host.device)).sum() == 3
        assert (host + torch.ones(3).to(host)).sum() == 6
        dev = torch.ones(3, device=ctx.device)
        assert (dev + torch.zeros(3, device=dev.device)).sum() == 3  # all on the device: fine
        return True

    assert strict.run(follows) == [True, True]

    def fault(ctx):
        dev = torch.ones(3, device=ctx.device)
        host = torch.ones(3)
        return (dev + torch.zeros(3, device=host.device)).sum().item()

    _raises(strict, fault, "mixes a tensor made on the host at `fault` line")


def test_a_dtype_change_is_no_move(strict):
    """``model.to(torch.float64)`` (Module.to passes non_blocking=False by position) leaves the
    weights where they were: on the host."""

    def fault(ctx):
        model = torch.nn.Linear(4, 4).to(torch.float64)
        return model(torch.ones(2, 4, device=ctx.device, dtype=torch.float64)).sum().item()

    _raises(strict, fault, "mixes a tensor made on the host")


# ------------------------------------------------------------------ in a grader, as a learner would
def test_a_learner_buffer_left_on_the_host_fails_its_check_in_strict_mode(ch03, monkeypatch):
    """A ZeRO-1 step whose gradient slice is made without a device: right on a CPU (the plain
    grader passes it), a crash on a GPU node (NCCL's reduce-scatter gets a CPU tensor). In strict
    mode, as make test grades, it fails with the line to fix; the solution still passes."""
    from ultrascale_grading import FAIL, check
    from ultrascale.parallel import all_gather_into, reduce_scatter_into

    flatten_padded = ch03["flatten_padded"]

    def zero1_step(ctx, params, master, optimizer):
        n = ctx.world_size
        grads = flatten_padded([p.grad for p in params], n) / n
        grad_slice = torch.empty(master.numel(), dtype=grads.dtype)  # no device: the fault
        reduce_scatter_into(grad_slice, grads)
        master.grad = grad_slice.float()
        optimizer.step()
        full = torch.empty(master.numel() * n, dtype=params[0].dtype, device=params[0].device)
        all_gather_into(full, master.detach().to(full.dtype))
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(full[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    monkeypatch.setenv("ULTRASCALE_STRICT_DEVICE", "1")
    result = check("03.zero1_step", zero1_step, world_size=2, quick=True)
    assert result.status == FAIL and "strict device" in result.message, result
    assert "made on the host at `zero1_step` line" in result.message, result.message
    # (the solution passes in strict mode: the graded course, tests/conftest.py, grades it so)


# ------------------------------------------------------------------ device work timed on the device
# Issue 52 item 4: a CUDA call returns when its kernels are queued, so a clock read around device
# work without a synchronize times the launch. Every function of the course that reads a clock
# twice (a timed region) must wait for the device inside it, through one of these, or be listed
# below as timing host work only, with the reason. (Module-level cells are not scanned: the
# chapters time device work in functions, and a1 times a launch on purpose, to show the trap.)
CLOCK_READS = {"perf_counter", "perf_counter_ns", "time", "monotonic"}
DEVICE_WAITS = {"wait_for_device", "synchronize", "sync", "_sync_if_cuda", "elapsed_time", "do_bench"}
HOST_ONLY_FOLDERS = ("lib/ultrascale/runtime/", "launch/")  # processes and pipes, never tensors
HOST_ONLY = {
    "benchmarks/bench_kernels.py::wall_ms": "the interpreter's timer: on a GPU, timer() uses do_bench",
    "benchmarks/bench_runtime.py::spawn_per_call": "process starts",
    "benchmarks/bench_runtime.py::main": "cluster starts and calls",
    "benchmarks/bench_send_recv.py::exchanges": "gloo on host tensors (its Cluster is backend='gloo')",
    "chapters/01_one_gpu.py::fwd_bwd_seconds": "CPU autocast: the recomputation price on this CPU",
    "chapters/11_gpu_kernels.py::wall_ms": "CPU timings; on a GPU the chapter uses triton.testing",
    "chapters/11_gpu_kernels.py::strided_read_ms": "a host buffer's strided reads",
    "chapters/a0_collectives.py::example_barrier": "host sleeps around a barrier",
    "chapters/a1_profiling.py::time_async_all_reduce": "a gloo all-reduce's launch, measured on purpose",
    "lib/ultrascale/parallel/pipeline_parallel.py::_compute": "sleeps that stand in for compute",
}


def _timed_functions():
    import subprocess

    root = Path(__file__).resolve().parents[1]
    files = subprocess.run(
        ["git", "ls-files", "lib/*.py", "benchmarks/*.py", "chapters/*.py", "launch/*.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for path in files:
        if not path.startswith("lib/ultrascale_grading/"):  # the grader times no device
            yield from _timed_in(path, (root / path).read_text())


def _timed_in(path: str, source: str):
    """(path::function, line, waits for the device) of each function reading a clock twice."""
    import ast

    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nested = {
                id(n)
                for inner in ast.walk(fn)
                if inner is not fn and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                for n in ast.walk(inner)
            }
            called = [n.func for n in ast.walk(fn) if isinstance(n, ast.Call) and id(n) not in nested]
            clocks = [
                f
                for f in called
                if isinstance(f, ast.Attribute)
                and f.attr in CLOCK_READS
                and isinstance(f.value, ast.Name)
                and f.value.id == "time"
            ]
            if len(clocks) >= 2:
                names = {f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None) for f in called}
                yield f"{path}::{fn.name}", fn.lineno, bool(names & DEVICE_WAITS)


def test_the_timing_scan_tells_a_launch_from_the_work():
    """The scan below on planted code: a matmul timed bare is flagged, timed with a wait it is not."""
    bare = "import time\ndef step(x):\n    start = time.perf_counter()\n    x @ x\n    return time.perf_counter() - start\n"
    waited = bare.replace("    return", "    wait_for_device(x.device)\n    return")
    assert list(_timed_in("planted.py", bare)) == [("planted.py::step", 2, False)]
    assert list(_timed_in("planted.py", waited)) == [("planted.py::step", 2, True)]


def test_every_timed_region_waits_for_the_device():
    timed = list(_timed_functions())
    assert len(timed) > 20, f"the scan found only {len(timed)} timed functions: is it still looking?"
    unsynced = [
        f"{name} (line {line})"
        for name, line, waits in timed
        if not waits and name not in HOST_ONLY and not name.startswith(HOST_ONLY_FOLDERS)
    ]
    assert not unsynced, (
        "these read a clock around work that may run on a GPU without waiting for it "
        "(comm.logger.wait_for_device, torch.cuda.synchronize or CUDA events); if they "
        "time host work only, list them in HOST_ONLY with the reason: " + ", ".join(unsynced)
    )
    stale = set(HOST_ONLY) - {name for name, _, _ in timed}
    assert not stale, f"HOST_ONLY names functions that no longer time anything: {sorted(stale)}"


# ------------------------------------------------------------------ the technique tests
# Issue 52 items 2 and 6: each technique's parity tests run under a GPU node's rules in make test
# (conftest.py's ``strict_modes``: their shared clusters in both strict modes) and on the GPUs of
# a node in make test-gpu (the ``multigpu`` marker: launch/test_gpu.py runs ``-m "gpu or multigpu"``).
TECHNIQUE_TESTS = [
    "test_data_parallel.py",
    "test_zero.py",
    "test_zero_optimizer.py",
    "test_fp8_gather.py",
    "test_grad_sync.py",
    "test_tensor_parallel.py",
    "test_comm_functional.py",
    "test_expert_parallel.py",
    "test_pipeline_parallel.py",
    "test_compose.py",
    "test_compose_5d.py",
    "test_mesh.py",
    "test_async_tp.py",
    "test_context_parallel.py",
    "test_ulysses.py",
    "test_comm.py",
    "test_fsdp.py",
    "test_checkpoint.py",
]
TECHNIQUE_MARKS = {"pytest.mark.multigpu", "pytest.mark.usefixtures('strict_modes')"}


def _module_marks(source: str) -> set:
    """The marks a test file's ``pytestmark`` lists, as source text."""
    import ast

    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            items = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            return {ast.unparse(item) for item in items}
    return set()


def test_every_technique_test_file_runs_strict_and_on_gpus():
    from conftest import STRICT_MODES

    from ultrascale.runtime import strict_device, strict_p2p

    # the reader, on planted files: one mark alone, and none
    assert _module_marks("pytestmark = pytest.mark.multigpu\n") == {"pytest.mark.multigpu"}
    assert _module_marks("import pytest\n") == set()
    tests = Path(__file__).resolve().parent
    unmarked = {name: sorted(TECHNIQUE_MARKS - _module_marks((tests / name).read_text())) for name in TECHNIQUE_TESTS}
    unmarked = {name: missing for name, missing in unmarked.items() if missing}
    wanted = ", ".join(sorted(TECHNIQUE_MARKS))
    assert not unmarked, f"technique test files without pytestmark = [{wanted}]: {unmarked}"
    # the fixture turns on what the runtime reads
    assert set(STRICT_MODES) == {strict_device.ENV, strict_p2p.ENV}
