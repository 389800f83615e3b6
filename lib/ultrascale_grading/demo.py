"""``skip_if_not_implemented``: a demo cell that waits for its exercise instead of failing.

A demo cell calls the learner's function to show what it does. In a fresh exercise
notebook that function is still a stub raising ``NotImplementedError``, and a cell
that raises stops Jupyter's "Run All" before it reaches the ``check`` cells. So
demo cells put their work in a ``with`` block::

    with skip_if_not_implemented():
        print(pipeline_stage_layers(10, 4))

If a stub raises ``NotImplementedError`` (in this process, or on the ranks of
``cluster.run``, which report it inside a ``RankError``), the rest of the block is
skipped, one line says which function is missing, and the notebook goes on. Any
other exception is a real error in the learner's code and goes through unchanged.
Once the function is written the block runs as if the ``with`` were not there.
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager

from .check import error_chain, is_not_implemented

# The last frame of a remote traceback, as the runtime formats it.
_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)', re.MULTILINE)


@contextmanager
def skip_if_not_implemented():
    """Run the block; if an exercise stub raises, print ``not implemented yet: <function>``."""
    try:
        yield
    except Exception as err:
        if not is_not_implemented(err):
            raise
        namespace = sys._getframe(2).f_globals  # the notebook's: the cell with the ``with``
        print(f"not implemented yet: {_stub_name(err, namespace)} (this demo runs once you have written it)")


def _stub_name(err: BaseException, namespace: dict) -> str:
    """The function whose stub raised: from the local traceback, or the ranks' one."""
    for exc in error_chain(err):
        if isinstance(exc, NotImplementedError) and exc.__traceback__ is not None:
            tb = exc.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            code = tb.tb_frame.f_code
            return getattr(code, "co_qualname", code.co_name)  # Python 3.11+: Class.method
        failures = getattr(exc, "failures", None) or {}
        for rank in sorted(failures):
            frames = list(_FRAME_RE.finditer(failures[rank].traceback or ""))
            if frames and failures[rank].type_name == "NotImplementedError":
                last = frames[-1]
                return _qualified(last["name"], last["file"], int(last["line"]), namespace)
    return "an exercise function"


def _qualified(name: str, filename: str, line: int, namespace: dict) -> str:
    """``__init__`` -> ``OverlappedGradSync.__init__``: a remote traceback names only the
    function, so find the notebook class whose method of that name holds the line."""
    for value in list(namespace.values()):
        method = value.__dict__.get(name) if isinstance(value, type) else None
        method = getattr(method, "__func__", method)  # a staticmethod or classmethod wraps the function
        code = getattr(method, "__code__", None)
        if code is not None and code.co_filename == filename and line in {n for _, _, n in code.co_lines()}:
            return f"{value.__name__}.{name}"
    return name
