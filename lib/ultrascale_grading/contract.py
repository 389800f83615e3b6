"""The contract every learner function is held to, whatever exercise it answers.

An exercise's test checks the technique: the numbers, the collectives, the bytes. This module
checks what any caller of any function expects, in one place, so that no exercise has to think
of it (and none can forget it). Each learner function given to ``check`` is wrapped
(:func:`guarded`) before the exercise's test sees it; every call of it, in the notebook's process
or on a rank, then checks that:

* **its inputs are left as they were**: tensors (values, dtype, shape), their gradients, lists,
  tuples, dicts and sets (nested), dataclasses and the parameters of a module, compared before
  and after the call. An exercise whose text says the function updates an argument in place
  declares it (``updates``);
* **what it returns is new storage**: no returned tensor shares memory with an input tensor or a
  parameter of an input module (a view of the caller's data, written later by one side, changes
  the other). An exercise may allow it (``returns_inputs``);
* **no state is kept in a mutable default** (``def f(x, cache={})``): such a default is made once
  and shared by every call, so an answer cached in it leaks into the next call. The runtime
  unpickles a fresh copy of the function for each call on a rank, so only this check sees it
  there;
* on a rank, where the exercise names the collectives its technique is made of (``collectives``),
  **the call uses them and no other** (logged by the course's ``CommLogger``): an all-gather and
  a local mean give an all-reduce's numbers with other bytes;
* off a rank (where a call sends nothing), once the exercise's own cases have passed, **the first
  call is made twice** on fresh copies of
  the same inputs, and must give the same result (unless a function is among its inputs: a clock
  or a workload may rightly answer differently the second time); and where a caller may pass any iterable
  (``iterables``: the exercise says "a sequence of ..."), once more with generators in their
  place.

Failures are ``AssertionError``s whose message names the function, the argument and what
changed, so ``check`` reports them as failed exercises with advice, like any test's.
Each exercise's allowances are in :data:`CONTRACTS`, and its text says the same.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
from typing import Any, Callable

import torch


@dataclasses.dataclass(frozen=True)
class Contract:
    """What an exercise allows its functions beyond the default (nothing)."""

    updates: tuple[str, ...] = ()  # arguments it updates in place, by name ("params.grad": their
    # gradients only)
    returns_inputs: bool = False  # may return its inputs, or views of them
    iterables: tuple[str, ...] = ()  # arguments a caller may pass as any iterable
    repeat: bool = True  # off a rank, the first call is made twice
    # On a rank, the collectives the technique is made of: each call must use every one of
    # ``collectives`` ("a|b": either) and no other collective (point-to-point calls are free),
    # by base name (all_gather for all_gather_into_tensor, ...); empty: not checked here.
    collectives: tuple[str, ...] = ()


STRICT = Contract()

# Exercise id -> what its functions may do beyond the strict contract. The exercise's text in
# solutions/ says the same (tests/test_contract.py checks that each named argument exists).
CONTRACTS: dict[str, Contract] = {
    "00.mean_across_ranks": Contract(collectives=("all_reduce",)),
    # leaves the batch's gradient in .grad; the test counts the forward passes, so one call only
    "01.grad_accumulation": Contract(updates=("model.grad",), repeat=False),
    # the buckets hold the caller's own parameters, which may come from model.parameters()
    "02.assign_buckets": Contract(returns_inputs=True, iterables=("params",)),
    "03.flatten_padded": Contract(iterables=("tensors",)),
    # the step writes the new weights into the parameters and the master slice
    "03.zero1_step": Contract(updates=("params", "master"), collectives=("reduce_scatter", "all_gather")),
    "03.shard_gradient": Contract(collectives=("reduce_scatter",)),
    "06.ulysses_attention": Contract(collectives=("all_to_all|all_to_all_single",)),
    # the first stage's input is the caller's tensor, returned as the stage input
    "07.stage_step": Contract(returns_inputs=True),
    # W adds to the weights' .grad
    "07.split_backward": Contract(updates=("params.grad",)),
    "08.split_sizes": Contract(collectives=("all_to_all|all_to_all_single",)),
    "08.dispatch_combine": Contract(collectives=("all_to_all|all_to_all_single",)),
    "10.memory_filter": Contract(iterables=("configs",)),
    "a1.launched_by": Contract(iterables=("events",)),
    "a1.communication_overlap": Contract(iterables=("compute", "communication")),
    "a3.bucketed_exposure": Contract(iterables=("backward_times",)),
}


def contract_of(exercise_id: str) -> Contract:
    return CONTRACTS.get(exercise_id, STRICT)


def is_learner_function(obj: Any) -> bool:
    """A plain function the learner wrote (not a class, not a library function, not a kernel)."""
    module = getattr(obj, "__module__", "") or ""
    return inspect.isfunction(obj) and not module.startswith(("ultrascale.", "ultrascale_grading."))


def guard_objects(exercise_id: str, objects: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``objects`` and ``kwargs`` with each learner function wrapped by :func:`guarded`."""
    contract = contract_of(exercise_id)

    def wrap(obj):
        return guarded(obj, exercise_id, contract) if is_learner_function(obj) else obj

    return tuple(wrap(o) for o in objects), {k: wrap(v) for k, v in kwargs.items()}


def guarded(fn: Callable, exercise_id: str, contract: Contract = STRICT) -> Callable:
    """``fn`` held to ``contract`` on every call (see the module's docstring)."""
    state = {"first": True}
    signature = inspect.signature(fn)  # read once: the wrapper runs on every call

    @functools.wraps(fn)
    def call(*args, **kwargs):
        named = _named_arguments(signature, args, kwargs)
        repeat_with = None
        if state["first"] and contract.repeat and not _on_a_rank() and not _any_callable(named):
            repeat_with = _copied(args, kwargs)
        state["first"] = False
        before = {
            name: _snapshot(value, grads=f"{name}.grad" not in contract.updates)
            for name, value in named.items()
            if name not in contract.updates
        }
        defaults_before = _snapshot(_mutable_defaults(signature))
        who = f"{exercise_id}: your `{getattr(fn, '__name__', 'function')}`"
        if contract.collectives and _on_a_rank():
            result = _with_signature(who, contract.collectives, fn, args, kwargs)
        else:
            result = fn(*args, **kwargs)
        _check_defaults(who, signature, defaults_before)
        for name, snap in before.items():
            change = _difference(snap, named[name])
            if change:
                raise AssertionError(
                    f"{who} changed its argument `{name}`{change}. The caller still needs its input as it "
                    "was: work on a copy (`t.clone()`, `sorted(xs)`, `dict(d)`) or build a new result"
                    + (f" (this exercise lets it update only {_names(contract.updates)})" if contract.updates else "")
                )
        if not contract.returns_inputs:
            _check_new_storage(who, result, named)
        if repeat_with is not None:  # checked once the exercise's own cases have passed (see below);
            # the result as it was returned, before the exercise's test could touch it
            call.deferred.append(
                functools.partial(_check_repeat, who, fn, signature, _snapshot(result), repeat_with, contract)
            )
        return result

    call.deferred = []
    return call


def run_deferred(objects: tuple, kwargs: dict) -> None:
    """The second calls of the learner's functions (same inputs, then generators), made after
    the exercise's test has passed: a wrong answer is first told what its test finds wrong,
    the more specific message, and only a right one is then held to these."""
    for obj in list(objects) + list(kwargs.values()):
        for deferred_check in getattr(obj, "deferred", ()):
            deferred_check()


# ---- what a call changed ----------------------------------------------------------------


def _named_arguments(signature: inspect.Signature, args, kwargs) -> dict:
    try:
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):  # the call itself will say what is wrong
        return {f"#{i}": a for i, a in enumerate(args)} | dict(kwargs)
    named = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            named.update({f"{name}[{i}]": v for i, v in enumerate(value)})
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def _snapshot(x: Any, depth: int = 0, grads: bool = True) -> Any:
    """A copy of what ``x`` holds, to compare with after the call (None: not compared);
    ``grads=False`` leaves the tensors' gradients out."""
    if depth > 6:
        return None
    if isinstance(x, torch.Tensor):
        grad = x.grad if grads and x.is_leaf and x.requires_grad else None
        return ("tensor", x.detach().clone(), None if grad is None else grad.detach().clone())
    if isinstance(x, torch.nn.Module):
        return (
            "module",
            {k: _snapshot(t, depth + 1, grads) for k, t in list(x.named_parameters()) + list(x.named_buffers())},
        )
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_snapshot(v, depth + 1, grads) for v in x])
    if isinstance(x, dict):
        return ("dict", {k: _snapshot(v, depth + 1, grads) for k, v in x.items()})
    if isinstance(x, (set, frozenset)):
        return ("set", set(x))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return ("dataclass", {f.name: _snapshot(getattr(x, f.name), depth + 1, grads) for f in dataclasses.fields(x)})
    if isinstance(x, (int, float, complex, str, bytes, bool, type(None))):
        return ("value", x)
    return None  # a group, a context, a generator...: not compared


def _difference(snap: Any, now: Any, where: str = "") -> str:
    """How ``now`` differs from the snapshot taken before the call ('' when it does not)."""
    if snap is None:
        return ""
    kind, held = snap[0], snap[1]
    if kind == "tensor":
        if not isinstance(now, torch.Tensor):
            return f"{where} (it is no longer a tensor)"
        change = _tensor_change(held, now.detach())
        if change:
            return f"{where} ({change})"
        grad = now.grad if now.is_leaf and now.requires_grad else None
        if snap[2] is not None and (grad is None or _tensor_change(snap[2], grad.detach())):
            return f"{where}.grad (its gradient was changed or dropped)"
        return ""
    if kind == "module":
        current = dict(list(now.named_parameters()) + list(now.named_buffers()))
        for name, s in held.items():
            change = _difference(s, current.get(name), f"{where}.{name}")
            if change:
                return change
        return ""
    if kind in ("list", "tuple"):
        if len(now) != len(held):
            return f"{where} (its length went from {len(held)} to {len(now)})"
        for i, (s, v) in enumerate(zip(held, now)):
            change = _difference(s, v, f"{where}[{i}]")
            if change:
                if kind == "list" and _is_reordering(held, now):
                    return f"{where} (its items were reordered in place: `.sort()` or `.reverse()` on it?)"
                return change
        return ""
    if kind == "dict":
        added, removed = set(now) - set(held), set(held) - set(now)
        if added or removed:
            return (
                f"{where} (keys "
                + ", ".join(f"{k!r} added" for k in sorted(added, key=repr))
                + ", ".join(f"{k!r} removed" for k in sorted(removed, key=repr))
                + ")"
            )
        for k, s in held.items():
            change = _difference(s, now[k], f"{where}[{k!r}]")
            if change:
                return change
        return ""
    if kind == "set":
        return "" if set(now) == held else f"{where} (its members changed)"
    if kind == "dataclass":
        for name, s in held.items():
            change = _difference(s, getattr(now, name, None), f"{where}.{name}")
            if change:
                return change
        return ""
    same = held == now or (isinstance(held, float) and isinstance(now, float) and math.isnan(held) and math.isnan(now))
    return "" if same else f"{where} (from {held!r} to {now!r})"


def _tensor_change(before: torch.Tensor, now: torch.Tensor) -> str:
    if now.shape != before.shape:
        return f"its shape went from {tuple(before.shape)} to {tuple(now.shape)}"
    if now.dtype != before.dtype:
        return f"its dtype went from {before.dtype} to {now.dtype}"
    if not _same_tensor(before, now):
        differ = (before != now) & ~(_isnan(before) & _isnan(now))
        i = int(differ.flatten().nonzero()[0]) if differ.any() else 0
        return (
            f"{int(differ.sum())} of its {now.numel()} values changed, the first at flat index {i}: "
            f"{before.flatten()[i].item()!r} became {now.flatten()[i].item()!r}"
        )
    return ""


def _isnan(t: torch.Tensor) -> torch.Tensor:
    return t.isnan() if t.is_floating_point() or t.is_complex() else torch.zeros_like(t, dtype=torch.bool)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        b = b.to(a.device)
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (_isnan(a) & _isnan(b))).all())


def _is_reordering(held: list, now: list) -> bool:
    """The same items in another order (a sort or reverse of the caller's list)."""
    if len(held) > 256 or any(h is None for h in held):
        return False
    unmatched = list(range(len(held)))
    for item in now:
        match = next((j for j in unmatched if not _difference(held[j], item)), None)
        if match is None:
            return False
        unmatched.remove(match)
    return True


def _names(names) -> str:
    return ", ".join(f"`{n}`" for n in names)


# ---- mutable defaults -------------------------------------------------------------------


def _mutable_defaults(signature: inspect.Signature) -> dict:
    return {
        p.name: p.default
        for p in signature.parameters.values()
        if p.default is not inspect.Parameter.empty
        and isinstance(p.default, (list, dict, set, torch.Tensor, torch.nn.Module))
    }


def _check_defaults(who: str, signature: inspect.Signature, before) -> None:
    now = _mutable_defaults(signature)  # its defaults are the function's own objects
    for name, snap in before[1].items():
        if _difference(snap, now[name]):
            raise AssertionError(
                f"{who} changed its default argument `{name}` during the call. A default like `=[]` or `={{}}` is "
                "made once, when `def` runs, and shared by every later call, so what one call leaves in it "
                f"leaks into the next. Write `{name}=None` and make a new one inside the function"
            )


# ---- new storage -------------------------------------------------------------------------


def _tensors(x: Any, where: str = "", depth: int = 0):
    """(path, tensor) for every tensor in ``x`` (nested containers, module parameters)."""
    if depth > 6:
        return
    if isinstance(x, torch.Tensor):
        yield where, x
        if x.is_leaf and x.requires_grad and x.grad is not None:
            yield f"{where}.grad", x.grad
    elif isinstance(x, torch.nn.Module):
        for name, t in list(x.named_parameters()) + list(x.named_buffers()):
            yield from _tensors(t, f"{where}.{name}", depth + 1)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _tensors(v, f"{where}[{i}]", depth + 1)
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _tensors(v, f"{where}[{k!r}]", depth + 1)


def _storage(t: torch.Tensor):
    if t.numel() == 0 or t.layout != torch.strided:
        return None
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None


def _check_new_storage(who: str, result, named: dict) -> None:
    inputs = {}
    for name, value in named.items():
        for path, t in _tensors(value, name):
            key = _storage(t)
            if key is not None:
                inputs.setdefault(key, path)
    for path, t in _tensors(result, "the result"):
        key = _storage(t)
        if key in inputs:
            raise AssertionError(
                f"{who} returned a tensor ({path}) that shares memory with its argument `{inputs[key]}`: a view "
                "of the caller's data, not the new buffer the exercise asks for, so a later write to one would "
                "change the other. Return new storage (`.clone()`, or a tensor you made)"
            )


# ---- the technique's collectives ---------------------------------------------------------------

POINT_TO_POINT = {"send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier"}


def _with_signature(who: str, expected: tuple, fn, args, kwargs):
    """``fn(*args, **kwargs)`` on a rank, its collectives logged by the course's ``CommLogger``
    and held to ``expected``: a shortcut through another collective (an all-gather then a
    local mean where the exercise is an all-reduce) gives the right numbers and misses the
    point, and the bytes it moves."""
    from ultrascale.comm.logger import CommLogger, base_op

    with CommLogger() as log:
        result = fn(*args, **kwargs)
    used: dict = {}
    for e in log.events:
        op = base_op(e.op)
        if op not in POINT_TO_POINT:
            calls, sent = used.get(op, (0, 0))
            used[op] = (calls + 1, sent + e.bytes_sent)
    seen = ", ".join(f"{op} x{calls} ({sent:,} bytes sent)" for op, (calls, sent) in used.items()) or "none"
    allowed = {op for entry in expected for op in entry.split("|")}
    wanted = " and ".join(entry.replace("|", " (or ") + (")" if "|" in entry else "") for entry in expected)
    others = [op for op in used if op not in allowed]
    missing = [entry for entry in expected if not any(op in used for op in entry.split("|"))]
    if others or missing:
        raise AssertionError(
            f"{who} called these collectives on this rank: {seen}. The exercise's technique is made of {wanted}"
            + (
                f": {', '.join(others)} is another algorithm, with other traffic, even where the numbers agree"
                if others
                else f", and {' and '.join(missing)} was never called"
            )
        )
    return result


# ---- the same result twice ---------------------------------------------------------------


def _on_a_rank() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _any_callable(named: dict) -> bool:
    """A function among the inputs (a clock, a workload) may keep state of its own that a copy
    of the inputs shares: two calls then rightly differ, so the second call is not made."""
    return any(callable(v) and not isinstance(v, (type, torch.nn.Module)) for v in named.values())


def _copied(args, kwargs):
    try:
        return copy.deepcopy((args, kwargs))
    except Exception:  # something that cannot be copied (a lock, a generator): no second call
        return None


def _check_repeat(who, fn, signature, first, repeat_with, contract: Contract) -> None:
    """``first``: the snapshot of the first call's result, taken when it returned."""
    args, kwargs = repeat_with
    again = fn(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    change = _difference(first, again)
    if change or (first is None and _snapshot(again) is not None):
        raise AssertionError(
            f"{who} returned something else when called a second time with the same inputs (the result"
            f"{change or ' changed'}). A function's answer must depend on its inputs alone: does it keep "
            "state between calls, in a global, a cache or a counter?"
        )
    if not contract.iterables:
        return
    named = _named_arguments(signature, args, kwargs)
    bound = signature.bind(*args, **kwargs)
    for name in contract.iterables:
        if name in named:
            bound.arguments[name] = iter(list(named[name]))
    try:
        lazy = fn(*bound.args, **bound.kwargs)
    except Exception as err:
        raise AssertionError(
            f"{who} raised {type(err).__name__}: {err} when {_names(contract.iterables)} came as a generator "
            "instead of a list. A caller may pass any iterable there: go through it once, or make a list of "
            "it first (`list(...)`)"
        ) from err
    change = _difference(first, lazy)
    if change:
        raise AssertionError(
            f"{who} returned something else when {_names(contract.iterables)} came as a generator instead of a "
            f"list (the result{change}). A generator can be gone through only once: make a list of it first"
        )
