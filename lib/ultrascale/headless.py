"""Notebooks run from the command line: the papermill options that keep the kernel's log
to what matters. Shared by launch/batch.py, launch/build_notebooks.py and the grader.

    papermill.execute_notebook(source, target, kernel_name="python3", **kernel_options())

Two messages of ipykernel's log (its ``IPKernelApp`` logger, printed on our stderr) said
nothing about the notebook, so every run printed them:

* "Kernel is running over TCP without encryption": the kernel's sockets carried plain text.
  They are now encrypted (jupyter_client provisions CurveZMQ keys to a kernel whose
  kernelspec declares it can use them, as ipykernel's does), so the kernel has no cause to
  warn. A kernelspec that cannot still warns, truly.
* "KeyboardInterrupt caught in kernel": when papermill is done, jupyter_client stops the
  kernel by sending it SIGINT before the shutdown request. A kernel still inside a message
  handler at that instant (a race: most runs miss it) catches the interrupt and logs this,
  then shuts down as asked. Every cell had already run and its outputs were saved, so the
  message is dropped by a filter on the kernel's log handler; the rest of that log stays.

The kernel's five sockets are unix sockets beside its connection file (jupyter_client's "ipc"
transport), not TCP ports on localhost: jupyter_client chooses a TCP port by binding to port
0 and closing it, and before the kernel binds it another process may take it (a suite's gloo
connections take ephemeral ports all the time): the kernel then dies with "Address already
in use". A socket file's name is checked free and cannot be taken that way. Where the path
would pass a unix socket's limit (107 bytes), TCP stays (``ipc_sockets``).

What goes wrong in a notebook does not pass through that log: a cell's error comes back as
the cell's output (papermill raises PapermillExecutionError), and a kernel that dies is
seen by the client (nbclient raises DeadKernelError).
"""

import json
import logging
import os

from traitlets.config import Config

SHUTDOWN_INTERRUPT = "KeyboardInterrupt caught in kernel"


class DropShutdownInterrupt(logging.Filter):
    """Drops the kernel's "KeyboardInterrupt caught in kernel" record (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(SHUTDOWN_INTERRUPT)


# Merged by traitlets into the kernel application's logging setup (its handler is "console").
_KERNEL_LOGGING = {
    "filters": {"drop_shutdown_interrupt": {"()": f"{__name__}.DropShutdownInterrupt"}},
    "handlers": {"console": {"filters": ["drop_shutdown_interrupt"]}},
}


_UNIX_PATH_MAX = 107  # sun_path is 108 bytes, with its terminating NUL


def ipc_sockets() -> str | None:
    """A new kernel's socket path prefix, "<runtime folder>/kernel-<uuid>-ipc" (the sockets add
    "-<n>"): absolute, since the kernel may run in another folder than its client, and unique,
    since jupyter_client numbers the sockets from 1 under a given prefix. None where the
    paths would pass a unix socket's limit: the kernel then keeps TCP (see above)."""
    import uuid

    from jupyter_core.paths import jupyter_runtime_dir

    prefix = os.path.join(jupyter_runtime_dir(), f"kernel-{uuid.uuid4()}-ipc")
    return prefix if len(os.fsencode(prefix)) + len("-65535") <= _UNIX_PATH_MAX else None


def kernel_options() -> dict:
    """papermill's keyword arguments for nbclient (new objects each time: nbclient may extend them,
    and each kernel needs sockets of its own)."""
    manager = {"transport_encryption": "auto"}  # provision CurveZMQ keys when the kernelspec supports them
    prefix = ipc_sockets()
    if prefix is not None:
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        manager.update(transport="ipc", ip=prefix)
    return {
        "config": Config({"KernelManager": manager}),
        # Appended to the kernel's command line.
        "extra_arguments": [f"--IPKernelApp.logging_config={json.dumps(_KERNEL_LOGGING)}"],
    }
