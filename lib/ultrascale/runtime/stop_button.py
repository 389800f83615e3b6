"""The stop button, counted: a press that CPython swallowed still stops the call.

Jupyter's stop button sends SIGINT to the kernel, whose handler raises KeyboardInterrupt in
whatever Python code the main thread runs at that moment. If that is a finalizer (a ``__del__``,
or a weakref callback such as the one multiprocessing attaches to every Process), CPython does
not raise the exception: it prints "Exception ignored in ..." and goes on. A ``Cluster.run``
drops such objects whenever it restarts ranks, so a press at that moment was lost, and a call
stuck in a loop then ran on (the soak test in tests/test_runtime_stops.py saw it on a loaded
machine). So while a call runs, the handler also counts the presses, and the call checks the
count each time it polls its ranks: a press whose exception never arrived stops it all the same.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class Presses:
    """How many times stop was pressed since the call began (always 0 where not counted)."""

    def __init__(self):
        self.count = 0

    def __call__(self) -> int:
        return self.count


@contextlib.contextmanager
def counting_presses():
    """Count SIGINTs while the block runs, then hand each to the handler that was there before
    (Python's default one raises KeyboardInterrupt, as it did without us).

    Only the main thread can install a handler, and only a Python handler is wrapped: where
    SIGINT is ignored or left to the system, nothing changes and nothing is counted."""
    presses = Presses()
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if not callable(previous):
        yield presses
        return

    def handler(signum, frame):
        presses.count += 1
        return previous(signum, frame)

    signal.signal(signal.SIGINT, handler)
    try:
        yield presses
    finally:
        signal.signal(signal.SIGINT, previous)
