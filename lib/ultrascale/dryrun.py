"""One rank of a real-size model, measured without its memory: a dry run.

A 405B-parameter model does not fit a laptop, but one rank's *shapes* do. PyTorch has two
pieces that make a real-size run possible on one CPU:

* fake tensors (``torch._subclasses.FakeTensorMode``): tensors with a shape, a dtype and a
  device but no storage, so building a 16k-wide layer costs nothing and a matmul only
  works out the shape of its result;
* the fake process group (``torch.testing._internal.distributed.fake_pg``): a backend whose
  collectives return at once, so one process can play rank 1234 of 16384.

``dryrun(layout, config, rank)`` builds the model under both, applies the course's own
techniques to it in compose's order (TP/SP, CP, EP, PP, ZeRO or DP: ``parallel.compose``), runs
one training step and reports what that rank held and did:

    result = dryrun(ParallelConfig(tp=8, pp=16, dp=8, zero=1, optimizer="adam", microbatches=16),
                    LLAMA3_405B, rank=0)
    result.memory()        # parameters, gradients, optimizer states, peak activations (bytes)
    result.flops           # FlopCounterMode's count for the step
    result.collectives     # CommLogger's calls and bytes per collective

What is measured, and how:
* parameters, gradients, optimizer states: the bytes of the tensors that hold them after
  the step (before ``zero_grad``), each storage once, as ``memory.state_bytes`` counts (ZeRO's
  own ``state_bytes`` with ZeRO: its flat buffers and fp32 master shards);
* activations: the peak of the bytes autograd keeps saved for backward over the whole step
  (saved-tensor hooks, as ``memory.saved_activation_bytes``; parameters left out). A
  pipeline's schedule holds several micro-batches at once: the peak is taken as they come
  and go;
* FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and attention kernels, forward
  and backward; element-wise work is not counted);
* collectives: ``comm.CommLogger``, the same bytes per call as on a real cluster.

The run has no values. Where the library reads one to decide what to do, the dry run
answers as a real first step would (``stand_ins`` lists each read): ZeRO asks whether any rank
has a parameter's gradient (yes: every rank runs the same layers), Adam which step it takes
(the first). What cannot be answered is refused up front with an error naming the technique
(``refuse``). Four techniques need a small change to run on fake tensors, made in the dry run's
process only and checked against real runs by the tests: TP's vocabulary-parallel logits lose
their Tensor subclass (a fake tensor cannot become another subclass), SP's regathering hooks
tell tensors apart by storage rather than by ``data_ptr()`` (0 for every fake tensor),
CP's ring attention takes its causal masks from real positions (they depend on the layout
only; ``_ring_masks_from_positions``), and MoE routers choose by a routing stated in advance,
``balanced_choice`` (the router's scores, which decide which expert gets which token and so
every shape after it, are values; ``_routing_on_real_indices``). That is an assumption, the
one a dry run of an MoE model makes: every expert gets the same share of the tokens, and each
token's k experts sit on k different ep ranks where they can (the most all-to-all traffic).

Each call runs in a fresh process (the runtime's fork server, torch already imported):
the fake process group and the caches of process groups the techniques keep stay there, so
a notebook may call ``dryrun`` again and again, and never holds a process group itself. The
same call twice runs once: its result is remembered by its arguments (``forget`` clears them).
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import traceback
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from .comm.logger import CommLogger
from .data import Batch, split
from .model import build_model
from .parallel.compose import ParallelConfig, apply_parallelisms, build_mesh

__all__ = [
    "DryRun",
    "balanced_choice",
    "balanced_routing",
    "DryRunError",
    "dryrun",
    "dryrun_extrapolated",
    "dryrun_here",
    "forget",
    "measure_step",
    "rank_batches",
    "refuse",
]

MEMORY_KEYS = ("parameters", "gradients", "optimizer states", "activations")

# Which technique a source file is, to name it when something cannot run on fake tensors.
TECHNIQUES = {
    "moe.py": "MoE routing",
    "expert_parallel.py": "expert parallelism (EP)",
    "tensor_parallel.py": "tensor parallelism (TP)",
    "sequence_parallel.py": "sequence parallelism (SP)",
    "vocab_parallel.py": "tensor parallelism (TP, the vocabulary)",
    "context_parallel.py": "context parallelism (CP)",
    "ring_attention.py": "context parallelism (CP)",
    "all_gather_kv.py": "context parallelism (CP)",
    "ulysses.py": "context parallelism (Ulysses)",
    "pipeline_parallel.py": "pipeline parallelism (PP)",
    "pipeline_messages.py": "pipeline parallelism (PP)",
    "zero.py": "ZeRO",
    "zero3.py": "ZeRO-3",
    "compose_zero.py": "ZeRO",
    "flat.py": "ZeRO",
    "data_parallel.py": "data parallelism (DP)",
    "grad_sync.py": "data parallelism (DP)",
}


class DryRunError(RuntimeError):
    """A layout or model the dry run cannot run on fake tensors; the message says which technique."""


@dataclass(frozen=True)
class DryRun:
    """What one rank held and did in one training step (bytes, FLOPs), measured."""

    layout: str  # str(ParallelConfig)
    rank: int
    coordinate: dict  # the rank's place on the mesh: {"dp": ..., "pp": ..., ...}
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int  # the peak of the bytes saved for backward
    flops: int
    tokens: int  # tokens this rank ran forward and backward in the step
    collectives: dict  # op -> {"calls", "bytes_sent", "bytes_received"}
    stand_ins: dict = field(default_factory=dict)  # where a value was read: "file:function" -> reads

    def memory(self) -> dict:
        """The four consumers, keyed as ``memory.breakdown``'s result."""
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer states": self.optimizer_states,
            "activations": self.activations,
        }

    @property
    def total_bytes(self) -> int:
        return sum(self.memory().values())


# --------------------------------------------------------------------------- the entry point
def dryrun(
    layout: ParallelConfig,
    config,
    rank: int = 0,
    *,
    micro_batch: int = 1,
    seq: int | None = None,
    dtype=torch.float32,
    recompute: str = "none",
    timeout: float = 600,
) -> DryRun:
    """Rank ``rank`` of ``layout`` training ``config`` at full size, one step, measured.

    ``micro_batch``: rows per micro-batch (the layout's ``microbatches`` is how many);
    ``seq``: tokens per row (default ``config.seq_len``); ``dtype``: of the parameters,
    gradients and activations (the optimizer's states follow the parameters; ZeRO keeps
    fp32 master shards); ``recompute``: "none", "selective" or "full" (``model.set_recompute``).
    Runs in a fresh process (see the module's docstring); raises :class:`DryRunError` where a
    technique cannot run on fake tensors.
    """
    _check_rank(layout, rank)
    refuse(layout, config)  # at once, not after a process has started
    options = dict(micro_batch=micro_batch, seq=seq, dtype=dtype, recompute=recompute)
    return _run_dry([(layout, config, rank, options)], timeout)[0]


def _check_rank(layout: ParallelConfig, rank: int) -> None:
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank={rank}: the layout {layout} has ranks 0..{layout.world_size - 1}")


_REMEMBERED: dict = {}  # this process's dry runs, by their arguments (see _run_dry)


def forget() -> None:
    """Forget the dry runs this process remembers (after editing the library in a session)."""
    _REMEMBERED.clear()


def _job_key(job) -> tuple:
    layout, config, rank, options = job
    return layout, config, rank, tuple(sorted((k, str(v)) for k, v in options.items()))


def _run_dry(jobs: list, timeout: float) -> list:
    """The dry runs of ``jobs`` ((layout, config, rank, options) each), one after the other in
    one fresh process: each its own fake process group, destroyed before the next.

    A dry run reads no value, so the same job gives the same bytes, FLOPs and collectives every
    time: each job's result is remembered by its arguments, for this process's life (``forget``
    clears them), and only jobs not run before go to a process. A planner's scan, a grader
    checking it, and a notebook cell run again cost one dry run each."""
    missing = [job for job in jobs if _job_key(job) not in _REMEMBERED]
    if missing:
        for job, result in zip(missing, _run_in_a_process(missing, timeout)):
            _REMEMBERED[_job_key(job)] = result
    return [_REMEMBERED[_job_key(job)] for job in jobs]


def _run_in_a_process(jobs: list, timeout: float) -> list:
    from .runtime.forkserver import mp_context, no_main_reimport  # imports no torch: cheap

    context = mp_context()
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(send, jobs), daemon=True)
    with no_main_reimport():
        process.start()
    send.close()
    try:
        if not receive.poll(timeout):
            layout, _, rank, _ = jobs[-1]
            raise TimeoutError(
                f"the dry run of rank {rank} of {layout} took more than {timeout} s: "
                "give dryrun(..., timeout=) more, or fewer micro-batches"
            )
        try:
            ok, value = receive.recv()
        except EOFError:
            process.join()
            raise RuntimeError(
                f"the dry run's process ended without a result (exit code {process.exitcode}): out of memory, or killed"
            ) from None
    finally:
        process.join(timeout=5)
        if process.is_alive():  # a timeout: stop it, it holds nothing anyone needs
            process.kill()
            process.join()
    if not ok:
        raise value
    return value


def dryrun_extrapolated(layout: ParallelConfig, config, rank: int = 0, **options) -> DryRun:
    """``dryrun``'s result for ``config``, from two dry runs of the same model with one and with
    two blocks per pipeline stage, in one process: seconds where the whole model takes a minute.

    The blocks of a Llama are alike, so what a rank holds and does is an affine function of the
    number n of blocks on its stage: the embedding, the head and the loss once, each block the
    same amount again (its weights, gradients and optimizer states, its saved activations in
    every micro-batch in flight, its FLOPs and its collectives), and the peak of the
    activations falls at the same point of the schedule whatever n is. So
    X(n) = X(1) + (n - 1) (X(2) - X(1)), exactly, for every count of the result; the tests hold
    it equal to a whole dry run. Schedules that give a rank one stage only (not interleaved
    ones, whose chunks are split apart); ``options`` as ``dryrun``'s.
    """
    if layout.schedule not in ("1f1b", "afab") and layout.pp > 1:
        raise ValueError(
            f"schedule={layout.schedule!r}: extrapolating by blocks per stage needs a schedule that "
            "gives each rank one stage (1f1b, afab); run dryrun(...) on the whole model"
        )
    from .parallel.pipeline_parallel import split_layers

    stage = layout.layout().coordinate(rank).get("pp", 0)
    n = len(split_layers(config.layers, layout.pp)[stage])
    _check_rank(layout, rank)
    refuse(layout, config)
    timeout = options.pop("timeout", 600)
    options = {"micro_batch": 1, "seq": None, "dtype": torch.float32, "recompute": "none", **options}
    one, two = _run_dry([(layout, replace(config, layers=k * layout.pp), rank, options) for k in (1, 2)], timeout)

    def at_n(a, b):
        return a + (n - 1) * (b - a)

    collectives = {
        op: {k: at_n(one.collectives.get(op, {}).get(k, 0), row[k]) for k in row} for op, row in two.collectives.items()
    }
    counts = {
        k: at_n(getattr(one, k), getattr(two, k))
        for k in ("parameters", "gradients", "optimizer_states", "activations", "flops")
    }
    return replace(two, collectives=collectives, **counts)


def _child(send, jobs) -> None:
    """The dry run's process: the results, or the error, sent back (one that does not pickle as text)."""
    try:
        result = (True, [dryrun_here(layout, config, rank, **options) for layout, config, rank, options in jobs])
    except DryRunError as error:
        result = (False, DryRunError(str(error)))
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the caller, with its trace
        result = (False, RuntimeError("".join(traceback.format_exception(error))))
    send.send(result)
    send.close()


def dryrun_here(layout: ParallelConfig, config, rank: int = 0, **options) -> DryRun:
    """``dryrun`` in this process: it initialises the fake process group and destroys it after
    (with the groups the techniques keep for it), so one process can run several one after the
    other. For a process that has no process group and runs nothing else distributed
    (``dryrun``'s child)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's fake backend (test utility)

    if dist.is_initialized():
        raise RuntimeError(
            "this process already has a process group: call dryrun(...), which runs in a fresh "
            "process, rather than dryrun_here"
        )
    from .parallel import pipeline_messages

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        return _dry_step(layout, config, rank, **options)
    finally:
        dist.destroy_process_group()
        pipeline_messages.forget_twin_groups()  # they died with this world


class _FakeRankContext:
    """The ``ctx`` a technique gets, for one rank of a fake world: it makes only the process
    groups this rank is in (the others would be thousands of groups no one uses here)."""

    def __init__(self, rank: int, world_size: int):
        from .runtime import RankContext

        self.inner, self.groups = RankContext(rank, world_size, "fake", torch.device("cpu")), {}

    def __getattr__(self, name):  # rank, world_size, device, state: the real context's
        return getattr(self.inner, name)

    def new_group(self, ranks):
        key = tuple(sorted(ranks))
        if self.inner.rank not in key:
            return None
        if key not in self.groups:  # by its own ranks alone: no other rank of this world runs
            self.groups[key] = dist.new_group(list(key), use_local_synchronization=True)
        return self.groups[key]


def refuse(layout: ParallelConfig, config) -> None:
    """Raise :class:`DryRunError` for what cannot run on fake tensors here, naming the technique."""
    if getattr(config, "experts", 0) and getattr(config, "group_limit", 0):
        raise DryRunError(
            f"MoE routing with group_limit={config.group_limit} cannot be dry-run: the dry run routes by "
            "balanced_choice, which spreads a token's experts over every group; set group_limit=0"
        )


def _dry_step(layout, config, rank, *, micro_batch=1, seq=None, dtype=torch.float32, recompute="none") -> DryRun:
    from torch._subclasses import FakeTensorMode  # torch's fake tensors (private module, public class)

    from .parallel.pipeline_messages import twin_group

    refuse(layout, config)
    seq = seq or config.seq_len
    config = replace(config, seq_len=seq)
    mesh = build_mesh(_FakeRankContext(rank, layout.world_size), layout)
    if layout.pp > 1:  # made with real tensors: making it reads the ranks' counts of groups
        twin_group(mesh.group("pp"))
    real_batches = rank_batches(layout, mesh, config, micro_batch)
    try:
        with FakeTensorMode() as mode:
            model = _build(config, dtype).set_recompute(recompute)
            par = apply_parallelisms(model, mesh, layout)
            # no positions: under CP the model's positions hook makes this rank's own (given, it would
            # compare them with those, a read of values; a real run's are the same by construction)
            batches = [Batch(mode.from_tensor(b.inputs), mode.from_tensor(b.targets)) for b in real_batches]
            stand_ins = _StandIns()
            with (
                _vocab_logits_plain(),
                _regather_by_storage(),
                _ring_masks_from_positions(mode, stand_ins.reads),
                _routing_on_real_indices(mode, stand_ins.reads),
            ):
                measured = measure_step(par, batches, stand_ins)
    except DryRunError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure under fake tensors gets its technique named
        raise DryRunError(_explain(error)) from error
    tokens = micro_batch * len(batches) * batches[0].inputs.shape[1]
    return DryRun(str(layout), rank, mesh.coordinate(rank), tokens=tokens, stand_ins=dict(stand_ins.reads), **measured)


def _build(config, dtype):
    """The model with its parameters made in ``dtype`` (``.to(dtype)`` cannot swap fake parameters)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return build_model(config)
    finally:
        torch.set_default_dtype(default)


def rank_batches(layout: ParallelConfig, mesh, config, micro_batch: int = 1) -> list:
    """This rank's micro-batches of one step: ``micro_batch`` rows of ``config.seq_len`` tokens
    each (its tokens of them, in the CP layout, under CP). The tokens are zeros: a dry run's
    shapes are all that matter, and a real run of the tests trains on the same."""
    tokens = torch.zeros(micro_batch, config.seq_len, dtype=torch.long)
    whole = Batch(tokens, tokens)
    if layout.cp > 1:
        whole = split(whole, mesh.rank_in("cp"), layout.cp, "sequence", layout.cp_layout)
    return [whole] * layout.microbatches


# --------------------------------------------------------------------------- one measured step
def measure_step(par, batches, optimizer_reads=contextlib.nullcontext()) -> dict:
    """One training step of ``par`` (from ``apply_parallelisms``) on this rank's micro-batches,
    measured: what ``DryRun`` holds but the layout. Works on real tensors as on fake ones, so
    a real small run and a dry run are measured by the same code (the tests compare them).
    ``optimizer_reads``: a context around the optimizer's step (the dry run's stand-ins for
    the values it reads; forward and backward read none, and run faster without it)."""
    from torch.utils.flop_counter import FlopCounterMode

    activations = _SavedBytes(par.module)
    with CommLogger() as log, FlopCounterMode(display=False) as flops, activations:
        _train_step(par, batches, optimizer_reads)
    state = _state_bytes(par)  # after the step, before zero_grad: the gradients are still there
    par.optimizer.zero_grad()
    collectives = {
        op: {k: row[k] for k in ("calls", "bytes_sent", "bytes_received")} for op, row in log.totals().items()
    }
    return dict(
        parameters=state["parameters"],
        gradients=state["gradients"],
        optimizer_states=state["optimizer states"],
        activations=activations.peak,
        flops=int(flops.get_total_flops()),
        collectives=collectives,
    )


def _train_step(par, batches, optimizer_reads) -> None:
    """compose's ``Parallelized.train`` for one step, reading no value (it has none here)."""
    m = len(batches)
    if par.pipeline is not None:
        par.pipeline.step(batches)
    else:
        for batch in batches:  # gradient accumulation: DP reduces the sum once, below
            (batch.loss(par.model) / m).backward()
    par.sync_gradients()
    with optimizer_reads:
        par.optimizer.step()


def _state_bytes(par) -> dict:
    """Parameters, gradients and optimizer states on this rank, each storage once."""
    zeros = getattr(par.optimizer, "zeros", None)
    if zeros is not None:  # ZeRO keeps them in flat buffers of its own
        counts = [z.state_bytes() for z in zeros]
        return {k: sum(c[k] for c in counts) for k in counts[0]}
    params = list(par.module.parameters())
    states = [t for s in par.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "parameters": _unique_bytes(params),
        "gradients": _unique_bytes(p.grad for p in params),
        "optimizer states": _unique_bytes(states),
    }


def _storage_key(t: torch.Tensor) -> int:
    # A storage's identity. memory.state_bytes keys by data_ptr(), which is 0 for every fake
    # tensor; _cdata (torch's private handle on the storage) is unique for real and fake alike.
    return t.untyped_storage()._cdata


def _unique_bytes(tensors) -> int:
    storages = {_storage_key(t): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


class _SavedBytes:
    """The peak of the bytes autograd holds saved for backward, over a whole step.

    Each saved tensor is wrapped in a token; autograd drops the token when the backward that
    needed it has run, and the bytes of its storage go when its last token does. A storage
    saved twice counts once; the parameters' storages are not activations and are left out
    (nor are FSDP's gathered parameters: ``_is_parameter``).
    Those are looked up once, when the step starts: ZeRO-3 frees and refills its gathered
    weights by resizing one storage (``flat.FlatUnit``), never by making another, so the
    keys hold for the whole step (looking them up at every save cost a fifth of a dry run)."""

    def __init__(self, module):
        self.live, self.held, self.peak = collections.Counter(), 0, 0
        self.parameters = {_storage_key(p) for p in module.parameters()}
        self.fsdp = getattr(module, "fsdp", None)  # per-parameter sharding's units (parallel/fsdp.py)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda token: token.tensor)

    def _is_parameter(self, key) -> bool:
        """A parameter's storage, or one of FSDP's gathered whole parameters: those are made
        anew at each forward, freed after their unit's forward and refilled in backward, so
        they are parameters gathered, not activations (ZeRO-3's live in its flat buffers)."""
        if key in self.parameters:
            return True
        units = self.fsdp.units if self.fsdp is not None else ()
        return any(_storage_key(full) == key for unit in units for full in unit.fulls or ())

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def _pack(self, tensor):
        key = _storage_key(tensor)
        if self._is_parameter(key):
            return _Token(tensor, None, self)
        if self.live[key] == 0:
            self.held += tensor.untyped_storage().nbytes()
            self.peak = max(self.peak, self.held)
        self.live[key] += 1
        return _Token(tensor, key, self)

    def release(self, key, nbytes):
        self.live[key] -= 1
        if self.live[key] == 0:
            del self.live[key]
            self.held -= nbytes


class _Token:
    __slots__ = ("tensor", "key", "owner", "nbytes")

    def __init__(self, tensor, key, owner):
        self.tensor, self.key, self.owner = tensor, key, owner
        self.nbytes = tensor.untyped_storage().nbytes()

    def __del__(self):
        if self.key is not None:
            self.owner.release(self.key, self.nbytes)


@contextlib.contextmanager
def _vocab_logits_plain():
    """TP's vocabulary-parallel logits without their Tensor subclass, in this process only.

    ``VocabParallelHead`` returns ``VocabParallelLogits``, a subclass of Tensor made with
    ``as_subclass``; a fake tensor is a subclass already and cannot become another. So here
    the head's logits stay a plain (fake) tensor carrying the subclass' two attributes, and
    the loss hands them to ``vocab_parallel_cross_entropy``, the function the subclass'
    ``F.cross_entropy`` calls, with the same reshape and upcast as ``lm_loss``: the same
    operations, saved tensors and collectives (the tests compare with a real run)."""
    from unittest import mock

    from . import data, model
    from .parallel import pipeline_parallel, vocab_parallel

    def wrap(local, vocab_start, group):
        local.vocab_start, local.group = vocab_start, group
        return local

    def lm_loss(logits, targets):
        if not hasattr(logits, "vocab_start"):
            return model.lm_loss(logits, targets)
        flat = logits.flatten(0, 1)
        flat = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
        return vocab_parallel.vocab_parallel_cross_entropy(flat, targets.flatten(), logits.vocab_start, logits.group)

    with (
        mock.patch.object(vocab_parallel.VocabParallelLogits, "wrap", staticmethod(wrap)),
        mock.patch.object(data, "lm_loss", lm_loss),
        mock.patch.object(pipeline_parallel, "lm_loss", lm_loss),
    ):
        yield


@contextlib.contextmanager
def _regather_by_storage():
    """SP's ``RegatherInBackward`` finding g's gathered input by storage, in this process only.

    Its pack hook tells the gathered input from other saved tensors by ``data_ptr()``, which is
    0 for every fake tensor: all of them would look gathered. Here the same test is made on
    the storage's identity first, and only the gathered input goes on to the library's own
    hook (whose ``data_ptr()`` test it then passes): what is saved, and regathered in
    backward, is what a real run saves (the tests compare with one)."""
    import warnings
    from unittest import mock

    from .parallel.sequence_parallel import RegatherInBackward

    original_init, original_pack = RegatherInBackward.__init__, RegatherInBackward.pack

    def init(self, shard, gathered, group):
        original_init(self, shard, gathered, group)
        self.storage_key = _storage_key(gathered)

    def pack(self, t):
        return original_pack(self, t) if _storage_key(t) == self.storage_key else self.outer_pack(t)

    with (
        mock.patch.object(RegatherInBackward, "__init__", init),
        mock.patch.object(RegatherInBackward, "pack", pack),
        warnings.catch_warnings(),
    ):
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        yield


@contextlib.contextmanager
def _ring_masks_from_positions(mode, reads):
    """CP's causal masks made from the tokens' real positions, in this process only.

    Ring attention decides which keys a block of queries sees (which blocks it skips, where it cuts
    one, where a block needs a mask) from the tokens' global positions (``data.sequence_positions``):
    values, which fake tensors do not have. The positions depend only on the sequence length, the
    rank and the layout, so here they are made as real tensors, ring attention's own ``_visible``
    takes its decisions on them, and the masks it makes go on to the (fake) attention as fake
    tensors: the same blocks attended, the same shapes (the tests compare with a real run).
    ``check_attention_inputs`` all-reduces the ranks' shapes (that collective is made) and reads
    the result only to compare them: every rank's are equal by construction here (``rank_batches``),
    so its reads are answered 0, which passes (counted in ``reads``, as the stand-ins are)."""
    from unittest import mock

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from . import data

    # the module (``parallel.ring_attention`` is also the name of its function, in parallel/__init__)
    ring_attention = importlib.import_module(".parallel.ring_attention", __package__)

    def positions(*args, **kwargs):
        with unset_fake_temporarily():
            return data.sequence_positions(*args, **kwargs)

    def visible(pos_q, pos_k, causal):
        with unset_fake_temporarily():
            seen = original_visible(pos_q, pos_k, causal)
        if seen is None or seen[2] is None:
            return seen
        return (*seen[:2], mode.from_tensor(seen[2]))

    def check_alike(*args, **kwargs):
        with _StandInsMode(reads, answer=0):
            return original_check(*args, **kwargs)

    original_visible, original_check = ring_attention._visible, ring_attention.check_attention_inputs
    ulysses = importlib.import_module(".parallel.ulysses", __package__)
    with (
        mock.patch.object(ring_attention, "sequence_positions", positions),
        mock.patch.object(ring_attention, "_visible", visible),
        mock.patch.object(ring_attention, "check_attention_inputs", check_alike),
        mock.patch.object(ulysses, "check_attention_inputs", check_alike),
    ):
        yield


def balanced_choice(tokens: int, experts: int, top_k: int, device=None) -> torch.Tensor:
    """The routing a dry run assumes: token t's j-th expert is ``(t + j * (E // k)) mod E``.

    Over any E consecutive tokens every expert is chosen k times (a perfectly balanced router,
    what load balancing aims at), and a token's k experts are E // k apart, so they sit on k
    different ep ranks whenever k <= ep: each token is sent k times, the most traffic (the
    planner's cost model charges that). A real router does neither exactly."""
    t = torch.arange(tokens, device=device)[:, None]
    return (t + torch.arange(top_k, device=device) * (experts // top_k)) % experts


@contextlib.contextmanager
def balanced_routing():
    """Every MoE router of this process chooses ``balanced_choice``: a real run routed as a dry
    run is (the tests compare the two)."""
    from unittest import mock

    from .moe import Router

    def choose(router, scores):
        return balanced_choice(scores.shape[0], scores.shape[-1], router.top_k, scores.device)

    with mock.patch.object(Router, "choose", choose):
        yield


@contextlib.contextmanager
def _routing_on_real_indices(mode, reads):
    """MoE and EP on fake tensors, routed by ``balanced_choice``, in this process only.

    The router's choice is made as a real tensor and goes on as a fake one that carries its
    values (``real_values``). Where the library turns choices into indices and split sizes
    (``moe.expert_batches``, ``expert_parallel.dispatch_rows``), the same functions run on those
    values and hand fake indices to the (fake) computation: the same rows gathered, the same
    batch per expert, the same shapes. EP's all-to-alls need what other ranks send: every rank
    routes its tokens alike (the same choice, the same number of tokens), so each sends a rank
    what that rank sends itself. ``exchange_counts`` makes its all-to-all and its reads are
    answered so (counted in ``reads``); a dispatched tensor's values follow the same way."""
    from unittest import mock

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from . import moe
    from .parallel import expert_parallel

    def fake(real):
        out = mode.from_tensor(real)
        out.real_values = real
        return out

    def values(t):
        if getattr(t, "real_values", None) is None:
            raise DryRunError("MoE routing: a routing index without known values reached the experts")
        return t.real_values

    def choose(router, scores):
        with unset_fake_temporarily():
            return fake(balanced_choice(scores.shape[0], scores.shape[-1], router.top_k))

    def on_values(plan):  # an index plan run on the choice's values; its tensors go on as fake ones
        def run(chosen, *args):
            with unset_fake_temporarily():
                result = plan(values(chosen), *args)
            return tuple(fake(r) if torch.is_tensor(r) else r for r in result)

        return run

    def exchange_counts(send_counts, group=None, device=None):
        with _StandInsMode(reads, answer=send_counts[dist.get_rank(group)]):
            return original_exchange(send_counts, group, device)

    def all_to_all(x, output_split_sizes=None, input_split_sizes=None, group=None):
        out = original_all_to_all(x, output_split_sizes, input_split_sizes, group)
        if getattr(x, "real_values", None) is not None:  # routing indices: what I send myself, from each rank
            with unset_fake_temporarily():
                mine = x.real_values.split(input_split_sizes)[dist.get_rank(group)]
                out.real_values = torch.cat([mine] * dist.get_world_size(group))
        return out

    original_exchange, original_all_to_all = expert_parallel.exchange_counts, expert_parallel.all_to_all
    with (
        mock.patch.object(moe.Router, "choose", choose),
        mock.patch.object(moe, "expert_batches", on_values(moe.expert_batches)),
        mock.patch.object(expert_parallel, "dispatch_rows", on_values(expert_parallel.dispatch_rows)),
        mock.patch.object(expert_parallel, "exchange_counts", exchange_counts),
        mock.patch.object(expert_parallel, "all_to_all", all_to_all),
    ):
        yield


# --------------------------------------------------------------------------- reading values
class _StandInsMode(torch.utils._python_dispatch.TorchDispatchMode):
    # A dispatch mode (torch.utils._python_dispatch: private module, the public way to write one).
    def __init__(self, reads, answer=None):
        super().__init__()
        self.reads, self.answer = reads, answer  # answer: the one answer to every read (None: by dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads[_caller()] += 1
            if self.answer is not None:
                return self.answer
            # 1 for a flag (ZeRO: "a rank has this gradient") and for a float (Adam's step
            # count: this is the first step). Any other read has no answer that holds for
            # every layout: refused, with the place that asked.
            dtype = args[0].dtype
            if dtype in (torch.bool, torch.uint8) or dtype.is_floating_point:
                return 1
            raise DryRunError(f"{_caller()} reads the value of a {dtype} tensor, which a fake tensor does not have")
        return func(*args, **(kwargs or {}))


class _StandIns:
    def __init__(self):
        self.reads = collections.Counter()
        self.mode = _StandInsMode(self.reads)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _caller() -> str:
    """The course function that read a value: "zero.py:_gradient_flags"."""
    for frame in reversed(traceback.extract_stack()):
        if "/ultrascale/" in frame.filename and not frame.filename.endswith("dryrun.py"):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}"
    return "torch"


def _explain(error: Exception) -> str:
    """Which technique failed on fake tensors, and why, from the error's traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    technique = next(
        (
            TECHNIQUES[f.filename.rsplit("/", 1)[-1]]
            for f in reversed(frames)
            if f.filename.rsplit("/", 1)[-1] in TECHNIQUES and "/ultrascale/" in f.filename
        ),
        None,
    )
    where = next(
        (
            f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} ({f.name})"
            for f in reversed(frames)
            if "/ultrascale/" in f.filename
        ),
        "torch",
    )
    name = type(error).__name__
    if "DynamicOutputShape" in name or "DataDependent" in name:
        return (
            f"{technique or 'the model'} cannot run on fake tensors at {where}: it needs the values of a "
            "tensor (a shape or a decision that depends on the data), and fake tensors have shapes only"
        )
    return f"{technique or 'the model'} failed in the dry run at {where}: {name}: {error}"
