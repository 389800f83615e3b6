"""Guards the exercise tests put around a learner's code, so that a wrong answer cannot pass.

* :func:`without_library` wraps a learner's function so that, while it runs, calling
  the course library's own implementation of the exercise (``count_params`` for the
  parameter count, ...) fails with a clear message, however it was imported.
* :func:`expect_value_error` calls a learner's function on an input it must refuse,
  and names that input and what was expected when something else happens.
* :func:`call_learner` calls a learner's function and, when it raises, names the input.
* :func:`forbid_collectives` makes every built-in collective raise while a learner's code
  runs on a rank (an exercise that asks for a ring built from sends and receives).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterable


class ForbiddenCall(AssertionError):
    """Raised inside a learner's code when it calls a library function the exercise forbids.

    An ``AssertionError``, so that ``check`` reports it as a failed exercise with its message.
    """


def _refusing_code(message: str):
    # The code object runs with the library function's globals, where this module's names are
    # unknown: the exception class is imported by name, and the message is a constant.
    source = (
        "def refuse(*args, **kwargs):\n"
        "    raise __import__('ultrascale_grading.guards', fromlist=['ForbiddenCall'])"
        f".ForbiddenCall({message!r})\n"
    )
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102 (a constant template, no learner input)
    return namespace["refuse"].__code__


def _forbidden_message(fn: Callable, exercise_id: str, hint: str) -> str:
    where = f"{fn.__module__}.{fn.__qualname__}"
    return (
        f"{exercise_id}: your code called the course library's {where} (directly, or through another "
        f"library function that uses it). This exercise asks you to compute it yourself"
        + (f": {hint}" if hint else ".")
    )


@contextlib.contextmanager
def forbid_library(functions: Iterable[Callable], exercise_id: str, hint: str = ""):
    """While the context is open, calling any of ``functions`` raises :class:`ForbiddenCall`.

    The function objects themselves are changed (their code is swapped for one that
    raises, and put back on exit), so the refusal reaches every name they are known
    by: ``from ultrascale.model import count_params`` in a notebook included. Only
    plain module-level functions (no closure) can be forbidden, and classes: building
    one (its ``__init__``, and so its subclasses') is refused.
    """
    saved, classes = [], []
    try:
        for fn in dict.fromkeys(functions):
            if isinstance(fn, type):  # a class: building one is refused (its __init__ is swapped)
                classes.append((fn, fn.__dict__.get("__init__")))
                fn.__init__ = _refusing_init(_forbidden_message(fn, exercise_id, hint))
                continue
            if fn.__closure__ is not None:
                raise TypeError(f"cannot forbid {fn.__qualname__}: it is a closure")
            saved.append((fn, fn.__code__))
            fn.__code__ = _refusing_code(_forbidden_message(fn, exercise_id, hint))
        yield
    finally:
        for fn, code in reversed(saved):
            fn.__code__ = code
        for cls, init in reversed(classes):
            if init is None:
                del cls.__init__  # it inherited its __init__: inherit it again
            else:
                cls.__init__ = init


def _refusing_init(message: str):
    def refuse(self, *args, **kwargs):
        raise ForbiddenCall(message)

    return refuse


def without_library(learner_fn: Callable, functions: Iterable[Callable], exercise_id: str, hint: str = "") -> Callable:
    """``learner_fn``, with ``functions`` forbidden while each call of it runs."""
    functions = tuple(functions)

    @functools.wraps(learner_fn)
    def guarded(*args, **kwargs):
        with forbid_library(functions, exercise_id, hint):
            return learner_fn(*args, **kwargs)

    return guarded


def _call_text(name: str, args: tuple, kwargs: dict) -> str:
    parts = [repr(a) if isinstance(a, str) else str(a) for a in args]
    parts += [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def _reraise_untouched(err: BaseException) -> bool:
    # A stub not filled in yet (check reports "not implemented"), a failed check or a
    # forbidden call already says what is wrong.
    return isinstance(err, (NotImplementedError, AssertionError))


def call_learner(fn: Callable, *args, call: str | None = None, expected: str = "", passthrough: tuple = (), **kwargs):
    """``fn(*args, **kwargs)``; when it raises, say on which input and what was expected.

    Exceptions of the types in ``passthrough`` (e.g. an expected ``ValueError``) are
    re-raised as they are, for the caller to judge.
    """
    try:
        return fn(*args, **kwargs)
    except Exception as err:
        if _reraise_untouched(err) or isinstance(err, passthrough):
            raise
        call = call or _call_text(getattr(fn, "__name__", "your function"), args, kwargs)
        raise AssertionError(
            f"{call} raised {type(err).__name__}: {err}" + (f"; expected {expected}" if expected else "")
        ) from err


def expect_value_error(fn: Callable, *args, why: str, call: str | None = None, **kwargs) -> None:
    """``fn(*args, **kwargs)`` must raise ``ValueError``; ``why`` says why this input is invalid."""
    call = call or _call_text(getattr(fn, "__name__", "your function"), args, kwargs)
    try:
        result = fn(*args, **kwargs)
    except ValueError:
        return
    except Exception as err:
        if _reraise_untouched(err):
            raise
        raise AssertionError(
            f"{call} raised {type(err).__name__}: {err}; expected a ValueError, because "
            f"{why}. Check the input first and `raise ValueError(...)` with a message that "
            "says what is wrong"
        ) from err
    raise AssertionError(f"{call} returned {result!r}; it should raise ValueError, because {why}")


# ---- the built-in collectives ---------------------------------------------------------------

# torch.distributed's functions that move data between several ranks at once. Point-to-point
# calls (send, recv, isend, irecv, batch_isend_irecv) and barrier stay available.
DIST_COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "all_reduce_coalesced",
    "all_gather_coalesced",
)
# The same, as methods of a ProcessGroup (``ctx.group.allreduce([t])``) or of its backend
# (``group._get_backend(device).allreduce([t])``), which torch.distributed's functions call.
GROUP_COLLECTIVES = (
    "broadcast",
    "allreduce",
    "allreduce_coalesced",
    "reduce",
    "allgather",
    "all_gather_single",
    "_allgather_base",
    "allgather_coalesced",
    "all_gather_single_coalesced",
    "allgather_into_tensor_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "alltoall_base",
    "alltoall",
)
# The dispatcher's operators behind them all (``torch.ops.c10d.allreduce_``, the functional
# collectives' ``torch.ops._c10d_functional.all_reduce``), but the point-to-point ones.
COLLECTIVE_OP_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
POINT_TO_POINT_OPS = (
    "send",
    "recv_",
    "recv_any_source_",
    "isend",
    "irecv",
    "batch_p2p_ops",
    "barrier",
    "monitored_barrier_",
    "wait_tensor",
    "check_for_nan",
)


@contextlib.contextmanager
def forbid_collectives(who: str, advice: str, error: type = ForbiddenCall):
    """While open, every built-in collective raises ``error(f"{who} called NAME: {advice}")``.

    Three doors lead to a collective, and each is closed: torch.distributed's functions
    (swapped in ``torch.distributed`` and its defining module, so ``from torch.distributed
    import all_reduce`` is caught when it runs after the swap), the methods of the process
    group and of its backend classes, and the dispatcher's operators as Python reaches them
    (``torch.ops.c10d.*``, which the functional collectives use too). Open it on the rank,
    around the learner's code only. (A ``TorchDispatchMode`` would see the operators however
    they are reached, but its first use imports torch._dynamo: seconds on every new rank.)
    """

    def refusal(name: str) -> BaseException:
        return error(f"{who} called {name}: {advice}")

    with contextlib.ExitStack() as stack:
        stack.enter_context(_swapped_dist_functions(refusal))
        stack.enter_context(_swapped_group_methods(refusal))
        stack.enter_context(_refusing_collective_ops(refusal))
        yield


@contextlib.contextmanager
def swapped_dist_functions(names, stand_in_for: Callable):
    """While open, each ``torch.distributed`` function of ``names`` is replaced by
    ``stand_in_for(name, original)``, in ``torch.distributed`` and in its defining module (so
    ``from torch.distributed import all_reduce`` run after the swap gets the stand-in too).
    Names this torch lacks are skipped."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    saved = []
    try:
        for name in names:
            original = getattr(dist, name, None)
            if original is None:  # not in this torch version
                continue
            stand_in = stand_in_for(name, original)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    saved.append((module, name, original))
                    setattr(module, name, stand_in)
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def _swapped_dist_functions(refusal: Callable):
    return swapped_dist_functions(
        DIST_COLLECTIVES, lambda name, original: _refusing_function(f"dist.{name}", original, refusal)
    )


def _refusing_function(name: str, original: Callable, refusal: Callable) -> Callable:
    @functools.wraps(original)  # keeps the signature, which a CommLogger reads
    def refuse(*args, **kwargs):
        raise refusal(name)

    return refuse


@contextlib.contextmanager
def _swapped_group_methods(refusal: Callable):
    from torch._C import _distributed_c10d as C

    classes = [c for c in vars(C).values() if isinstance(c, type) and issubclass(c, (C.ProcessGroup, C.Backend))]
    saved = []
    try:
        for cls in classes:
            for name in GROUP_COLLECTIVES:
                if name in cls.__dict__:
                    saved.append((cls, name, cls.__dict__[name]))
                    setattr(cls, name, _refusing_method(f"{cls.__name__}.{name}", refusal))
        yield
    finally:
        for cls, name, original in reversed(saved):
            setattr(cls, name, original)


def _refusing_method(name: str, refusal: Callable) -> Callable:
    def refuse(self, *args, **kwargs):
        raise refusal(name)

    return refuse


@contextlib.contextmanager
def _refusing_collective_ops(refusal: Callable):
    import torch

    saved = []
    try:
        for qualified in torch._C._dispatch_get_all_op_names():
            namespace, _, op = qualified.partition("::")
            if namespace in COLLECTIVE_OP_NAMESPACES and op not in POINT_TO_POINT_OPS:
                space = getattr(torch.ops, namespace)
                saved.append((space, op, getattr(space, op)))  # the packet, cached on the namespace
                setattr(space, op, _RefusedOp(f"torch.ops.{namespace}.{op}", refusal))
        yield
    finally:
        for space, op, packet in reversed(saved):
            setattr(space, op, packet)


class _RefusedOp:
    """Stands in for an operator packet: calling it, or one of its overloads, raises."""

    def __init__(self, name: str, refusal: Callable):
        self._name, self._refusal = name, refusal

    def __call__(self, *args, **kwargs):
        raise self._refusal(self._name)

    def __getattr__(self, overload: str) -> "_RefusedOp":  # torch.ops.c10d.allreduce_.default
        return self
