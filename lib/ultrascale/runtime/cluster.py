"""The notebook side of the runtime: :class:`Cluster`, a set of persistent ranks.

Why persistent ranks? Starting processes and a process group for every cell (as
``torch.multiprocessing.spawn`` or ``accelerate.notebook_launcher`` do) costs
seconds per call and loses every rank's state in between. Here the ranks are
started once, from a fork server that has torch already imported, and each call
only ships a pickled function over a pipe: about a millisecond.

A call ends in one of four ways, and the cluster stays usable after each:
  * every rank returns   -> the list of per-rank results;
  * some ranks raise     -> :class:`RankError` with each failing rank's traceback
                            (ranks still blocked in a collective after a short
                            grace period are reported with their stacks and restarted);
  * the timeout passes   -> :class:`CallTimeout` with every rank's current stack;
                            the ranks are restarted, which rebuilds the process group;
  * the stop button      -> the ranks are interrupted, Stopped (a KeyboardInterrupt) comes back
                            within about a second, stale results are dropped (job ids).
After a failure or a stop, the ranks are restarted on the next call if the call had
used a process group (see ``call.py``: nothing it left unmatched may pair with a later
call's), and keep their ``ctx.state`` otherwise; the message says which.

``close()`` lets the ranks go, but the Cluster stays usable: a chapter's last cell closes it
(its memory goes back), and a learner who then re-runs an earlier cell, the most common thing
one does in a notebook, gets the ranks started again with a one-line notice that their
``ctx.state`` is empty, not a traceback ending in "closed".
"""

from __future__ import annotations

import atexit
import math
import numbers
import operator
import os
import sys
import threading
import time
import weakref

import cloudpickle
import torch
import torch.distributed as dist

from .call import Call
from .forkserver import mp_context, no_main_reimport, stop_fork_server
from .pipe import read_message
from .stop_button import counting_presses
from .strict_device import enabled_by_env
from .strict_p2p import DEFAULT_TIMEOUT as DEFAULT_P2P_TIMEOUT, timeout_from_env
from .worker import worker_main

# Ranks idle this long give their memory back: they are killed, and so is the fork server once
# no cluster of the kernel has ranks left (it holds torch, imported: about 200 MB of its own).
# The next call starts both again, in a few seconds. Five open chapters would otherwise hold
# about 0.8 GB each until their kernels are shut down; a closed cluster lets the server go
# after the same time.
IDLE_RELEASE_S = float(os.environ.get("ULTRASCALE_IDLE_MINUTES", "10")) * 60

_LIVE_CLUSTERS: "weakref.WeakSet[Cluster]" = weakref.WeakSet()
_EVERY_CLUSTER: "weakref.WeakSet[Cluster]" = weakref.WeakSet()  # closed and starting ones too
# Held while ranks start (from their fork and until they are ready), and while the fork server
# is stopped: a server stopped under a starting cluster would take its new ranks with it.
_SERVER_LOCK = threading.Lock()
_CURRENT: list = []  # the most recently started cluster, used by the %%ranks magic


def resolve_backend(backend: str, world_size: int) -> str:
    """Turn ``"auto"`` into gloo or nccl and refuse impossible requests clearly."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}: use 'auto', 'gloo' or 'nccl'")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and (gpus < world_size or not dist.is_nccl_available()):
        raise RuntimeError(
            f"backend='nccl' needs one GPU per rank: asked for {world_size} ranks but this "
            f"machine has {gpus} GPU(s){'' if dist.is_nccl_available() else ' and no NCCL'}. "
            "Use backend='gloo' (CPU) or a smaller world_size."
        )
    return backend


def gpu_notice(backend: str, world_size: int, gpus: int | None = None) -> str | None:
    """The one line a Cluster prints when the machine has GPUs but they do not decide the
    backend the learner might expect: fewer GPUs than ranks (NCCL needs one per rank)."""
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend != "gloo" or gpus == 0:
        return None
    if gpus < world_size:
        return (
            f"Cluster({world_size}): this machine has {gpus} GPU(s) for {world_size} ranks, and NCCL needs "
            f"one GPU per rank, so the ranks run on the CPU with gloo (Cluster({gpus}) would put one "
            "rank on each GPU)"
        )
    return f"Cluster({world_size}): backend='gloo' asked for, so the ranks run on the CPU though {gpus} GPU(s) are here"


def _positive_int(name: str, value) -> int:
    """``value`` as an int if it is a positive integer of any integer type (numpy's too)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        number = 0
    if number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


def _seconds(name: str, value, minimum_excluded: bool = True) -> float:
    """A duration: a real number above 0 (or at least 0), ``math.inf`` for no limit."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
    if not ok or value < 0 or (minimum_excluded and value == 0):
        bound = "above 0" if minimum_excluded else "at least 0"
        raise ValueError(f"{name} must be a number of seconds {bound} (math.inf for no limit), got {value!r}")
    return float(value)


class Cluster:
    """``world_size`` ranks that live beside the notebook, each in a process group.

    >>> cluster = Cluster(4)                       # gloo on CPU, NCCL with 4 GPUs
    >>> cluster.run(lambda ctx: ctx.rank ** 2)     # -> [0, 1, 4, 9]
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "auto",
        timeout: float = 300.0,
        output: str = "ordered",
        threads: int | None = None,
        grace: float = 2.0,
        idle_release: float = IDLE_RELEASE_S,
        strict_device: bool | None = None,
        strict_p2p: bool | float | None = None,
    ):
        world_size = _positive_int("world_size", world_size)
        if output not in ("ordered", "live"):
            raise ValueError(f"output must be 'ordered' or 'live', got {output!r}")
        self.world_size = world_size
        self.backend = resolve_backend(backend, world_size)
        notice = gpu_notice(self.backend, world_size)
        if notice:
            print(notice)
        # strict-device mode (runtime/strict_device.py): a tensor left on the host fails here
        # as it would on a GPU node; None: as ULTRASCALE_STRICT_DEVICE says (make test sets it)
        self.strict_device = enabled_by_env() if strict_device is None else bool(strict_device)
        # strict point-to-point mode (runtime/strict_p2p.py): a send waits for its receive, as
        # under NCCL; the seconds it may wait (True: the default), None: off
        if strict_p2p is None:
            strict_p2p = timeout_from_env()
        self.strict_p2p = DEFAULT_P2P_TIMEOUT if strict_p2p is True else None if strict_p2p is False else strict_p2p
        self.timeout = _seconds("timeout", timeout)
        self.output = output  # "ordered": each rank's lines after the call; "live": as they come
        self.grace = _seconds("grace", grace, minimum_excluded=False)  # how long other ranks
        # may run on after one rank has failed
        self.threads = (
            _positive_int("threads", threads) if threads is not None else max(1, (os.cpu_count() or 1) // world_size)
        )
        self._job_id = 0
        self._generation = 0
        self._procs: list = []
        self._conns: list = []
        self._needs_restart = False
        self._closed = False
        # ``idle_release`` seconds after the last call the ranks are let go (math.inf: never)
        self.idle_release = _seconds("idle_release", idle_release)
        self._busy = threading.Lock()  # a call and the idle release never run at once
        self._idle_timer = None
        self._released = False
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        _EVERY_CLUSTER.add(self)
        self._start()
        _LIVE_CLUSTERS.add(self)
        _CURRENT[:] = [self]
        _register_magic_if_in_ipython()

    # ----------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        try:
            with _SERVER_LOCK:
                self._spawn()
                self._wait_ready()
        except BaseException:  # a stop or an error half-way: no half-started ranks linger
            self._lose()
            raise
        self._needs_restart = False

    def _spawn(self) -> None:
        mpctx = mp_context()
        self._generation += 1  # a fresh key prefix in the store: a new process group
        for rank in range(self.world_size):
            parent_conn, child_conn = mpctx.Pipe(duplex=True)
            proc = mpctx.Process(
                target=worker_main,
                args=(
                    rank,
                    self.world_size,
                    self.backend,
                    child_conn,
                    self._store.port,
                    self._generation,
                    os.getpid(),
                    self.threads,
                    list(sys.path),
                    os.getcwd(),
                    self.strict_device,
                    self.strict_p2p,
                ),
                name=f"ultrascale-rank{rank}",
                daemon=True,
            )
            with no_main_reimport():
                proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)

    def _wait_ready(self, timeout: float = 120.0) -> None:
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(pending)} did not start within {timeout:.0f} s")
            for rank in list(pending):
                proc, conn = self._procs[rank], self._conns[rank]
                try:
                    message = read_message(conn, deadline) if conn.poll(0.05) else None
                except EOFError:  # the rank is gone: its exit code says more
                    message = None
                    proc.join(timeout=1.0)
                if message is None:
                    if not proc.is_alive():
                        raise RuntimeError(f"rank {rank} exited during start-up (exit code {proc.exitcode})")
                    continue
                kind, _, _, payload = message
                if kind == "ready":
                    pending.discard(rank)
                elif kind == "error":
                    raise RuntimeError(f"rank {rank} could not join the process group:\n{payload[1]}")
                elif kind == "out":
                    sys.stdout.write(f"[rank {rank}] {payload[1]}")

    def _kill(self) -> None:
        """Stop every rank now (SIGKILL) and forget them."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def _lose(self) -> None:
        """Kill the ranks now and start new ones on the next call: what is left in their
        pipes or their process group can't be trusted."""
        self._kill()
        self._needs_restart = True

    def restart(self) -> None:
        """Kill and start all ranks again: a new process group, empty ``ctx.state``.
        A closed Cluster is opened again."""
        self._reopen()
        self._kill()
        self._start()

    def _reopen(self) -> None:
        """Undo ``close()``: the Cluster counts as live again (its ranks are started by the
        caller). The store stays open across ``close()``, and each start takes a new
        generation of keys in it, so the new process group never meets the old one's."""
        if self._closed:
            self._closed = False
            _LIVE_CLUSTERS.add(self)  # killed at exit again
            _CURRENT[:] = [self]  # %%ranks runs on it again

    def close(self) -> None:
        """Let the ranks leave their process group and exit; kill any that linger.

        The Cluster can still be used: the next ``run`` starts its ranks again (with a notice,
        their ``ctx.state`` empty), so a cell re-run after the chapter's last cell works.
        """
        self._closed = True
        self._released = False  # the next run says "closed", not "idle"
        self._cancel_idle_timer()
        for conn in self._conns:
            try:
                conn.send(("stop", 0))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
        _LIVE_CLUSTERS.discard(self)
        # _CURRENT keeps it: a %%ranks cell re-run after the close reopens it, as run does
        _schedule_server_release(self.idle_release)  # as the ranks of an idle cluster go

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list:
        return [p.pid for p in self._procs]

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self._kill()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = (
            "closed: ranks stopped, back on the next call"
            if self._closed
            else "running"
            if self.alive
            else "idle: ranks released, back on the next call"
            if self._released
            else "stopped"
        )
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # -------------------------------------------------------------------- calls
    def run(self, fn, *args, ranks=None, timeout: float | None = None, on_log=None, **kwargs) -> list:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank (or on ``ranks``).

        Returns the results as a list in rank order. ``on_log(rank, metrics)`` is
        called in the notebook for every ``ctx.log(...)`` while the call runs.
        """
        if not callable(fn):
            raise TypeError(
                f"cluster.run needs a function to run on the ranks, called as fn(ctx, *args); "
                f"got {type(fn).__name__} {fn!r}"
            )
        if on_log is not None and not callable(on_log):
            raise TypeError(f"on_log must be a function on_log(rank, metrics), got {type(on_log).__name__}")
        timeout = self.timeout if timeout is None else _seconds("timeout", timeout)
        ranks = list(range(self.world_size)) if ranks is None else sorted(set(ranks))
        if not ranks or any(not 0 <= r < self.world_size for r in ranks):
            raise ValueError(f"ranks must be a non-empty subset of 0..{self.world_size - 1}, got {ranks}")
        payload = cloudpickle.dumps((fn, args, kwargs))  # before anything is sent: fails here, cleanly
        with self._busy, counting_presses() as presses:  # a press a finalizer swallows still counts
            self._cancel_idle_timer()
            try:
                if self._closed:
                    # most often a cell re-run after the chapter's last cell closed the cluster
                    print(
                        f"[ultrascale] this Cluster was closed (cluster.close()): starting its "
                        f"{self.world_size} ranks again (ctx.state starts empty: re-run the cells "
                        f"that filled it if this one needs them)"
                    )
                    self.restart()
                elif self._released:
                    idle = f"{self.idle_release / 60:g} min" if self.idle_release >= 60 else f"{self.idle_release:g} s"
                    print(
                        f"[ultrascale] the ranks had been idle for {idle} and gave "
                        f"their memory back: starting {self.world_size} again (ctx.state starts empty)"
                    )
                    self._released = False
                    self.restart()
                elif self._needs_restart or not self.alive:
                    print(f"[ultrascale] restarting {self.world_size} ranks (per-rank state was lost)")
                    self.restart()
                self._job_id += 1
                call = Call(self, self._job_id, ranks, on_log, getattr(fn, "__name__", "fn"), presses)
                call.send(payload)
                return call.collect(timeout)
            finally:
                self._arm_idle_timer()

    # ------------------------------------------------------------- idle release
    def _arm_idle_timer(self) -> None:
        if self._closed or math.isinf(self.idle_release):
            return
        release = weakref.WeakMethod(self._release_if_idle)  # the timer must not keep a dropped cluster alive
        self._idle_timer = threading.Timer(self.idle_release, lambda: release() and release()())
        self._idle_timer.daemon = True  # never keeps a finished kernel or script alive
        self._idle_timer.start()

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _release_if_idle(self) -> None:
        """From the timer's thread: kill the idle ranks, unless a call has just begun; then the
        fork server, if no cluster has ranks left."""
        if not self._busy.acquire(blocking=False):
            return  # a call is running: it re-arms the timer when it ends
        try:
            if not self._closed and self._procs:
                self._kill()
                self._released = True
            _release_fork_server_if_unused()
        finally:
            self._busy.release()

    def _stacks(self, job_id: int, ranks, wait_s: float = 2.0) -> dict:
        """Ask the listener thread of each rank where its main thread is right now."""
        stacks, deadline = {}, time.monotonic() + wait_s
        try:
            for rank in ranks:
                self._conns[rank].send(("stack", job_id))
            while len(stacks) < len(ranks) and time.monotonic() < deadline:
                for rank in ranks:
                    conn = self._conns[rank]
                    while rank not in stacks and conn.poll(0.01):
                        kind, jid, _, payload = read_message(conn)
                        if kind == "stack" and jid == job_id:
                            stacks[rank] = payload
        except (OSError, EOFError):  # a dead or broken pipe: the caller kills the ranks next
            pass
        for rank in ranks:
            stacks.setdefault(rank, "(no answer: the rank is not responding)\n")
        return stacks


_SERVER_TIMER: list = []  # the one pending release of the server after a close


def _schedule_server_release(delay: float) -> None:
    """In ``delay`` seconds, stop the fork server if no cluster has ranks then (one timer for
    the process: each close moves it, so closing many clusters leaves one sleeping thread)."""
    for timer in _SERVER_TIMER:
        timer.cancel()
    _SERVER_TIMER.clear()
    if math.isinf(delay):
        return
    timer = threading.Timer(delay, _release_fork_server_if_unused)
    timer.daemon = True  # never keeps a finished kernel or script alive
    timer.start()
    _SERVER_TIMER.append(timer)


def _release_fork_server_if_unused() -> bool:
    """Stop the fork server when no cluster of this process has ranks (its death would kill
    them) and none is starting some (it holds _SERVER_LOCK: then the server stays, until the
    next idle release or close)."""
    if not _SERVER_LOCK.acquire(blocking=False):
        return False
    try:
        if any(cluster._procs for cluster in list(_EVERY_CLUSTER)):
            return False
        return stop_fork_server()
    finally:
        _SERVER_LOCK.release()


_SHARED: dict = {}


def shared_cluster(world_size: int, backend: str = "auto") -> Cluster:
    """A cached cluster of ``world_size`` ranks, started on first use, its strict modes as the
    environment says."""
    key = (world_size, backend, enabled_by_env(), timeout_from_env())
    cluster = _SHARED.get(key)
    if cluster is None or cluster._closed:
        cluster = _SHARED[key] = Cluster(world_size, backend=backend, strict_device=key[2], strict_p2p=key[3])
    return cluster


def grading_cluster(world_size: int) -> Cluster:
    """The cached cluster the exercise tests run a learner's code on, in the strict modes the
    environment asks for (``make test`` grades the solutions in both; a learner can set
    ``ULTRASCALE_STRICT_P2P=1`` and ``ULTRASCALE_STRICT_DEVICE=1`` to be graded by a GPU node's
    rules, where a receive buffer of the wrong size is named as such, not as gloo's
    "Connection reset by peer"). One name for the graders' clusters, so that a default for all
    of them is one line: on by default is the next step, once every grader test's wrong answers
    are device-correct and its deadlocks fail fast."""
    return shared_cluster(world_size)


def current_cluster() -> Cluster:
    if not _CURRENT:
        raise RuntimeError("no Cluster is running: create one first, e.g. cluster = Cluster(4)")
    return _CURRENT[0]


@atexit.register
def _close_all() -> None:
    for cluster in list(_LIVE_CLUSTERS):
        try:
            cluster._kill()
        except Exception:
            pass


def _register_magic_if_in_ipython() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is not None:
        from .magic import register

        register(ip, current_cluster)
