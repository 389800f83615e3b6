"""Run a command on code we did not write: a learner's notebook, graded by a teacher.

``Sandbox(limits).run(argv, workdir, env, seconds)`` runs ``argv`` with ``workdir`` (a
throwaway copy) as its only writable folder, and with

* limits set with ``setrlimit`` before exec, inherited by every descendant: private
  writable memory per process (``RLIMIT_DATA``: unlike ``RLIMIT_AS`` it does not count the
  address space CUDA reserves), file size, and, for a user other than root, processes
  (``RLIMIT_NPROC``; root ignores it, so root gets a ``pids`` cgroup where one can be made);
* a wall-clock limit, after which everything it started is killed;
* bubblewrap where it works (``bwrap``: Debian's ``bubblewrap``): new user, pid, network,
  ipc and uts namespaces. The network namespace has only loopback, which is all a kernel
  needs (its ZMQ sockets and gloo between its ranks); Python, the venv and the course
  library are bound read-only, the copy read-write, ``/tmp`` is a small private tmpfs.
  Where bwrap is missing or cannot make namespaces, the command runs without it, and
  ``describe()`` says so in one line: it can then write wherever the teacher can, and
  reach the network.

All of it is done by a supervisor, this file run as a script: it makes itself a child
subreaper (``prctl``), so that a process that escapes its session (``setsid``, a double
fork) is still its descendant, and at the end kills the command's process group, its
cgroup and every descendant left, until ``/proc`` shows none. With bwrap the pid namespace
does the same (its processes die with its first one). The supervisor's report (JSON on its
stdout) says whether the time limit was reached and how many processes survived (0).
Only the standard library is imported: the supervisor starts in ~30 ms, without torch.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

GiB = 1 << 30
# Read-only system folders a Python kernel needs. All of /etc is not bound: it may hold
# secrets that root (the usual CI user) can read, such as /etc/shadow.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys")
ETC_FILES = (
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
    "/etc/localtime",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/fonts",
    "/etc/ssl",
    "/etc/mime.types",
)


@dataclass(frozen=True)
class Limits:
    seconds: float = 1200  # wall clock for one notebook
    memory_bytes: int = 8 * GiB  # private writable memory, per process
    processes: int = 1024  # tasks (threads count too) of the whole submission
    file_bytes: int = 2 * GiB  # largest file it may write; also the size of its /tmp


@dataclass
class Outcome:
    returncode: int | None = None  # None: killed at the time limit
    timed_out: bool = False
    survivors: int = 0  # processes still there after the kill (should be 0)
    stderr: str = ""


@dataclass
class Sandbox:
    limits: Limits = field(default_factory=Limits)
    bwrap: str | None = None  # the bwrap to use; None: run without namespaces
    why_not: str = ""  # why bwrap is not used

    @classmethod
    def probe(cls, limits: Limits = Limits()) -> "Sandbox":
        """A sandbox with bwrap if it is installed and can make its namespaces here."""
        found = shutil.which("bwrap")
        if found is None:
            return cls(limits, None, "bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
        probe = subprocess.run(
            [found, *bwrap_args(Path("/")), "--", "true"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode != 0:
            return cls(limits, None, f"bwrap cannot make its namespaces here ({probe.stderr.strip()[-200:]})")
        return cls(limits, found)

    def describe(self) -> str:
        """One line for the grader's output: what protects the teacher here, and what does not."""
        limits = (
            f"{self.limits.seconds:g} s, {self.limits.memory_bytes / GiB:g} GiB per process, {self._process_bound()}"
        )
        if self.bwrap:
            return f"sandbox: bubblewrap (no network but loopback, writes only in a throwaway copy), {limits}"
        return (
            f"sandbox: WITHOUT bubblewrap ({self.why_not}): submissions run in a throwaway copy with "
            f"limits ({limits}) and are killed at the end, but CAN write wherever you can and use the network"
        )

    def _process_bound(self) -> str:
        if os.geteuid() != 0:
            return f"{self.limits.processes} processes"
        if _pids_hierarchy() is not None:
            return f"{self.limits.processes} processes (a pids cgroup)"
        return "processes NOT bounded (root ignores RLIMIT_NPROC and no pids cgroup can be made)"

    def bounds_processes(self) -> bool:
        return "NOT" not in self._process_bound()

    def run(self, argv: list, workdir: Path, env: dict, seconds: float) -> Outcome:
        """``argv`` in ``workdir``, sandboxed; everything it started is gone when this returns."""
        env = (
            {**env, "HOME": str(workdir), "TMPDIR": "/tmp", "GLOO_SOCKET_IFNAME": "lo"}
            if self.bwrap
            else {**env, "HOME": str(workdir)}
        )
        command = [self.bwrap, *bwrap_args(workdir, self.limits.file_bytes), "--", *argv] if self.bwrap else list(argv)
        spec = {"argv": command, "cwd": str(workdir), "env": env, "seconds": seconds, "limits": asdict(self.limits)}
        # The supervisor gets a margin of its own to kill and reap; past that we kill it too.
        done = subprocess.run(
            [sys.executable, __file__],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            start_new_session=True,
            timeout=seconds + 120,
        )
        try:
            return Outcome(**json.loads(done.stdout))
        except (ValueError, TypeError):
            return Outcome(returncode=done.returncode, stderr=f"the sandbox's supervisor failed: {done.stderr[-2000:]}")


def bwrap_args(workdir: Path, tmp_bytes: int = Limits.file_bytes) -> list:
    """bubblewrap's options: namespaces, then the folders the command may read and write."""
    args = [
        "--unshare-all",
        "--unshare-user",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "localhost",
        "--cap-drop",
        "ALL",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/dev/shm",
    ]
    for device in sorted(Path("/dev").glob("nvidia*")):  # a GPU node's GPUs
        args += ["--dev-bind", str(device), str(device)]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):  # /bin -> usr/bin on merged-/usr systems
            args += ["--symlink", os.readlink(path), path]
        else:
            args += ["--ro-bind-try", path, path]
    for path in ETC_FILES:
        args += ["--ro-bind-try", path, path]
    args += ["--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    for path in _python_paths():
        args += ["--ro-bind", path, path]
    if workdir != Path("/"):
        args += ["--bind", str(workdir), str(workdir), "--chdir", str(workdir)]
    return args


def _python_paths() -> list:
    """The interpreter, the venv, and every folder on the import path (the course library's
    among them), without the ones already inside another or inside a system folder."""
    import sysconfig

    candidates = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        *sysconfig.get_paths().values(),
        *(p for p in sys.path if p),
    }
    here = Path(__file__).resolve().parents[1]  # lib/, where the course library lives (editable install)
    candidates.add(str(here))
    paths = sorted({os.path.realpath(p) for p in candidates if os.path.isdir(p)})
    kept = []
    for path in paths:  # sorted: a parent comes before what it holds
        if not any(path == k or path.startswith(k + "/") for k in [*kept, *SYSTEM_DIRS]):
            kept.append(path)
    return kept


# ---- cgroups: the only process bound root has ------------------------------------------


def _pids_hierarchy() -> Path | None:
    """The folder of this process's cgroup in a writable ``pids`` hierarchy (v1 or v2), if any."""
    if os.geteuid() != 0:
        return None
    mine = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else ["unified"]:
            mine[name] = path
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
        if fstype == "cgroup" and "pids" in options:
            folder = Path(fields[4]) / mine.get("pids", "/").lstrip("/")
        elif fstype == "cgroup2" and "pids" in _read(Path(fields[4]) / "cgroup.subtree_control").split():
            folder = Path(fields[4]) / mine.get("unified", "/").lstrip("/")
        else:
            continue
        if os.access(folder, os.W_OK):
            return folder
    return None


def _make_cgroup(processes: int) -> Path | None:
    parent = _pids_hierarchy()
    if parent is None:
        return None
    group = parent / f"ultrascale-sandbox-{os.getpid()}"
    try:
        group.mkdir()
        (group / "pids.max").write_text(str(processes))
        return group
    except OSError:
        return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# ---- the supervisor --------------------------------------------------------------------


def _limit_child(limits: dict, cgroup: Path | None, nproc: int | None) -> None:
    """In the child, before exec: limits that its descendants inherit and cannot raise."""
    if cgroup is not None:
        (cgroup / "cgroup.procs").write_text("0")  # "0": this process
    rlimits = [
        (resource.RLIMIT_DATA, limits["memory_bytes"]),
        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
        (resource.RLIMIT_CORE, 0),
    ]
    if nproc is not None:
        rlimits.append((resource.RLIMIT_NPROC, nproc))
    for name, value in rlimits:
        resource.setrlimit(name, (value, value))


def _user_tasks() -> int:
    """Tasks (processes and threads) of this user now: RLIMIT_NPROC counts all of them."""
    uid, count = str(os.getuid()), 0
    for status in Path("/proc").glob("[0-9]*/status"):
        text = _read(status)
        if f"\nUid:\t{uid}\t" in text:
            count += int(text.split("\nThreads:\t", 1)[1].split()[0]) if "\nThreads:\t" in text else 1
    return count


def _descendants(root: int) -> list:
    """Every process below ``root``, from /proc's parent links."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        text = _read(stat)
        if text:  # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")"
            children.setdefault(int(text.rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_everything(cgroup: Path | None, deadline: float) -> int:
    """SIGKILL every descendant (orphans come back to us, the subreaper) and every process
    in the cgroup, reaping them, until none is left: a process may fork while we kill,
    hence the loop. Returns how many survived. This does more than ``killpg``: a process
    that left the group with ``setsid`` is still our descendant."""
    while True:
        family = set(_descendants(os.getpid()))
        members = {int(p) for p in _read(cgroup / "cgroup.procs").split()} if cgroup else set()
        for pid in family | members:
            _kill_if_ours(pid, {os.getpid(), *family}, cgroup)
        _reap()
        alive = [p for p in family | members if _is_alive(p)]
        if not alive or time.monotonic() > deadline:
            return len(alive)
        time.sleep(0.05)


def _kill_if_ours(pid: int, family: set, cgroup: Path | None) -> None:
    """SIGKILL through a pidfd, after checking that the pid is still one of ours: it may
    have died and been reused by someone else's process since /proc was read."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # gone
    try:
        stat = _read(Path(f"/proc/{pid}/stat")).rsplit(")", 1)[-1].split()
        in_group = cgroup is not None and f"/{cgroup.name}\n" in _read(Path(f"/proc/{pid}/cgroup"))
        if (stat and int(stat[1]) in family) or in_group:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (OSError, ValueError):
        pass
    finally:
        os.close(fd)


def _is_alive(pid: int) -> bool:
    state = _read(Path(f"/proc/{pid}/stat")).rsplit(")", 1)[-1].split()
    return bool(state) and state[0] not in ("Z", "X")  # a zombie is dead, only not yet reaped


def _reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def supervise(spec: dict) -> Outcome:
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    limits = spec["limits"]
    cgroup = _make_cgroup(limits["processes"])
    # Not root: the bound counts all of this user's tasks, so it starts from how many there are.
    nproc = None if os.geteuid() == 0 else _user_tasks() + limits["processes"]
    try:
        outcome = _run_child(spec, limits, cgroup, nproc)
    finally:
        if cgroup is not None:
            _kill_everything(cgroup, time.monotonic() + 10)  # a no-op after _run_child, unless it failed
            try:
                cgroup.rmdir()
            except OSError:
                pass  # a survivor holds it: the outcome says so
    return outcome


def _run_child(spec: dict, limits: dict, cgroup: Path | None, nproc: int | None) -> Outcome:
    outcome = Outcome()
    with open(os.devnull, "rb") as stdin, open(Path(spec["cwd"]) / ".sandbox-stderr", "w+b") as err:
        child = subprocess.Popen(
            spec["argv"],
            cwd=spec["cwd"],
            env=spec["env"],
            stdin=stdin,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            preexec_fn=lambda: _limit_child(limits, cgroup, nproc),
        )
        try:
            outcome.returncode = child.wait(timeout=spec["seconds"])
        except subprocess.TimeoutExpired:
            outcome.timed_out = True
        outcome.survivors = _kill_everything(cgroup, time.monotonic() + 60)
        err.seek(max(0, err.seek(0, os.SEEK_END) - 4000))
        outcome.stderr = err.read().decode(errors="replace")
    return outcome


if __name__ == "__main__":
    print(json.dumps(asdict(supervise(json.loads(sys.stdin.read())))))
