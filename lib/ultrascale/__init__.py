"""ultrascale: the shared library of the Ultra-Scale Playbook course.

One module per idea: ``runtime`` (persistent ranks beside a notebook), ``comm``
(collectives from send/recv, a communication logger, bandwidth and cost models),
``model``, ``memory``, ``kernels`` and ``viz``. The grader and the exercises' tests are a
package of their own, ``ultrascale_grading``, which imports this library; the library never
imports it.

The course supports the torch releases from ``SUPPORTED_TORCH[0]`` to ``SUPPORTED_TORCH[1]``:
the oldest is what GPU nodes commonly carry (and ``make test-compat`` tests), the newest is
what the notebooks are saved with. Importing the library checks the installed torch against
that range from its package metadata, without importing torch (which takes a second or two,
and which the runtime starts importing on another core first).
"""

import os
import warnings

__version__ = "0.1.0"
SUPPORTED_TORCH = ("2.11", "2.13")


def _release(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _installed_torch() -> str | None:
    """The installed torch's version, read from its ``torch/version.py`` (a few lines) rather than by
    importing torch or scanning every package's metadata (0.1 s in a large environment)."""
    import importlib.util
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text()
    except OSError:
        return None
    found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.MULTILINE)
    return found.group(1) if found else None


def check_torch_version(version: str | None = None) -> None:
    """Refuse a torch older than the course supports; warn about one newer than it was tested with.

    ``version`` defaults to the installed torch's (None: torch missing, left to the import
    that needs it)."""
    if version is None:
        version = _installed_torch()
        if version is None:
            return
    oldest, newest = (_release(v) for v in SUPPORTED_TORCH)
    supported = f"{SUPPORTED_TORCH[0]} to {SUPPORTED_TORCH[1]}"
    if _release(version) < oldest:
        raise ImportError(
            f"ultrascale needs torch {supported}; this Python has torch {version}. Create the course's "
            f"environment with `make setup` (a CPU machine gets torch 2.13.0), or upgrade the node's torch "
            f"to {SUPPORTED_TORCH[0]} or newer."
        )
    if _release(version) > newest:
        warnings.warn(
            f"ultrascale is tested with torch {supported}; this Python has torch {version}. It should work, "
            "but a saved output or a PyTorch API may differ: if a chapter fails, try torch "
            f"{SUPPORTED_TORCH[1]} and report what differed.",
            stacklevel=2,
        )


check_torch_version()


def _threads_wait_passively() -> None:
    """Let torch's idle OpenMP threads sleep, not spin (unless the user chose otherwise).

    A notebook's kernel, its ranks and (in the tests) a second notebook share a few cores. By
    default an OpenMP thread that finishes its part of a parallel region spins while it waits for
    the others; when one of them has no core, the spinner burns its core waiting for it. On 2
    busy cores a loop of small matmuls then took 24 s instead of 0.1 s. ``OMP_WAIT_POLICY=PASSIVE``
    makes waiting threads sleep, which changes no result (the same threads split the same work).
    OpenMP reads it once, when torch loads it: the course imports ``ultrascale`` before torch
    (``from ultrascale.runtime import Cluster`` first), and the ranks and kernels it starts inherit it."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


_threads_wait_passively()
