"""The rank side of the runtime: what each persistent worker process does.

A worker is started once by :class:`ultrascale.runtime.Cluster`, joins a process
group, then waits for jobs. Two threads share the work:

* the **main thread** runs jobs (``fn(ctx, *args)``) one after another, so that a
  job's Python state, CUDA context and process group stay put between calls;
* the **listener thread** reads every message from the notebook. It can answer
  while the main thread is stuck inside a collective (gloo and NCCL release the
  GIL while they wait), which is how a hang is diagnosed: the listener sends the
  main thread's current Python stack back to the notebook.

Messages are plain tuples sent over a ``multiprocessing`` pipe. Payloads that
carry user code or results are pickled with cloudpickle, so a function defined in
a notebook cell can be shipped to the ranks.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
import time
import traceback
import _thread

import cloudpickle
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .strict_device import StrictDevice, install as install_strict_device
from .strict_p2p import install as install_strict_p2p, posted as strict_p2p_posted
from .context import RankContext, to_cpu
from .forkserver import name_this_process


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphan ranks)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not glibc: the watchdog below still covers us
        pass


def _watch_notebook(notebook_pid: int) -> None:
    """Exit as soon as the notebook kernel that owns this rank is gone.

    With the forkserver start method our parent is the fork server, not the kernel,
    so the death signal alone is not enough when the kernel is killed with SIGKILL.
    """
    while True:
        time.sleep(0.2)
        try:
            os.kill(notebook_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:
            pass


class _StopGate:
    """When the stop button may raise KeyboardInterrupt in the main thread.

    The stop button reaches a rank as SIGINT: from the listener (``interrupt_main``) or
    from Jupyter itself, which signals the kernel's whole process group. Python's own
    handler would raise KeyboardInterrupt at any bytecode, also in the middle of writing
    a message to the notebook, and half a message garbles the pipe for every later one.
    So the interrupt is raised only while the learner's code runs, and while the main
    thread writes a message it is held back until the message is complete.
    """

    def __init__(self):
        self.open = False  # the learner's code is running
        self.writing = False  # the main thread is in the middle of a message
        self.held = False  # an interrupt arrived while writing

    def handler(self, signum, frame) -> None:
        if not self.open:
            return  # idle, or between the job and its reply: nothing to stop
        if self.writing:
            self.held = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def learner_code(self):
        self.held, self.open = False, True
        try:
            yield
        finally:
            self.open = self.held = False

    @contextlib.contextmanager
    def writing_message(self):
        self.writing = True
        try:
            yield
        finally:
            self.writing = False
        if self.held and self.open:  # the message is out: now the stop may land
            self.held = False
            raise KeyboardInterrupt


class _Channel:
    """The pipe to the notebook, safe to use from both threads."""

    def __init__(self, conn, rank: int):
        self.conn = conn
        self.rank = rank
        self.lock = threading.Lock()
        self.job_id = 0  # the job the main thread is running (tags every message)
        self.gate = _StopGate()
        self.main_ident = threading.get_ident()  # created by the main thread

    def send(self, kind: str, payload=None, job_id: int | None = None) -> None:
        msg = (kind, self.job_id if job_id is None else job_id, self.rank, payload)
        in_main = threading.get_ident() == self.main_ident  # only it receives interrupts
        with self.gate.writing_message() if in_main else contextlib.nullcontext():
            with self.lock:
                try:
                    self.conn.send(msg)
                except (BrokenPipeError, OSError):
                    os._exit(1)  # the notebook is gone


class _RankStream:
    """A stand-in for sys.stdout/sys.stderr that forwards text to the notebook by line."""

    def __init__(self, channel: _Channel, name: str):
        self.channel = channel
        self.name = name
        self.buffer = ""

    def write(self, text: str) -> int:
        self.buffer += text
        if "\n" in self.buffer:
            head, _, self.buffer = self.buffer.rpartition("\n")
            self.channel.send("out", (self.name, head + "\n"))
        return len(text)

    def flush(self) -> None:
        if self.buffer:
            self.channel.send("out", (self.name, self.buffer))
            self.buffer = ""

    def isatty(self) -> bool:
        return False


_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_frames(frames):
    """Keep only the frames below the runtime's last one: the learner's code (and torch's),
    not multiprocessing's start-up or our job loop."""
    inside = [i for i, f in enumerate(frames) if os.path.abspath(f.filename).startswith(_RUNTIME_DIR)]
    return list(frames[inside[-1] + 1 :]) if inside else list(frames)


def _format_exception(exc: BaseException) -> str:
    tb = traceback.TracebackException.from_exception(exc)
    tb.stack = traceback.StackSummary.from_list(_user_frames(tb.stack))
    return "".join(tb.format())


def _main_thread_stack(main_ident: int) -> str:
    # Following another thread's frames is only safe while that thread stands still:
    # CPython 3.11 can crash if it pops a frame during the walk. So the walk (which reads
    # no files, so keeps the GIL) runs with the GIL's switch interval raised, and the
    # source lines are read only after it.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        frame = sys._current_frames().get(main_ident)
        stack = (
            None if frame is None else traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False)
        )
        del frame
    finally:
        sys.setswitchinterval(interval)
    if stack is None:
        return "(no stack: the main thread is not running Python code)\n"
    stack.reverse()  # outermost call first, as in a traceback
    frames = _user_frames(stack)
    if not frames:
        return "(idle: waiting for the next call)\n"
    return "".join(traceback.format_list(frames))


def _listen(conn, channel: _Channel, jobs: queue.Queue, main_ident: int) -> None:
    """Listener thread: dispatch jobs, answer stack requests, deliver interrupts."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(1)  # the notebook closed the pipe: nothing left to do
        kind, job_id = msg[0], msg[1]
        if kind == "stack":
            channel.send("stack", _main_thread_stack(main_ident), job_id=job_id)
        elif kind == "interrupt":
            if channel.job_id == job_id:
                _thread.interrupt_main()  # KeyboardInterrupt at the next Python bytecode
        else:  # "run" and "stop" go to the main thread in order
            jobs.put(msg)


def _init_process_group(backend: str, rank: int, world_size: int, store_port: int, generation: int):
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        # All ranks of a Cluster live on this machine: talk over loopback, which
        # avoids gloo guessing a network interface from the host name.
        os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    store = dist.TCPStore("127.0.0.1", store_port, None, False)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"gen{generation}/", store),
        rank=rank,
        world_size=world_size,
    )


def worker_main(
    rank,
    world_size,
    backend,
    conn,
    store_port,
    generation,
    notebook_pid,
    threads,
    sys_path=None,
    cwd=None,
    strict_device=False,
    strict_p2p=None,
):
    """Entry point of one rank (runs in a fresh process from the fork server)."""
    _set_parent_death_signal()
    name_this_process(f"rank{rank}")  # in top and ps: rank0, rank1, ... rather than one more python
    # The fork server may have started before the notebook changed its import path or folder
    # (it starts at ``import ultrascale.runtime``): a rank sees the notebook's as they are now.
    if sys_path is not None:
        sys.path[:] = sys_path
    if cwd is not None and os.path.isdir(cwd):
        os.chdir(cwd)
    threading.Thread(target=_watch_notebook, args=(notebook_pid,), daemon=True).start()
    torch.set_num_threads(threads)  # ranks share the machine's cores: don't oversubscribe

    channel = _Channel(conn, rank)
    signal.signal(signal.SIGINT, channel.gate.handler)
    sys.stdout = _RankStream(channel, "stdout")
    sys.stderr = _RankStream(channel, "stderr")

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    try:
        _init_process_group(backend, rank, world_size, store_port, generation)
    except Exception:  # report, then exit: the notebook raises a clear error
        channel.send("error", ("RuntimeError", traceback.format_exc(), None), job_id=0)
        return
    ctx = RankContext(rank=rank, world_size=world_size, backend=backend, device=device, channel=channel)
    if strict_p2p:  # NCCL's rules for sends and receives (strict_p2p.py)
        install_strict_p2p(strict_p2p)
    if strict_device:  # fail on this CPU where a GPU node would (strict_device.py)
        install_strict_device()
        ctx.strict_device = True

    jobs: queue.Queue = queue.Queue()
    threading.Thread(target=_listen, args=(conn, channel, jobs, threading.get_ident()), daemon=True).start()
    channel.send("ready", None, job_id=0)

    while True:
        try:
            msg = jobs.get()
            if msg[0] == "stop":
                break
            _run_job(ctx, channel, msg[1], msg[2])
        except KeyboardInterrupt:  # only if the learner's code replaced the gate's handler
            channel.job_id = 0
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


def _run_job(ctx: RankContext, channel: _Channel, job_id: int, payload: bytes) -> None:
    """Run one job and reply with its result or error, and whether it used a process group."""
    channel.job_id = job_id
    before = _group_counters()
    try:
        with channel.gate.learner_code():
            fn, args, kwargs = cloudpickle.loads(payload)
            with StrictDevice() if ctx.strict_device else contextlib.nullcontext():
                result = fn(ctx, *args, **kwargs)
        reply = ("result", cloudpickle.dumps(to_cpu(result)))
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt is reported too
        reply = ("error", (type(exc).__name__, _format_exception(exc), _pickle_or_none(exc)))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # Ranks that posted anything on a group may have left an operation behind that a
    # later call's would pair with; the notebook restarts them if the call failed.
    used = _group_counters() != before
    channel.job_id = 0  # from here on, a late interrupt for this job is ignored
    channel.send(reply[0], (reply[1], used), job_id=job_id)


def _group_counters():
    """Each process group's sequence number on this rank: it counts every collective,
    send and receive posted on the group, so any change means the group was used.
    Groups created or destroyed change the result too."""
    if not dist.is_initialized():
        return None
    try:
        groups = list(c10d._world.pg_map)
    except AttributeError:  # a torch without this registry: assume every call used a group
        return object()
    counters = {}
    for group in groups:
        try:
            counters[group] = group._get_sequence_number_for_group()
        except Exception:  # a backend without sequence numbers: assume it was used
            counters[group] = object()
    # strict point-to-point mode posts sends and receives from its own threads, maybe not yet
    counters["strict p2p"] = strict_p2p_posted()
    return counters


def _pickle_or_none(exc: BaseException):
    try:
        return cloudpickle.dumps(exc)
    except Exception:  # some exceptions can't travel; the traceback text still does
        return None
