"""Heavy imports with Python's cyclic garbage collector paused; and frozen before forking ranks.

Importing torch creates a few hundred thousand objects that live as long as the process (with
torch._dynamo, about 300,000). While they are being created the collector runs again and again
(each time 700 new objects have piled up), and each of its fuller passes walks every object made
so far: about a fifth of the import's CPU time, spent finding no garbage. Every kernel, fork
server and grading process of the course imports torch, so the runtime imports it with the
collector paused (``collector_paused``). Measured on 2 cores, inside the process (process_time):
``import torch, torch._dynamo`` in 2.4-2.8 s of CPU, 2.0-2.2 s with the collector paused.

The fork server goes one step further (``freeze_for_fork``, Python's own recipe for a process
that forks without exec, see ``gc.freeze``): every object alive after its imports is moved out of
the collector's sight, so a rank's collections walk only what the rank made itself, never
torch's objects, and do not write to (and so copy) the memory pages the ranks share with it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """Run the body with the cyclic garbage collector off (as it was, after)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_for_fork() -> None:
    """Freeze every object alive now. (Without a collection first: the imports leave about 9,000
    objects of garbage, frozen with the rest, where one collection to free them walks all 300,000
    objects, 0.25 s of CPU.)"""
    gc.freeze()
    # At this process's own exit the frozen objects become ordinary again, so that the interpreter's
    # shutdown frees them as usual (it skips frozen ones, and triton's bindings report those as leaked).
    atexit.register(gc.unfreeze)
