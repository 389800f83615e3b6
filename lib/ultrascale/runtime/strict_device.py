"""Strict-device mode: a CPU run that fails where a GPU node would.

On a GPU node each rank computes on ``ctx.device`` (``cuda:r``) while a tensor made without a
device still lands on the CPU, PyTorch's default. NCCL refuses a CPU tensor, and an op that
mixes a CPU tensor with a CUDA one raises. On a CPU both are the same device, so a course run
on a laptop never notices a forgotten ``device=ctx.device`` or an unmoved model.

This mode makes it noticeable. Every tensor that the rank code makes **without naming a
device** (``torch.randn(n)``, a CPU generator's draw, a module's initial weights) is marked as
living on the *host*, and the mark follows it through every op, exactly as the CPU placement
would on a GPU node. Naming a device (``device=ctx.device``, ``device=x.device``) or moving
(``.to(ctx.device)``, ``module.to(ctx.device)``) clears it; ``.cpu()`` sets it. Then, as on a
GPU node:

* an op that mixes a host tensor with a device tensor raises (0-d tensors excepted: CUDA ops
  accept CPU scalars, and torch keeps its optimizers' step counters on the CPU);
* a collective or send/receive given a host tensor raises (NCCL takes CUDA tensors only);
* a collective given a non-contiguous tensor raises (NCCL refuses it, where gloo's collectives
  take it; gloo's sends and receives refuse one themselves).

Each error names the op and the line that made the host tensor. Copies between the two
(``copy_``, ``.to``) and indexing are allowed, as CUDA allows them. ``device=x.device`` and
``.to(x)`` follow ``x``: to the host if ``x`` is there. One thing the mode cannot see: a device
named by its string, ``device="cpu"``, counts as ``ctx.device`` (on a CPU the two are one);
rank code names ``ctx.device`` or a tensor's device, never a literal.

The course's idiom, written down in CONTRIBUTING.md: data and initial weights come from the
seeded CPU generators and are then moved (``GPT(cfg).to(ctx.device)``,
``batch.to(ctx.device)``); anything else a rank makes names ``ctx.device`` or follows its
inputs (``zeros_like``, ``x.new_empty``, ``device=x.device``).

Turned on by ``Cluster(n, strict_device=True)`` or the environment variable
``ULTRASCALE_STRICT_DEVICE=1`` (which ``make test`` sets for its papermill runs and graders).
It costs a few microseconds per op (a ``TorchFunctionMode`` in Python), so it is off for
learners.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ENV = "ULTRASCALE_STRICT_DEVICE"
MARK = "_ultrascale_host"  # attribute on a host tensor: where it was made ("file:line")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = __file__.removesuffix("c")  # .pyc -> .py

# Ops that may take a host tensor beside a device tensor on CUDA too.
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
_ALLOWED_MIXED = {
    torch.Tensor.copy_,
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.index_put_,
    torch.Tensor.set_,
    # these read only the other tensor's shape
    torch.Tensor.view_as,
    torch.Tensor.expand_as,
    torch.Tensor.reshape_as,
}


def _may_mix(func) -> bool:
    """Copies, indexing and questions about a tensor's metadata, which CUDA allows across
    devices."""
    name = getattr(func, "__name__", "")
    return func in _ALLOWED_MIXED or name.startswith(("_has_", "is_", "__get__", "__set__"))


class DeviceError(RuntimeError):
    """A tensor on the wrong device, as a GPU node would see it."""


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no")


def host_mark(t) -> str | None:
    """Where ``t`` was made on the host, or None if it is on the device (or a 0-d scalar)."""
    return getattr(t, MARK, None) if isinstance(t, torch.Tensor) else None


def _caller() -> str:
    """Where the innermost frame outside torch and this module is: the code that asked
    (file:line, or the function and line of one sent from a notebook cell)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_TORCH_DIR) or name == _THIS_FILE):
            if name.startswith("<"):  # a function shipped from the notebook (cloudpickle)
                return f"`{frame.f_code.co_name}` line {frame.f_lineno}"
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "<torch>"


def _tensors(args, kwargs):
    """The tensors among an op's arguments, one level into lists and tuples (``torch.cat``,
    the ``_foreach`` ops)."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _mark(result, where: str | None) -> None:
    for t in result if isinstance(result, (list, tuple)) else (result,):
        if isinstance(t, torch.Tensor):
            try:
                if where is None:
                    if MARK in t.__dict__:
                        delattr(t, MARK)
                else:
                    setattr(t, MARK, where)
            except (AttributeError, RuntimeError):  # a tensor type without a __dict__
                pass


def _name(func) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    return qual if qual.startswith(("torch.", "Tensor.")) else f"torch.{qual}"


def _new_object(t: torch.Tensor, result):
    """On a CPU, ``.to(device)`` and ``.cpu()`` return the tensor itself; on a GPU node they
    make another. Give back another Python object (a view) so that the two can carry
    different marks."""
    if result is t:
        with torch._C.DisableTorchFunction():
            return t.view_as(t)
    return result


_DEVICE_GETTER = torch._C.TensorBase.device  # ``t.device``, which reaches the mode as its __get__


class StrictDevice(TorchFunctionMode):
    """The mode itself; see the module's docstring. ``with StrictDevice(): ...``"""

    def __init__(self):
        super().__init__()
        # ``x.device`` of a host tensor x, as handed out: on a CPU it equals ctx.device, but
        # ``device=x.device`` means the host there. torch makes a new device object per read,
        # so the objects themselves are remembered (the most recent few hundred).
        self.host_devices: dict[int, tuple] = {}

    def _host_device(self, device, where: str) -> None:
        self.host_devices[id(device)] = (device, where)
        if len(self.host_devices) > 512:
            del self.host_devices[next(iter(self.host_devices))]

    def _where_device_puts(self, device) -> str | None:
        """Where a tensor made or moved with ``device=device`` lives: the host (as a mark) for
        the device of a host tensor, else ctx.device (None)."""
        seen = self.host_devices.get(id(device))
        return seen[1] if seen is not None and seen[0] is device else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        if not tensors:  # a factory: host unless it names a device
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor):
                generator, device = kwargs.get("generator"), kwargs.get("device")
                if device is None or (generator is not None and generator.device.type == "cpu"):
                    _mark(result, _caller())
                else:
                    _mark(result, self._where_device_puts(device))
            return result
        if func in _MOVES:
            return self._move(func, args, kwargs)
        if getattr(func, "__self__", None) is _DEVICE_GETTER:  # x.device
            result = func(*args, **kwargs)
            if host_mark(args[0]) is not None:
                self._host_device(result, host_mark(args[0]))
            return result
        if getattr(func, "__name__", None) == "__set__" and len(args) == 2:  # p.data = v
            result = func(*args, **kwargs)
            _mark(args[0], host_mark(args[1]))
            return result
        host, device = _split(tensors)
        if host and device and not _may_mix(func):
            raise DeviceError(
                f"strict device: {_name(func)} at {_caller()} mixes a tensor made on the "
                f"host at {host} with a tensor on ctx.device. On a GPU node the first is a CPU tensor and "
                f"the second a CUDA one, and this op raises there. Make it with "
                f"device=ctx.device (or device=x.device), or move it with .to(ctx.device); "
                f"a model with model.to(ctx.device)."
            )
        result = func(*args, **kwargs)
        if host and device:  # an op CUDA allows across devices: its output lives where self does
            _mark(result, host_mark(args[0]))
        else:
            _mark(result, host)
        return result

    def _move(self, func, args, kwargs):
        t = args[0]
        result = func(*args, **kwargs)
        if func is torch.Tensor.cpu:
            result = _new_object(t, result)
            _mark(result, host_mark(t) or _caller())
        else:
            target = _target(args[1:], kwargs)
            if target is None:  # .to(dtype): the data stays where it is
                _mark(result, host_mark(t))
                return result
            result = _new_object(t, result)  # .to(device), .to(other_tensor), .cuda()
            if isinstance(target, torch.Tensor):
                _mark(result, host_mark(target))
            else:
                _mark(result, self._where_device_puts(target))
        return result


def _target(args, kwargs):
    """What ``.to(...)`` moves to: a device, a tensor whose device it takes, or None (a dtype)."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    for a in args:  # (Module.to passes non_blocking by position: a bool is no device)
        if isinstance(a, (torch.Tensor, str, torch.device, int)) and not isinstance(a, bool):
            return a
    return None


def _split(tensors):
    """(where the first host tensor was made, whether a device tensor is present), 0-d
    tensors left out."""
    host = device = None
    for t in tensors:
        if t.dim() == 0:
            continue
        mark = getattr(t, MARK, None)
        if mark is None:
            device = True
        elif host is None:
            host = mark
    return host, device


def keep_marks_on_parameters() -> None:
    """``nn.Parameter(t)`` makes a new tensor object in C++, out of the mode's sight: copy
    ``t``'s mark onto it, so that a module's initial weights stay on the host until moved."""
    original = torch.nn.Parameter.__new__
    if hasattr(original, "__ultrascale_strict__"):
        return

    def __new__(cls, data=None, requires_grad=True):
        param = original(cls, data, requires_grad)
        _mark(param, host_mark(data))
        return param

    __new__.__ultrascale_strict__ = original
    torch.nn.Parameter.__new__ = __new__


def install() -> None:
    """What a strict rank sets up once: collectives checked, parameters keep their marks."""
    guard_collectives()
    keep_marks_on_parameters()


# ----------------------------------------------------------------------- collectives

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


_POINT_TO_POINT = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}


def _check_collective(name: str, args, kwargs) -> None:
    values = list(args) + list(kwargs.values())
    for value in values:
        if isinstance(value, (list, tuple)):
            values.extend(value)
        elif isinstance(value, dist.P2POp):
            values.append(value.tensor)
        else:
            where = host_mark(value)
            if where is not None:
                raise DeviceError(
                    f"strict device: dist.{name} at {_caller()} was given a tensor made on "
                    f"the host at {where}. NCCL, the backend of a GPU node, takes CUDA tensors only and "
                    f"raises here. Make it with device=ctx.device or move it with "
                    f".to(ctx.device)."
                )
            if torch.is_tensor(value) and name not in _POINT_TO_POINT and not value.is_contiguous():
                raise DeviceError(
                    f"strict device: dist.{name} at {_caller()} was given a non-contiguous tensor (shape "
                    f"{tuple(value.shape)}, strides {value.stride()}). gloo takes it, but NCCL, the backend of a "
                    "GPU node, raises 'Tensors must be contiguous' for a collective: pass a contiguous tensor "
                    "(.contiguous(), or a buffer made for the collective), and copy a result back if needed."
                )


def _guarded(name: str, fn):
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        _check_collective(name, args, kwargs)
        return fn(*args, **kwargs)

    guarded.__ultrascale_strict__ = fn
    return guarded


def guard_collectives() -> None:
    """Check every ``torch.distributed`` collective's tensors (once per process: the ranks)."""
    from torch.distributed import distributed_c10d as c10d

    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or hasattr(fn, "__ultrascale_strict__"):
            continue
        guarded = _guarded(name, fn)
        for module in (dist, c10d):  # so that ``from torch.distributed import send`` is caught
            if getattr(module, name, None) is fn:
                setattr(module, name, guarded)
