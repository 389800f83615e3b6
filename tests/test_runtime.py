"""The runtime: persistent ranks, results, state, output, logs, and every fault the
foundation issue lists (each fault is one test)."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ultrascale.runtime import CallTimeout, Cluster, RankError
from ultrascale.runtime.errors import Stopped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster():
    with Cluster(3) as c:
        yield c


def _all_reduce_rank(ctx):
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_results_in_rank_order_and_collectives_work(cluster):
    assert cluster.backend == "gloo"
    assert cluster.run(lambda ctx: (ctx.rank, ctx.world_size, str(ctx.device))) == [(r, 3, "cpu") for r in range(3)]
    assert cluster.run(_all_reduce_rank) == [6.0, 6.0, 6.0]


def test_new_ranks_need_not_import_what_an_optimizer_imports():
    """The fork server preloads torch._dynamo (forkserver.PRELOAD): torch.optim imports it with a
    process's first optimizer, about 2 s of CPU that every rank would otherwise pay again."""

    def first_look(ctx):
        already = "torch._dynamo" in sys.modules  # before this rank has made anything
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        return already, "torch._dynamo" in sys.modules

    with Cluster(2) as fresh:
        assert fresh.run(first_look) == [(True, True)] * 2


def test_ranks_collect_garbage_but_never_walk_torchs_objects():
    """The fork server imports with the collector paused, then freezes what it imported
    (runtime/collector.py): a rank must come out with the collector on (a rank whose collector
    stayed off would never free a reference cycle), torch's objects frozen, and a cycle the rank
    itself makes still freed."""

    def collector_state(ctx):
        import gc
        import weakref

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        return gc.isenabled(), gc.get_freeze_count(), gone() is None

    with Cluster(2) as fresh:
        for enabled, frozen, freed in fresh.run(collector_state):
            assert enabled and freed
            assert frozen > 100_000, f"only {frozen} objects frozen: the fork server's imports were not"


def test_importing_the_runtime_leaves_the_callers_collector_as_it_was():
    for state in ("gc.enable()", "gc.disable()"):
        code = (
            f"import gc; {state}; before = gc.isenabled(); import ultrascale.runtime; "
            "assert gc.isenabled() == before, (before, gc.isenabled()); print('ok')"
        )
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, ULTRASCALE_EAGER_FORKSERVER="0"),
        )
        assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_state_persists_across_calls(cluster):
    cluster.run(lambda ctx: ctx.state.__setitem__("x", torch.full((2,), float(ctx.rank))))
    got = cluster.run(lambda ctx: ctx.state["x"].sum().item())
    assert got == [0.0, 2.0, 4.0]


def test_closure_args_kwargs_and_subset(cluster):
    scale = 10  # captured by the lambda: cloudpickle ships it by value
    assert cluster.run(lambda ctx, a, b=0: ctx.rank * scale + a + b, 1, b=2) == [3, 13, 23]
    assert cluster.run(lambda ctx: ctx.rank, ranks=[2, 0]) == [0, 2]
    with pytest.raises(ValueError, match="subset"):
        cluster.run(lambda ctx: 0, ranks=[5])


def test_output_is_prefixed_by_rank_in_rank_order(cluster, capsys):
    def talk(ctx):
        time.sleep(0.05 * (2 - ctx.rank))  # finish in reverse order on purpose
        print(f"hello from {ctx.rank}\nsecond line")

    cluster.run(talk)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "[rank 0] hello from 0",
        "[rank 0] second line",
        "[rank 1] hello from 1",
        "[rank 1] second line",
        "[rank 2] hello from 2",
        "[rank 2] second line",
    ]


def test_logs_stream_while_the_call_runs(cluster):
    seen = []

    def train(ctx):
        for step in range(5):
            ctx.log(step=step, loss=torch.tensor(1.0 / (step + 1)))
            time.sleep(0.05)
        return time.time()

    ends = cluster.run(train, on_log=lambda rank, m: seen.append((time.time(), rank, m)))
    assert len(seen) == 15
    assert {m["step"] for _, _, m in seen} == set(range(5))
    assert isinstance(seen[0][2]["loss"], float)
    # the first metrics arrived well before the ranks finished: they were streamed
    assert seen[0][0] < min(ends) - 0.1


def test_exception_on_some_ranks_reports_each_traceback_and_cluster_survives(cluster):
    cluster.run(lambda ctx: ctx.state.__setitem__("kept", ctx.rank))

    def fail_odd(ctx):
        if ctx.rank % 2 == 1:
            raise ValueError(f"bad input on rank {ctx.rank}")
        return "ok"

    with pytest.raises(RankError) as info:
        cluster.run(fail_odd)
    err = info.value
    assert set(err.failures) == {1}
    assert err.failures[1].type_name == "ValueError"
    assert isinstance(err.failures[1].exception, ValueError)
    assert "fail_odd" in str(err) and "bad input on rank 1" in str(err)
    assert "worker.py" not in str(err)  # the runtime's own frames are hidden
    # same processes, state intact, collectives still fine
    assert cluster.run(lambda ctx: ctx.state["kept"]) == [0, 1, 2]
    assert cluster.run(_all_reduce_rank) == [6.0, 6.0, 6.0]


def test_exception_before_a_collective_does_not_hang_the_others(cluster):
    def fail_then_reduce(ctx):
        if ctx.rank == 0:
            raise RuntimeError("rank 0 gives up")
        return _all_reduce_rank(ctx)  # ranks 1, 2 wait for rank 0 forever

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        cluster.run(fail_then_reduce, timeout=60)
    assert time.monotonic() - start < cluster.grace + 5
    assert set(info.value.failures) == {0}
    assert set(info.value.stuck) == {1, 2}
    assert "all_reduce" in info.value.stuck[1]
    assert cluster.run(_all_reduce_rank) == [6.0, 6.0, 6.0]  # restarted, usable


def test_hang_raises_with_every_stack_then_rebuilds_the_group(cluster):
    def mismatched(ctx):
        if ctx.rank == 0:
            dist.broadcast(torch.zeros(1), src=0)
        else:
            dist.all_reduce(torch.zeros(1))

    start = time.monotonic()
    with pytest.raises(CallTimeout) as info:
        cluster.run(mismatched, timeout=2)
    elapsed = time.monotonic() - start
    assert 2 <= elapsed < 8
    stuck = info.value.stuck
    assert set(stuck) == {0, 1, 2}
    assert "broadcast" in stuck[0] and "all_reduce" in stuck[1] and "all_reduce" in stuck[2]
    assert "mismatched" in stuck[0]
    old = cluster.pids
    assert cluster.run(_all_reduce_rank) == [6.0, 6.0, 6.0]
    assert cluster.pids != old


def _press_stop_after(seconds):
    """What Jupyter's stop button does: SIGINT to the kernel, whose handler raises
    KeyboardInterrupt in the main thread."""
    main = threading.main_thread().ident
    threading.Timer(seconds, lambda: signal.pthread_kill(main, signal.SIGINT)).start()


@pytest.fixture
def sigint_raises():
    # Earlier tests (papermill, jupyter_client) may leave another SIGINT handler
    # installed; a kernel has Python's default one, which raises KeyboardInterrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("where", ["python_loop", "blocked_in_c"])
def test_stop_button_returns_quickly_and_no_stale_result(cluster, where, sigint_raises):
    def busy(ctx, mode):
        if mode == "python_loop":
            while True:
                sum(range(1000))
        time.sleep(60)  # blocked in C: only a kill stops it

    _press_stop_after(0.5)
    start = time.monotonic()
    with pytest.raises(Stopped) as stopped:  # a KeyboardInterrupt, with one line to show
        cluster.run(busy, where, timeout=20)
    # 0.5 s before the press and about 1 s to stop on an idle machine; 4.3 s was seen beside the suite's
    # other worker (a fresh clone's make test). The bound is what "quickly" must mean on a busy machine:
    # far from the call's 20 s timeout and the ranks' 60 s sleep.
    assert time.monotonic() - start < 10
    line = str(stopped.value)
    assert "\n" not in line and line.startswith("`busy` stopped: ")
    if where == "blocked_in_c":  # only a kill stops it: the ranks restart, and the line says so
        assert "start afresh on the next call" in line and "blocked outside Python" in line
    else:  # stopped in Python before any collective: the ranks live on
        assert "keep their state" in line
    # the next call gets its own result, never the interrupted call's
    assert cluster.run(lambda ctx: ("fresh", ctx.rank)) == [("fresh", r) for r in range(3)]


def test_a_rank_that_dies_is_reported_and_replaced(cluster):
    def die(ctx):
        if ctx.rank == 2:
            os._exit(7)
        return "alive"

    with pytest.raises(RankError) as info:
        cluster.run(die, timeout=30)
    assert info.value.failures[2].type_name == "died"
    assert "code 7" in str(info.value)
    assert cluster.run(_all_reduce_rank) == [6.0, 6.0, 6.0]


def test_two_clusters_at_once_and_reruns_never_clash_on_ports():
    with Cluster(2) as a, Cluster(3) as b:
        assert a.run(_all_reduce_rank) == [3.0, 3.0]
        assert b.run(_all_reduce_rank) == [6.0, 6.0, 6.0]
    for _ in range(3):  # a re-run cell creates a new cluster each time
        c = Cluster(2)
        assert c.run(_all_reduce_rank) == [3.0, 3.0]
        c.close()
        assert not c.alive


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True, None])
def test_bad_world_size_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        Cluster(bad)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        Cluster(2, backend="mpi")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_nccl_without_gpus_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs one GPU per rank.*backend='gloo'"):
        Cluster(2, backend="nccl")


def test_killed_kernel_leaves_no_orphan_ranks(tmp_path):
    """Nor its fork server (torch loaded: the largest part of what a chapter's kernel leaves,
    issue 54), nor multiprocessing's resource tracker."""
    script = tmp_path / "kernel.py"
    script.write_text(
        textwrap.dedent("""
        import sys, time
        import multiprocessing.forkserver as fs, multiprocessing.resource_tracker as rt
        from ultrascale.runtime import Cluster
        if __name__ == "__main__":
            c = Cluster(3)
            print(" ".join(map(str, c.pids)), flush=True)
            print(fs._forkserver._forkserver_pid, rt._resource_tracker._pid, flush=True)
            time.sleep(600)
    """)
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    helpers = [int(p) for p in proc.stdout.readline().split() if p != "None"]
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    assert helpers and all(_alive(p) for p in helpers), helpers  # the fork server at least
    proc.kill()  # like the kernel dying: no atexit, no cleanup code runs
    proc.wait()
    deadline = time.monotonic() + 30  # a bound for a loaded machine; the loop ends when they are gone
    while any(_alive(p) for p in pids + helpers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "orphan ranks survived the kernel"
    assert not any(_alive(p) for p in helpers), "the fork server (or resource tracker) survived the kernel"


def test_a_script_without_main_guard_works_like_a_notebook(tmp_path):
    """Ranks never re-run the caller's script, so no `if __name__ == "__main__"` is needed,
    and classes defined in it travel both ways."""
    script = tmp_path / "experiment.py"
    script.write_text(
        textwrap.dedent("""
        from ultrascale.runtime import Cluster
        class Box:
            def __init__(self, v):
                self.v = v
        cluster = Cluster(2)
        print([b.v for b in cluster.run(lambda ctx, box: Box(box.v * (ctx.rank + 1)), Box(5))])
        cluster.close()
    """)
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[5, 10]"]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; it only waits to be reaped
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_cell_magic_runs_on_all_ranks_and_subsets(cluster, capsys):
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    from ultrascale.runtime import current_cluster
    from ultrascale.runtime.magic import register

    register(shell, current_cluster)
    shell.user_ns["cl"] = cluster
    shell.run_cell_magic("ranks", "-c cl", "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nt.item()")
    out = capsys.readouterr().out
    assert out.splitlines() == [f"[rank {r}] Out: 6.0" for r in range(3)]
    # the namespace persists per rank; a subset runs only there
    shell.run_cell_magic("ranks", "-c cl -r 0,2", "t.item() * 10 + rank")
    assert capsys.readouterr().out.splitlines() == ["[rank 0] Out: 60.0", "[rank 2] Out: 62.0"]


def test_same_function_runs_under_torchrun(tmp_path):
    out = tmp_path / "res.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "ultrascale.runtime.torchrun",
        "ultrascale.runtime.examples:all_reduce_demo",
        "[4]",
        "--out",
        str(out),
    ]
    done = subprocess.run(
        cmd,
        check=True,
        cwd=ROOT,
        timeout=120,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert json.loads(out.read_text())["results"] == [[3.0] * 4, [3.0] * 4]
    # the log says which backend the ranks got, and why the CPU where it is the CPU (issue 54)
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    said = re.findall(
        r"^ultrascale\.runtime\.torchrun: 2 ranks on 1 node\(s\), backend (\w+), (.*)$", done.stdout, re.MULTILINE
    )
    assert len(said) == 1 and said[0][0] == backend, done.stdout
    if torch.version.cuda is None:
        assert "is a CPU build" in said[0][1], said


def test_same_function_runs_on_a_cluster():
    from ultrascale.runtime.examples import all_reduce_demo

    with Cluster(2) as c:
        assert [t.tolist() for t in c.run(all_reduce_demo, 4)] == [[3.0] * 4, [3.0] * 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_works_after_the_notebook_initialised_cuda():
    torch.ones(1, device="cuda")  # what breaks fork-based launchers
    with Cluster(1) as c:
        assert c.backend == "nccl"
        assert c.run(lambda ctx: str(ctx.device)) == ["cuda:0"]


# ---- clear errors for the smaller slips of issue 11 ----------------------------------------


def test_run_refuses_what_is_not_a_function_before_the_ranks_see_it(cluster):
    pids = cluster.pids
    with pytest.raises(TypeError, match="needs a function to run on the ranks.*got int 42"):
        cluster.run(42)
    with pytest.raises(ValueError, match="timeout must be a number of seconds above 0"):
        cluster.run(lambda ctx: 0, timeout=0)
    assert cluster.pids == pids and cluster.run(lambda ctx: ctx.rank) == [0, 1, 2]


@pytest.mark.parametrize(
    "kwargs, complaint",
    [
        ({"timeout": -1}, "timeout must be a number of seconds above 0"),
        ({"timeout": float("nan")}, "timeout must be"),
        ({"grace": -0.5}, "grace must be a number of seconds at least 0"),
        ({"threads": 0}, "threads must be a positive integer"),
    ],
)
def test_bad_cluster_options_are_clear_errors(kwargs, complaint):
    with pytest.raises(ValueError, match=complaint):
        Cluster(2, **kwargs)


def test_numpy_integers_are_world_sizes():
    np = pytest.importorskip("numpy")
    with Cluster(np.int64(2)) as c:
        assert c.world_size == 2 and type(c.world_size) is int
        assert c.run(_all_reduce_rank) == [3.0, 3.0]


def test_a_closed_cluster_starts_again_on_the_next_run(capsys):
    """Issue 54: a chapter's last cell closes its cluster, and a learner then re-runs an earlier
    cell. The ranks start again with one line that says ctx.state is lost, and a collective works
    (a fresh process group); the closed cluster held no rank in between."""
    from ultrascale.runtime import current_cluster

    c = Cluster(2)
    try:
        before = c.pids
        assert c.run(lambda ctx: ctx.state.setdefault("kept", ctx.rank + 10)) == [10, 11]
        c.close()
        assert not c.alive and "closed" in repr(c)
        assert current_cluster() is c  # a %%ranks cell re-run after the close reopens it too
        capsys.readouterr()
        assert c.run(_all_reduce_rank) == [3.0, 3.0]
        notice = capsys.readouterr().out
        assert notice.count("\n") == 1 and "was closed" in notice and "ctx.state starts empty" in notice, notice
        assert c.alive and c.pids != before and "running" in repr(c)
        assert c.run(lambda ctx: ctx.state.get("kept")) == [None, None]  # the state the notice named
        assert capsys.readouterr().out == ""  # only the first run after the close says it
    finally:
        c.close()


def test_a_result_the_notebook_cannot_unpickle_names_its_rank(cluster):
    def explode():
        raise ValueError("cannot rebuild this object here")

    class Bomb:  # pickles fine on the rank, fails to unpickle in the notebook
        def __reduce__(self):
            return explode, ()

    with pytest.raises(RankError) as info:
        cluster.run(lambda ctx: Bomb() if ctx.rank == 1 else ctx.rank)
    assert set(info.value.failures) == {1}
    assert "rank 1 returned a result the notebook cannot unpickle" in str(info.value)
    assert "cannot rebuild this object here" in str(info.value)
    assert cluster.run(lambda ctx: ctx.rank) == [0, 1, 2]


def test_a_dead_rank_is_counted_once_not_with_its_peers():
    def die_in_a_collective(ctx):
        if ctx.rank == 2:
            os._exit(3)
        return _all_reduce_rank(ctx)

    with Cluster(4) as c:
        with pytest.raises(RankError) as info:
            c.run(die_in_a_collective, timeout=60)
        assert str(info.value).startswith("1 of 4 ranks failed in `die_in_a_collective` (rank 2 died)")
        assert info.value.failures[2].type_name == "died"
        assert c.run(_all_reduce_rank) == [10.0] * 4


def test_a_stop_shows_one_line_in_a_notebook_and_percent_tb_the_rest(capsys):
    """What the learner sees after the stop button: ``Stopped``'s line, not the runtime's frames."""
    from IPython.core.interactiveshell import InteractiveShell

    from ultrascale.runtime import magic

    shell = InteractiveShell.instance()
    try:
        magic.register(shell, lambda: None)
        result = shell.run_cell(
            "from ultrascale.runtime.errors import Stopped\n"
            "def deep():\n    raise Stopped('`train` stopped: all ranks restart')\ndeep()"
        )
        err = capsys.readouterr().err
        assert not result.success and isinstance(result.error_in_exec, Stopped)
        assert err.strip().splitlines() == [
            "Stopped: `train` stopped: all ranks restart  (%tb shows the full traceback)"
        ]
        shell.run_line_magic("tb", "")
        shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # without the colours
        assert "Traceback" in shown and "----> 4 deep()" in shown  # the whole traceback, on request
    finally:
        shell.set_custom_exc((), None)
        InteractiveShell.clear_instance()


def test_idle_ranks_give_their_memory_back_and_return_on_the_next_call(capsys):
    """After ``idle_release`` seconds without a call the ranks are killed (the fork server stays);
    the next call starts them again, says so, and computes as before."""
    with Cluster(2, idle_release=0.5) as idle:
        first = idle.pids
        assert idle.run(lambda ctx: ctx.rank + 1) == [1, 2]
        deadline = time.monotonic() + 10
        while idle.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not idle.alive and "idle" in repr(idle)
        assert all(not os.path.exists(f"/proc/{pid}") or _is_zombie(pid) for pid in first)
        capsys.readouterr()
        assert idle.run(_all_reduce_rank) == [3.0, 3.0]  # a fresh process group works
        assert "had been idle" in capsys.readouterr().out and idle.alive and idle.pids != first


def test_the_fork_server_goes_when_no_cluster_has_ranks(tmp_path):
    """The fork server holds torch, imported: about 200 MB of its own once no rank shares its
    pages (issue 54). It goes with the last idle cluster's ranks, and after a close, and the next
    call brings it back. In a process of its own: this module's cluster keeps ranks."""
    script = tmp_path / "idle.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, time
        import multiprocessing.forkserver as fs
        from ultrascale.runtime import Cluster

        def server_gone(pid, seconds=30):   # a bound for a loaded machine; returns once it is gone
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if fs._forkserver._forkserver_pid is None and not os.path.exists(f"/proc/{pid}"):
                    return True
                time.sleep(0.05)
            return False

        if __name__ == "__main__":
            kept = Cluster(1, idle_release=float("inf"))   # ranks that never go keep the server
            idle = Cluster(2, idle_release=0.3)
            idle.run(lambda ctx: 0)
            first = fs._forkserver._forkserver_pid
            kept_it = not server_gone(first, seconds=2)
            kept.close()   # (its own release never comes: idle_release=inf)
            idle.run(lambda ctx: 0)   # the idle timer starts again, with no other cluster's ranks
            idle_gone = server_gone(first)
            again = idle.run(lambda ctx: ctx.rank + 1)   # a new server, new ranks
            second = fs._forkserver._forkserver_pid
            idle.close()
            closed_gone = server_gone(second)
            print(json.dumps([kept_it, idle_gone, again, second not in (None, first), closed_gone]))
    """)
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    kept_it, idle_gone, again, restarted, closed_gone = json.loads(done.stdout.splitlines()[-1])
    assert kept_it, "the fork server went while another cluster still had ranks"
    assert idle_gone, "the fork server stayed after the last ranks were released"
    assert again == [1, 2] and restarted, (again, restarted)
    assert closed_gone, "the fork server stayed after the last cluster was closed"


def test_a_busy_cluster_is_not_released():
    with Cluster(2, idle_release=0.3) as busy:
        assert busy.run(lambda ctx: time.sleep(1.0) or ctx.rank) == [0, 1]  # longer than idle_release
        assert busy.alive  # the timer counts from the end of a call, not from its start


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_what_a_cluster_says_about_the_gpus_it_does_not_use():
    from ultrascale.runtime.cluster import gpu_notice

    assert gpu_notice("gloo", 4, gpus=0) is None  # a laptop: nothing to say
    assert gpu_notice("nccl", 4, gpus=8) is None  # one GPU per rank: as expected
    fewer = gpu_notice("gloo", 4, gpus=2)
    assert "2 GPU(s) for 4 ranks" in fewer and "CPU with gloo" in fewer and "Cluster(2)" in fewer
    assert "asked for" in gpu_notice("gloo", 2, gpus=8)


def test_torchrun_refuses_more_ranks_on_a_node_than_gpus():
    from ultrascale.runtime.torchrun import rank_device

    assert rank_device("gloo", 5, gpus=0) == torch.device("cpu")
    assert rank_device("nccl", 3, gpus=4) == torch.device("cuda", 3)
    with pytest.raises(RuntimeError, match=r"local rank 4 has no GPU.*4 GPU\(s\).*--nproc_per_node=4"):
        rank_device("nccl", 4, gpus=4)
