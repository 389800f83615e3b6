"""Reading one message from a rank's pipe, with a deadline.

``Connection.recv`` blocks until a whole message has arrived, however long that takes,
and an exception in the middle of it (the stop button while 100 MB of results stream
in) leaves the rest of that message in the pipe, where the next read takes it for the
start of a new one. So the notebook reads with :func:`read_message`, which never waits
past its deadline, and the caller treats any exception from it as the end of that pipe
(``Cluster._lose``: the ranks are killed and restarted on the next call).

The bytes are framed as ``multiprocessing.connection.Connection.send_bytes`` frames them
(the ranks send with ``Connection.send``): a 4-byte big-endian length, or -1 followed by
an 8-byte length for messages over 2 GiB, then the pickle.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import sys
import time
from multiprocessing.connection import wait

# How long a rank may take to finish a message it has started: even 400 MB of results
# arrive in a few seconds on a loaded machine. A rank stalled in the middle of one
# (stopped, swapping) after that is treated as a broken pipe.
MESSAGE_DEADLINE_S = 60.0
_CHUNK = 4 * 2**20


class PipeTimeout(TimeoutError):
    """A message did not arrive (or did not finish arriving) before its deadline."""


def read_message(conn, deadline: float | None = None):
    """The next message on ``conn``; raises :class:`PipeTimeout` past ``deadline``
    (``time.monotonic()`` seconds; default: ``MESSAGE_DEADLINE_S`` from now) and
    ``EOFError`` when the other end has closed."""
    if deadline is None:
        deadline = time.monotonic() + MESSAGE_DEADLINE_S
    if sys.platform == "win32":  # named pipes, framed by Windows: wait for the start only
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise PipeTimeout("no message before the deadline")
        return conn.recv()
    fd = conn.fileno()
    (size,) = struct.unpack("!i", _read_exactly(conn, fd, 4, deadline))
    if size == -1:
        (size,) = struct.unpack("!Q", _read_exactly(conn, fd, 8, deadline))
    return pickle.loads(_read_exactly(conn, fd, size, deadline))


def _read_exactly(conn, fd: int, size: int, deadline: float) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        if not _readable(conn, fd, deadline):
            raise PipeTimeout(f"a message stopped arriving after {got} of {size} bytes")
        n = os.readv(fd, [view[got : got + _CHUNK]])
        if n == 0:
            raise EOFError(f"the pipe closed after {got} of {size} bytes of a message")
        got += n
    return buffer


def _readable(conn, fd: int, deadline: float) -> bool:
    """True once ``fd`` has bytes (or its end closed), False at the deadline. Usually the bytes
    are there already: ``select.poll`` answers that in microseconds, a selector in tens."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    if not hasattr(select, "poll"):
        return bool(wait([conn], left))
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(left * 1000))
