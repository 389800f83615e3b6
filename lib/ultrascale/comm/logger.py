"""A communication logger: which operation ran, how many bytes it moved, how long it took.

Use it as a context manager on every rank::

    with CommLogger() as log:
        ring_all_reduce(grad)          # our ring: logs the real bytes it sent and received
        dist.all_reduce(grad)          # a built-in: logs the ring algorithm's volume
    print(log.summary())

Two kinds of byte counts end up in the log, and the ``source`` column says which:

* ``"measured"``: our hand-written collectives (see ``ring.py``) and point-to-point
  calls (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``) report the
  bytes of the tensors actually handed to send and receive.
* ``"algorithmic"``: a built-in collective such as ``dist.all_reduce`` runs inside the
  backend (gloo, NCCL), where we cannot see its messages. We log the traffic per rank
  of the textbook algorithm for that operation: a ring for all-reduce (``2 (N-1) K / N``
  for ``K`` bytes on ``N`` ranks), reduce-scatter and all-gather (``(N-1) K / N``), a
  chain from the root for broadcast and reduce, direct sends for gather, scatter and
  all-to-all. The backend may really use a tree or a different split, so read these
  numbers as the algorithm's volume, not a packet count.

While the context is open the built-ins listed in ``_VOLUME`` are replaced by logging
wrappers in ``torch.distributed``; leaving the outermost logger puts the originals back.
Times are wall-clock on the calling rank. For ``async_op=True`` and for ``isend`` /
``irecv`` they measure only the launch, since the transfer finishes at ``wait()``; on
CUDA tensors we synchronize the device around blocking calls so the time is real.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


@dataclass
class CommEvent:
    """One logged communication call on one rank."""

    op: str
    rank: int
    world_size: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    source: str  # "measured" or "algorithmic" (see the module docstring)
    numel: int = 0  # elements of the collective's whole buffer (K in the book's formulas)
    start: float = 0.0  # time.perf_counter() when the call began (the Timeline's clock)


# --------------------------------------------------------------------------------------
# Global (per process) state: which loggers are open and which operation is running.
# Each rank is its own process, so plain module globals are per rank.
# --------------------------------------------------------------------------------------
_active_loggers: list["CommLogger"] = []
_current_event: CommEvent | None = None  # the operation in progress, if any
_label: str | None = None  # the name built-ins are logged under inside labelled(...)
_originals: dict[str, object] = {}  # name -> original torch.distributed function


def _group_rank_and_size(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _sync_if_cuda(tensors) -> None:
    # A CUDA collective returns before the GPU has finished; wait so the time is honest.
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def wait_for_device(device=None) -> None:
    """Wait until the GPU has done the work queued so far, before reading a clock: CUDA calls
    return when their kernels are queued, not when they finish. ``device``: the device the
    timed work runs on; None: whatever GPU this process has used. Nothing to wait for on a CPU."""
    if device is not None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def record_op(op: str, group=None):
    """Time a hand-written collective; ``count_p2p`` calls inside it add their bytes.

    Costs almost nothing when no logger is open. When called inside another logged
    operation (a collective built from other collectives) the bytes go to the outer one.
    """
    global _current_event
    if not _active_loggers or _current_event is not None:
        yield
        return
    _, size = _group_rank_and_size(group)
    event = CommEvent(op, dist.get_rank() if dist.is_initialized() else 0, size, 0, 0, 0.0, "measured")
    _current_event = event
    wait_for_device()  # earlier GPU work is not this operation's
    start = time.perf_counter()
    try:
        yield
    finally:
        wait_for_device()
        event.seconds = time.perf_counter() - start
        _current_event = None
        for logger in _active_loggers:
            logger.events.append(event)


@contextlib.contextmanager
def labelled(op: str):
    """Log the built-in collectives called inside the block under ``op`` instead of their
    own names, with their usual volumes: a technique's bookkeeping traffic (e.g. ZeRO's
    gradient flags) then stays apart from its main collectives, and out of
    ``CommLogger.collective_elements``."""
    global _label
    previous, _label = _label, op
    try:
        yield
    finally:
        _label = previous


def count_p2p(bytes_sent: int = 0, bytes_received: int = 0) -> None:
    """Add real point-to-point bytes to the operation being recorded (no-op otherwise)."""
    if _current_event is not None:
        _current_event.bytes_sent += bytes_sent
        _current_event.bytes_received += bytes_received


# --------------------------------------------------------------------------------------
# Per-rank traffic of each built-in, as (bytes_sent, bytes_received).
# ``a`` holds the call's arguments by name; r and n are the rank and size in the group.
# --------------------------------------------------------------------------------------
def _ring(share: float, total_bytes: int, n: int) -> tuple[int, int]:
    # A ring moves ``share * (n-1)/n`` of the full buffer through every rank, both ways.
    volume = int(share * (n - 1) * total_bytes) // n
    return volume, volume


def _chain(position: int, n: int, nbytes: int, towards_root: bool) -> tuple[int, int]:
    # Broadcast (and reduce, mirrored) as a pipeline along the ring starting at the root:
    # every rank but the last passes K bytes on, every rank but the root receives K.
    first, last = position == 0, position == n - 1
    sent = 0 if last else nbytes
    received = 0 if first else nbytes
    return (received, sent) if towards_root else (sent, received)


def _root_position(a: dict, r: int, n: int, key: str) -> int:
    """Where this rank sits in the chain that starts at the root (``src`` or ``dst``)."""
    group, group_root = a.get("group"), a.get("group_" + key)
    if group_root is None:
        root = a.get(key) or 0
        group_root = dist.get_group_rank(group, root) if group is not None else root
    return (r - group_root) % n


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _broadcast(a, r, n):
    return _chain(_root_position(a, r, n, "src"), n, _nbytes([a["tensor"]]), towards_root=False)


def _reduce(a, r, n):
    return _chain(_root_position(a, r, n, "dst"), n, _nbytes([a["tensor"]]), towards_root=True)


def _gather(a, r, n):
    # Every rank sends its tensor straight to the root, which receives N - 1 of them.
    k = _nbytes([a["tensor"]])
    return (0, (n - 1) * k) if _root_position(a, r, n, "dst") == 0 else (k, 0)


def _scatter(a, r, n):
    k = _nbytes([a["tensor"]])
    return ((n - 1) * k, 0) if _root_position(a, r, n, "src") == 0 else (0, k)


def _all_to_all(a, r, n):
    # Everything but the piece a rank keeps for itself leaves (and arrives).
    inputs, outputs = a["input_tensor_list"], a["output_tensor_list"]
    return _nbytes(inputs) - _nbytes([inputs[r]]), _nbytes(outputs) - _nbytes([outputs[r]])


def _own_piece(t, splits, r, n) -> int:
    if not splits:
        return _nbytes([t]) // n
    return splits[r] * (_nbytes([t]) // max(t.shape[0], 1))


def _all_to_all_single(a, r, n):
    inp, out = a["input"], a["output"]
    return (
        _nbytes([inp]) - _own_piece(inp, a.get("input_split_sizes"), r, n),
        _nbytes([out]) - _own_piece(out, a.get("output_split_sizes"), r, n),
    )


def _p2p_batch(a, r, n):
    sent = sum(_nbytes([p.tensor]) for p in a["p2p_op_list"] if p.op.__name__ == "isend")
    received = sum(_nbytes([p.tensor]) for p in a["p2p_op_list"] if p.op.__name__ == "irecv")
    return sent, received


_VOLUME = {
    # collectives run by the backend: the ring algorithm's volume
    "all_reduce": lambda a, r, n: _ring(2, _nbytes([a["tensor"]]), n),
    "reduce_scatter_single": lambda a, r, n: _ring(1, _nbytes([a["input"]]), n),
    "reduce_scatter_tensor": lambda a, r, n: _ring(1, _nbytes([a["input"]]), n),
    "reduce_scatter": lambda a, r, n: _ring(1, _nbytes(a["input_list"]), n),
    "all_gather_single": lambda a, r, n: _ring(1, _nbytes([a["output_tensor"]]), n),
    "all_gather_into_tensor": lambda a, r, n: _ring(1, _nbytes([a["output_tensor"]]), n),
    "all_gather": lambda a, r, n: _ring(1, _nbytes(a["tensor_list"]), n),
    "broadcast": _broadcast,
    "reduce": _reduce,
    # gather / scatter / all-to-all are direct exchanges: their volume is exact
    "gather": _gather,
    "scatter": _scatter,
    "all_to_all_single": _all_to_all_single,
    "all_to_all": _all_to_all,
    "barrier": lambda a, r, n: (0, 0),
    # point-to-point: the real tensors
    "send": lambda a, r, n: (_nbytes([a["tensor"]]), 0),
    "isend": lambda a, r, n: (_nbytes([a["tensor"]]), 0),
    "recv": lambda a, r, n: (0, _nbytes([a["tensor"]])),
    "irecv": lambda a, r, n: (0, _nbytes([a["tensor"]])),
    "batch_isend_irecv": _p2p_batch,
}
_POINT_TO_POINT = {"send", "isend", "recv", "irecv", "batch_isend_irecv"}

# The whole buffer of each collective, as the book sizes it: the tensor an all-reduce
# reduces, the full input a reduce-scatter splits, the full output an all-gather fills.
_BUFFER = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "reduce_scatter_single": "input",
    "reduce_scatter_tensor": "input",
    "all_gather_single": "output_tensor",
    "all_gather_into_tensor": "output_tensor",
}


def base_op(name: str) -> str:
    """The collective behind a function name: all_gather_into_tensor -> all_gather."""
    for suffix in ("_into_tensor", "_tensor", "_single"):
        if name.endswith(suffix) and not name.startswith("all_to_all"):
            return name[: -len(suffix)]
    return name


def _logging_wrapper(name: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        global _current_event
        if _current_event is not None:  # inside a logged op: it counts its own bytes
            return original(*args, **kwargs)
        a = signature.bind(*args, **kwargs).arguments
        if name == "batch_isend_irecv":
            _normalise_p2p_ops(a["p2p_op_list"])
        group = a.get("group")
        if name == "batch_isend_irecv" and a["p2p_op_list"]:
            group = a["p2p_op_list"][0].group
        r, n = _group_rank_and_size(group)
        sent, received = _VOLUME[name](a, r, n)
        source = "measured" if name in _POINT_TO_POINT else "algorithmic"
        numel = a[_BUFFER[name]].numel() if name in _BUFFER else 0
        event = CommEvent(_label or name, dist.get_rank(), n, sent, received, 0.0, source, numel)
        tensors = [v for v in a.values() if isinstance(v, torch.Tensor)]
        blocking = not a.get("async_op", False) and name not in ("isend", "irecv", "batch_isend_irecv")
        if blocking:
            _sync_if_cuda(tensors)
        _current_event = event
        start = event.start = time.perf_counter()
        try:
            result = original(*args, **kwargs)
            if blocking:
                _sync_if_cuda(tensors)
        finally:
            event.seconds = time.perf_counter() - start
            _current_event = None
        for logger in _active_loggers:
            logger.events.append(event)
            if blocking and logger.timeline is not None:  # a bar in the Timeline's communication lane
                logger.timeline.add(
                    "communication", event.op, event.start, event.start + event.seconds, event.bytes_sent
                )
        return result

    return wrapper


def _normalise_p2p_ops(ops) -> None:
    # batch_isend_irecv tells sends from receives with ``op.op is isend``; a P2POp built
    # before the logger opened holds the original function, so point it at the wrapper.
    for p in ops:
        p.op = getattr(c10d, p.op.__name__)


def _install_wrappers() -> None:
    for name in _VOLUME:
        original = getattr(dist, name, None)
        if original is None:  # not in this torch version (e.g. the *_single names)
            continue
        _originals[name] = original
        wrapper = _logging_wrapper(name, original)
        setattr(dist, name, wrapper)
        # Patch the defining module too: P2POp and batch_isend_irecv look isend/irecv up there.
        if getattr(c10d, name, None) is original:
            setattr(c10d, name, wrapper)


def _remove_wrappers() -> None:
    for name, original in _originals.items():
        if getattr(c10d, name, None) is getattr(dist, name):
            setattr(c10d, name, original)
        setattr(dist, name, original)
    _originals.clear()


class CommLogger:
    """Collects a ``CommEvent`` for every communication call made on this rank.

    Loggers nest: each open logger receives every event, and the built-ins are
    wrapped only once, while at least one logger is open.
    ``timeline``: a ``parallel.Timeline`` that also gets a communication bar for every
    blocking call (an async one ends at ``wait()``: record it with
    ``Timeline.communication``), so collectives called deep inside a model, such as
    tensor parallelism's, appear on the same per-rank Gantt chart as the compute.
    """

    def __init__(self, timeline=None) -> None:
        self.events: list[CommEvent] = []
        self.timeline = timeline

    def __enter__(self) -> "CommLogger":
        if not _active_loggers:
            _install_wrappers()
        _active_loggers.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active_loggers.remove(self)
        if not _active_loggers:
            _remove_wrappers()

    # ---- reading the log --------------------------------------------------------------
    def clear(self) -> None:
        self.events.clear()

    def rows(self) -> list[dict]:
        """The events as plain dicts (picklable: return them from ``cluster.run``)."""
        return [asdict(e) for e in self.events]

    def totals(self) -> dict[str, dict]:
        """Per operation: number of calls, bytes sent and received, seconds."""
        table: dict[str, dict] = {}
        for e in self.events:
            row = table.setdefault(
                e.op, {"calls": 0, "bytes_sent": 0, "bytes_received": 0, "seconds": 0.0, "source": e.source}
            )
            row["calls"] += 1
            row["bytes_sent"] += e.bytes_sent
            row["bytes_received"] += e.bytes_received
            row["seconds"] += e.seconds
        return table

    def collective_elements(self) -> dict:
        """Calls and buffer elements per collective, in the units of the ZeRO formulas.

        ``{op: calls, f"{op} elements": elements of the whole buffers, "elements": their
        sum}``, with op the collective (all_gather, reduce_scatter, all_reduce, ...). An
        all-reduce counts twice in "elements": a ring all-reduce is a reduce-scatter
        followed by an all-gather, so it moves 2Ψ where each of those moves Ψ.
        """
        out: dict = {}
        for e in self.events:
            if e.numel and e.op in _BUFFER:  # not a labelled(...) one
                op = base_op(e.op)
                out[op] = out.get(op, 0) + 1
                out[op + " elements"] = out.get(op + " elements", 0) + e.numel
                out["elements"] = out.get("elements", 0) + e.numel * (2 if op == "all_reduce" else 1)
        return out

    @property
    def bytes_sent(self) -> int:
        return sum(e.bytes_sent for e in self.events)

    @property
    def bytes_received(self) -> int:
        return sum(e.bytes_received for e in self.events)

    def summary(self) -> str:
        """A text table of the totals per operation on this rank."""
        header = f"{'op':<24}{'calls':>7}{'sent':>12}{'received':>12}{'time (ms)':>11}  source"
        lines = [header, "-" * len(header)]
        for op, t in self.totals().items():
            lines.append(
                f"{op:<24}{t['calls']:>7}{format_bytes(t['bytes_sent']):>12}"
                f"{format_bytes(t['bytes_received']):>12}{1e3 * t['seconds']:>11.3f}"
                f"  {t['source']}"
            )
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units, as the sizes in the sweeps)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
