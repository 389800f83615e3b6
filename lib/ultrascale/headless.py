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

What goes wrong in a notebook does not pass through that log: a cell's error comes back as
the cell's output (papermill raises PapermillExecutionError), and a kernel that dies is
seen by the client (nbclient raises DeadKernelError).
"""

import json
import logging

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


def kernel_options() -> dict:
    """papermill's keyword arguments for nbclient (new objects each time: nbclient may extend them)."""
    return {
        # nbclient's KernelManager: provision CurveZMQ keys when the kernelspec supports them.
        "config": Config({"KernelManager": {"transport_encryption": "auto"}}),
        # Appended to the kernel's command line.
        "extra_arguments": [f"--IPKernelApp.logging_config={json.dumps(_KERNEL_LOGGING)}"],
    }
