"""The grader's own runs of the tests, forked from a process that has imported them once.

Each notebook's tests run in a fresh process of the grader's (cli.regrade: the notebook's kernel
cannot touch it). Started as a new interpreter, that process spent about 1.7 s of CPU importing
torch, the runtime and the grader before it ran any test. A zygote (the name Android gives its process that has
done the imports and forks the apps) does those imports once per grading process, and each run is a
fork of it: fresh in every way that matters, since nothing a test or a learner's function does
there reaches the zygote or the next run, and the environment, folder and standard streams are the
run's own. The zygote imports only what a new interpreter would have imported at that point, so a
run imports everything else (the chapter's tests, Triton) as one would, after the notebook's
environment variables are in place.

Only for the course's own notebooks, which the grader runs without a sandbox: a sandboxed run starts
a new interpreter inside its sandbox, as before (sandbox.py). Linux only (elsewhere, a new
interpreter as before): a fork of a process with torch imported is safe where no torch work has
started threads yet (OpenMP's, CUDA's), which is what the zygote keeps to: it imports, it never
computes.

    zygote = Zygote.start(env)
    code, stderr = zygote.run(spec_path, cwd, env, limit)   # None if it ran past limit (killed)

The protocol is a JSON line each way: the request ({"spec", "cwd", "env", "stderr"}), then the
run's pid ({"pid"}) and, when it ends, its exit code ({"code"}).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

# The zygote's program. It imports what a new interpreter running cli.regrade_main imports before it
# reads the notebook's environment variables (cli._apply_context): the grader, torch and the runtime
# (with the collector paused), nothing more. What is imported after them may depend on them: Triton's
# library functions are interpreted or compiled as TRITON_INTERPRET says when triton.language is
# imported (torch._dynamo imports it), and ultrascale.kernels asks torch whether there is a GPU,
# which starts CUDA's driver: a fork of the zygote could then use no GPU. (The grader's function is
# handed to ``main`` here, so that this module and cli.py, which uses it, do not import each other.)
_MAIN = (
    "import ultrascale.runtime; from ultrascale_grading.cli import regrade_main; "
    "from ultrascale_grading.zygote import main; main(regrade_main)"
)


def available() -> bool:
    return sys.platform == "linux"


class Zygote:
    """The grader's side: one zygote process, one run at a time."""

    def __init__(self, proc: subprocess.Popen, env: dict):
        self.proc, self.env = proc, env

    @classmethod
    def start(cls, env: dict) -> "Zygote":
        """A zygote with the environment ``env`` (its imports may read it, as a new interpreter's would)."""
        proc = subprocess.Popen(
            [sys.executable, "-c", _MAIN],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
        )
        return cls(proc, dict(env))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, spec: Path, cwd: Path, env: dict, limit: float) -> tuple[int | None, str]:
        """Run ``regrade_main(spec)`` in a fork, in ``cwd`` with ``env``: (exit code or None if it was
        killed at ``limit`` seconds, its standard error)."""
        stderr = spec.with_name("stderr.txt")
        self.proc.stdin.write(
            json.dumps({"spec": str(spec), "cwd": str(cwd), "env": env, "stderr": str(stderr)}) + "\n"
        )
        self.proc.stdin.flush()
        pid = self._read(60.0)["pid"]  # the zygote answers at once; 60 s: it may still be importing
        answer = self._read(limit)
        timed_out = answer is None
        if timed_out:  # the run, its fork server and ranks are one process group: all of them go
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._read(30.0)  # the zygote's line for the killed run, so that the next run reads its own
        text = stderr.read_text(errors="replace") if stderr.is_file() else ""
        return (None if timed_out else answer["code"]), text

    def _read(self, timeout: float) -> dict | None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            end = time.monotonic() + timeout
            while True:
                if selector.select(max(0.0, end - time.monotonic())):
                    line = self.proc.stdout.readline()
                    if not line:
                        raise RuntimeError(f"the grader's zygote exited (code {self.proc.wait()})")
                    return json.loads(line)
                if time.monotonic() >= end:
                    return None

    def close(self) -> None:
        """The zygote ends at the end of its input."""
        try:
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def main(run) -> None:
    """The zygote, once its imports are made (``_MAIN``): fork one ``run(spec)`` per request line."""
    out = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, run)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()


def _child(request: dict, run) -> None:
    """In the fork: become the run the request asks for, run it, leave without the zygote's exit."""
    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own, which its fork server and ranks join: killed together
        null = os.open(os.devnull, os.O_RDWR)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((0, null), (1, null), (2, err)):
            os.dup2(target, fd)
        os.close(null), os.close(err)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = run(request["spec"])
    except BaseException:  # noqa: BLE001 - said on its stderr, as a new interpreter would
        import traceback

        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
