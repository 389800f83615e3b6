"""Properties of the exercises that are a whole training step on ranks (issue 53's last ones):
``02.overlapped_dp_hooks``, ``03.zero1_step``, ``03.zero3_gather_free`` and ``07.stage_step``.
Each drawn case is a short run on ranks, so each property draws few cases (``draws``), on models
of a few dozen weights (a case costs a few tens of milliseconds on a warm cluster). Each names
what its draws reach that the exercise's fixed cases do not:

* ``02.overlapped_dp_hooks``: a model with a frozen weight (``requires_grad=False``: the text
  registers the hook only on the parameters "that require a gradient", and autograd refuses a
  hook on any other) and one with a layer the loss does not use (its hook never runs, its
  ``.grad`` stays None, so ``finish()`` may touch only what its hooks launched); every parameter
  of the fixed cases' GPT trains and gets a gradient. Also float64 (compared with one process to
  1e-10) and one or two steps, on 2 and 3 ranks;
* ``03.zero1_step``: bf16 parameters with their fp32 masters, the mixed precision the text's
  "fp32 master weights" and "cast to the parameters' dtype" are for (every fixed case is fp32,
  where a reduced gradient slice given to ``master.grad`` without ``.float()``, or an all-gather
  of the fp32 masters, passes); models of 6 to 30 weights, so every padding modulo 2 and 3, with
  SGD, and Adam in fp32 (``PRECISIONS`` says why not in bf16). The parameters must be exactly the
  gathered masters cast to their dtype, and the all-gather must move the parameters' bytes, not
  the masters';
* ``03.zero3_gather_free``: blocks in float64 and bf16 (the text frees each parameter to "an empty
  tensor of its own dtype"; every fixed block is fp32, where a buffer or an empty tensor made
  without ``dtype=`` is right by chance), blocks of one weight (fewer than the ranks: a rank's
  whole shard is padding), with and without biases, one to three blocks;
* ``07.stage_step``: a pipeline of one stage (p = 1: rank 0 is also the last rank, so it neither
  receives nor sends and its output is the loss; the text's conditions, "on rank 0", "unless this
  is the last rank", hold for it one by one, while an answer written as first / middle / last
  branches sends from rank 0 regardless), one micro-batch, and fewer micro-batches than stages
  in 1F1B; every fixed case has p >= 2 and m >= 3. Its dtype is not drawn: ``forward_step`` is
  given the activations' dtype, ``backward_step`` receives into ``output``'s, and a buffer made in
  any other dtype already fails the fixed float64 cases (a message of another size).
"""

from __future__ import annotations

import torch

from ultrascale_grading.properties import Property
from ultrascale_grading.properties import seeded_values as _values
from ultrascale_grading.properties import strategies as _st

TIMEOUT = 60.0  # seconds a drawn run may take on the ranks: each is a fraction of a second when right


def _seeded(module: torch.nn.Module, seed: int, dtype) -> torch.nn.Module:
    """``module`` with every parameter drawn from a generator seeded by ``seed`` (in float64, then
    cast): the same weights in every process, whatever the global random state."""
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(_values(seed + i, tuple(p.shape), torch.float64))
    return module.to(dtype)


def _failure(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


# ---- 02.overlapped_dp_hooks ------------------------------------------------------------------

DP_LR = 0.1


# In each strategy below the edge the fixed cases miss comes first (a frozen weight, bf16, float64): it is
# what hypothesis draws first, and what it shrinks towards, so the few draws of QUICK always try it.


def _dp_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            dtype=st.sampled_from((torch.float64, torch.float32)),
            width=st.integers(1, 4),
            frozen=st.sampled_from((True, False)),
            unused=st.sampled_from((True, False)),
            steps=st.integers(1, 2),
            seed=st.integers(0, 99),
        )
    )


class _DPNet(torch.nn.Module):
    """3 -> width -> 2; ``unused``: with a layer the output does not depend on (a head kept for
    another task), which never gets a gradient. (``_dp_model`` freezes the first weight where the
    case says ``frozen``, as a fine-tuned model freezes its embedding.)"""

    def __init__(self, width: int, unused: bool):
        super().__init__()
        self.first, self.second = torch.nn.Linear(3, width), torch.nn.Linear(width, 2)
        self.spare = torch.nn.Linear(width, 1) if unused else None

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _dp_model(case) -> _DPNet:
    model = _seeded(_DPNet(case["width"], case["unused"]), case["seed"], case["dtype"])
    model.first.weight.requires_grad_(not case["frozen"])
    return model


def _dp_batch(case, rank: int, step: int) -> tuple:
    base = 1000 * case["seed"] + 10 * step + rank * 100
    return _values(base, (3, 3), case["dtype"]), _values(base + 1, (3, 2), case["dtype"])


def _trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _dp_on_rank(ctx, OverlappedGradSync, case):
    """Train with the learner's hooks; each step's gradients after ``finish()``, or where it raised."""
    model = _dp_model(case).to(ctx.device)
    try:
        sync = OverlappedGradSync(model)
    except Exception as err:  # every rank builds the same model: all raise here, none waits for the others
        return {"raised": ("OverlappedGradSync(model)", _failure(err))}
    optimizer = torch.optim.SGD(_trainable(model), lr=DP_LR)
    grads = []
    for step in range(case["steps"]):
        x, y = (t.to(ctx.device) for t in _dp_batch(case, ctx.rank, step))
        try:
            torch.nn.functional.mse_loss(model(x), y).backward()
        except Exception as err:
            return {"raised": ("backward (your grad_ready)", _failure(err))}
        try:
            sync.finish()
        except Exception as err:
            return {"raised": (f"finish() of step {step + 1}", _failure(err))}
        grads.append(
            {name: None if p.grad is None else p.grad.detach().cpu().clone() for name, p in model.named_parameters()}
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"grads": grads}


def _dp_reference(case) -> list:
    """Each step's mean over the ranks of their gradients, in float64 in one process."""
    model = _dp_model(case).double()
    optimizer = torch.optim.SGD(_trainable(model), lr=DP_LR)
    means = []
    for step in range(case["steps"]):
        per_rank = []
        for rank in range(case["world_size"]):
            model.zero_grad(set_to_none=True)
            x, y = (t.double() for t in _dp_batch(case, rank, step))
            torch.nn.functional.mse_loss(model(x), y).backward()
            per_rank.append({name: p.grad for name, p in model.named_parameters()})
        mean = {
            name: None if per_rank[0][name] is None else torch.stack([g[name] for g in per_rank]).mean(0)
            for name in per_rank[0]
        }
        for name, p in model.named_parameters():
            p.grad = mean[name]
        optimizer.step()
        means.append(mean)
    return means


def _no_gradient(case) -> str:
    """The parameters of the case that get no gradient, and why."""
    why = []
    if case["frozen"]:
        why.append("`first.weight` is frozen (requires_grad=False)")
    if case["unused"]:
        why.append("the loss does not depend on `spare`")
    return " and ".join(why)


def _judge_dp(OverlappedGradSync, case):
    from ultrascale.runtime import grading_cluster

    results = grading_cluster(case["world_size"]).run(_dp_on_rank, OverlappedGradSync, case, timeout=TIMEOUT)
    for rank, out in enumerate(results):
        if "raised" not in out:
            continue
        where, err = out["raised"]
        if where.startswith("OverlappedGradSync") and case["frozen"]:
            return (
                f"{where} raised {err}: `first.weight` is frozen (requires_grad=False), and autograd refuses a "
                "hook on a tensor that requires no gradient. Register grad_ready only on the parameters that "
                "require one (`if param.requires_grad`), as the text says"
            )
        if where.startswith("finish") and (case["frozen"] or case["unused"]) and "NoneType" in err:
            return (
                f"rank {rank}: {where} raised {err}. Here {_no_gradient(case)}: no hook runs for a parameter "
                "that gets no gradient, and its .grad stays None. finish() must wait for and average only the "
                "gradients whose all-reduce grad_ready launched, not every parameter of the module"
            )
        return f"rank {rank}: {where} raised {err}"
    want = _dp_reference(case)
    tol = 1e-10 if case["dtype"] == torch.float64 else 1e-5
    for rank, out in enumerate(results):
        for step, (got, mean) in enumerate(zip(out["grads"], want)):
            where = f"rank {rank}, after finish() of step {step + 1}"
            for name, expected in mean.items():
                have = got[name]
                if expected is None:  # a frozen or unused parameter: backward leaves it without a gradient
                    if have is not None and bool(have.abs().sum() != 0):
                        return f"{where}: {name}.grad is not zero, but {_no_gradient(case)}"
                    continue
                if have is None:
                    return f"{where}: {name}.grad is None; every parameter that trains must get the mean gradient"
                if have.dtype != case["dtype"] or not torch.allclose(have.double(), expected, rtol=tol, atol=tol):
                    return (
                        f"{where}: {name}.grad is not the mean over the ranks of their gradients (to {tol:g}, "
                        f"in {case['dtype']})"
                    )
    return None


def _describe_dp(case):
    extra = [
        what
        for flag, what in (
            (case["frozen"], "its first weight frozen (requires_grad=False)"),
            (case["unused"], "a layer `spare` the loss does not use"),
        )
        if flag
    ]
    return (
        f"OverlappedGradSync(model) on {case['world_size']} ranks, a 3 -> {case['width']} -> 2 model in "
        f"{case['dtype']}" + (f" with {' and '.join(extra)}" if extra else "") + f", {case['steps']} SGD step(s)"
    )


# ---- 03.zero1_step ---------------------------------------------------------------------------

# (the parameters' dtype, the optimizer). Not bf16 with Adam: Adam's first steps move each weight by
# about lr whatever the size of its gradient, so a weight whose gradients cancel across the ranks, the
# sign of their sum left to bf16's rounding, moves by lr one way or the other, and no tolerance tells
# that from a mistake. SGD moves it by lr times the gradient: bf16's rounding stays small there.
PRECISIONS = ((torch.bfloat16, "sgd"), (torch.float32, "sgd"), (torch.float32, "adam"))


def _zero1_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            precision=st.sampled_from(PRECISIONS),
            inputs=st.integers(1, 4),
            width=st.integers(1, 4),
            steps=st.integers(1, 2),
            seed=st.integers(0, 99),
        )
    ).map(
        lambda case: {
            **{k: v for k, v in case.items() if k != "precision"},
            "dtype": case["precision"][0],
            "optimizer": case["precision"][1],
        }
    )


def _zero1_model(case) -> torch.nn.Module:
    """inputs -> width -> 2: width * (inputs + 3) + 2 weights, from 6 to 30."""
    net = torch.nn.Sequential(
        torch.nn.Linear(case["inputs"], case["width"]), torch.nn.Tanh(), torch.nn.Linear(case["width"], 2)
    )
    return _seeded(net, case["seed"], case["dtype"])


def _zero1_batch(case, rank: int, step: int) -> tuple:
    base = 1000 * case["seed"] + 10 * step + rank * 100
    return _values(base, (3, case["inputs"]), case["dtype"]), _values(base + 1, (3, 2), case["dtype"])


def _zero1_loss(model, case, rank: int, step: int, device=None):
    x, y = (t.to(device) for t in _zero1_batch(case, rank, step))
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def _zero1_on_rank(ctx, zero1_step, case):
    from ultrascale.comm import CommLogger
    from ultrascale_grading.exercise_tests.ch03 import reference_flatten_padded
    from ultrascale.train import make_optimizer

    model = _zero1_model(case).to(ctx.device)
    params = list(model.parameters())
    flat = reference_flatten_padded(params, ctx.world_size)
    shard = flat.numel() // ctx.world_size
    master = flat[ctx.rank * shard : (ctx.rank + 1) * shard].float().clone()  # the fp32 masters, as the check's
    optimizer = make_optimizer([master], case["optimizer"])
    gathered = []  # bytes the all-gathers sent, per step
    for step in range(case["steps"]):
        _zero1_loss(model, case, ctx.rank, step, ctx.device).backward()
        try:
            with CommLogger() as log:
                zero1_step(ctx, params, master, optimizer)
        except Exception as err:  # the ranks run the same code on the same shapes: all raise at one place
            return {"raised": (step, _failure(err))}
        gathered.append(sum(t["bytes_sent"] for op, t in log.totals().items() if op.startswith("all_gather")))
        model.zero_grad(set_to_none=True)
    return {
        "params": [p.detach().cpu().clone() for p in params],
        "master": master.detach().cpu().clone(),
        "gathered": gathered,
        "padded": flat.numel(),
    }


def _zero1_reference(case) -> torch.Tensor:
    """The whole padded master after the steps, in float64 in one process: each rank's gradient
    (computed in the parameters' dtype, as the ranks compute it) averaged in float64, one optimizer
    on the whole master, the parameters set to the master cast to their dtype."""
    from ultrascale_grading.exercise_tests.ch03 import reference_flatten_padded
    from ultrascale.train import make_optimizer

    n = case["world_size"]
    model = _zero1_model(case)
    params = list(model.parameters())
    master = reference_flatten_padded(params, n).double().requires_grad_()
    optimizer = make_optimizer([master], case["optimizer"])
    for step in range(case["steps"]):
        grads = []
        for rank in range(n):
            model.zero_grad(set_to_none=True)
            _zero1_loss(model, case, rank, step).backward()
            grads.append(reference_flatten_padded([p.grad for p in params], n).double())
        master.grad = torch.stack(grads).mean(0)
        optimizer.step()
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(master[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
    return master.detach()


def _judge_zero1(zero1_step, case):
    from ultrascale.runtime import grading_cluster

    n, dtype = case["world_size"], case["dtype"]
    results = grading_cluster(n).run(_zero1_on_rank, zero1_step, case, timeout=TIMEOUT)
    for rank, out in enumerate(results):
        if "raised" in out:
            step, err = out["raised"]
            hint = ""
            if dtype != torch.float32 and "type" in err:
                hint = (
                    f": the parameters and their gradients are {dtype} and the masters fp32. Give the master its "
                    "gradient in fp32 (the reduced slice .float()); the optimizer steps fp32 tensors only"
                )
            return f"rank {rank}: zero1_step of step {step + 1} raised {err}{hint}"
    psi = sum(p.numel() for p in results[0]["params"])
    masters = torch.cat([out["master"] for out in results])
    # Every rank's parameters are the gathered masters cast to their dtype, exactly: a cast is one rounding.
    cast = masters[:psi].to(dtype)
    for rank, out in enumerate(results):
        offset = 0
        for i, p in enumerate(out["params"]):
            if p.dtype != dtype or not torch.equal(p, cast[offset : offset + p.numel()].view_as(p)):
                return (
                    f"rank {rank}: parameter {i} is not the all-gathered master slices cast to {dtype}: copy "
                    "element offset..offset + numel of the gathered buffer into each parameter, in order"
                )
            offset += p.numel()
    size = torch.empty(0, dtype=dtype).element_size()
    for rank, out in enumerate(results):
        for step, sent in enumerate(out["gathered"]):
            per_element = sent * n / (n - 1) / out["padded"]
            if per_element > 1.01 * size:
                return (
                    f"rank {rank}, step {step + 1}: the all-gather moved {per_element:g} bytes per element, but "
                    f"the parameters are {dtype} ({size} bytes each): cast the updated slice to the parameters' "
                    "dtype before gathering it, as the text's step 4 says; an all-gather of the fp32 masters "
                    f"moves {4 // size} times the bytes the parameters need"
                )
    want = _zero1_reference(case)
    start = _seeded_master(case)
    got_update, want_update = masters.double() - start, want - start
    if dtype == torch.float32:
        close = torch.allclose(masters.double(), want, rtol=1e-5, atol=1e-6)
    else:
        # bf16 gradients averaged in bf16 are a few 2^-9 off, and a parameter rounded to bf16 after a
        # first step moves the second step's gradient by up to one bf16 step (2^-8): 5% of the largest
        # update bounds both, where a gradient summed but not averaged is 50% or more off.
        close = bool(((got_update - want_update).abs() <= 0.05 * want_update.abs().max() + 1e-7).all())
    if not close:
        worst = (got_update - want_update).abs().max().item()
        return (
            f"the fp32 masters differ from one process's {case['optimizer']} steps on the mean gradient by up to "
            f"{worst:.3g} (their largest update is {want_update.abs().max().item():.3g}): reduce-scatter the "
            "gradients, divide by the world size, and step this rank's slice only"
        )
    return None


def _seeded_master(case) -> torch.Tensor:
    from ultrascale_grading.exercise_tests.ch03 import reference_flatten_padded

    return reference_flatten_padded(list(_zero1_model(case).parameters()), case["world_size"]).double()


def _describe_zero1(case):
    psi = case["width"] * (case["inputs"] + 3) + 2
    return (
        f"zero1_step on {case['world_size']} ranks, a {case['inputs']} -> {case['width']} -> 2 model ({psi} "
        f"weights) in {case['dtype']} with fp32 masters, {case['optimizer']}, {case['steps']} step(s)"
    )


# ---- 03.zero3_gather_free --------------------------------------------------------------------


def _zero3_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            dtype=st.sampled_from((torch.float64, torch.bfloat16, torch.float32)),
            width=st.integers(1, 4),
            blocks=st.integers(1, 3),
            bias=st.booleans(),
            seed=st.integers(0, 99),
        )
    )


class _Zero3Net(torch.nn.Module):
    """``blocks`` linear layers of ``width``, each followed by tanh: each is sharded and hooked."""

    def __init__(self, width: int, blocks: int, bias: bool):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=bias) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _zero3_model(case) -> _Zero3Net:
    return _seeded(_Zero3Net(case["width"], case["blocks"], case["bias"]), case["seed"], case["dtype"])


def _zero3_on_rank(ctx, install_zero3_hooks, case):
    from ultrascale_grading.exercise_tests.ch03 import shard_module

    reference, model = _zero3_model(case).to(ctx.device), _zero3_model(case).to(ctx.device)
    for block in model.blocks:
        shard_module(ctx, block)
        install_zero3_hooks(ctx, block)
    out = {"outputs": [], "after": []}
    with torch.no_grad():
        for call in range(2):  # twice: the second forward gathers what the first freed
            x = _values(case["seed"] + 50 + call, (2, case["width"]), case["dtype"]).to(ctx.device)
            try:
                got = model(x)
            except Exception as err:  # the same shards' shapes on every rank: all raise at one place
                return {"raised": (call, _failure(err))}
            out["outputs"].append((got.detach().cpu(), reference(x).cpu()))
            out["after"].append([(name, p.dtype, p.numel()) for name, p in model.named_parameters()])
    return out


def _judge_zero3(install_zero3_hooks, case):
    from ultrascale.runtime import grading_cluster

    dtype = case["dtype"]
    results = grading_cluster(case["world_size"]).run(_zero3_on_rank, install_zero3_hooks, case, timeout=TIMEOUT)
    for rank, out in enumerate(results):
        if "raised" in out:
            call, err = out["raised"]
            hint = ""
            if dtype != torch.float32 and "type" in err:
                hint = (
                    f": the shard is {dtype}. Make the gathered buffer in the shard's dtype (torch.empty(..., "
                    "dtype=module.zero3_shard.dtype, device=...)); torch.empty without dtype= is float32"
                )
            return f"rank {rank}: forward {call + 1} raised {err}{hint}"
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 1e-2)  # the same ops on the same weights
    for rank, out in enumerate(results):
        for call, ((got, want), after) in enumerate(zip(out["outputs"], out["after"])):
            where = f"rank {rank}, forward {call + 1}"
            if (
                got.dtype != want.dtype
                or got.shape != want.shape
                or not torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
            ):
                return (
                    f"{where}: the output differs from the unsharded model's: each parameter is flat[offset : "
                    "offset + numel] of the gathered buffer, in its shape"
                )
            for name, kind, numel in after:
                if numel:
                    return (
                        f"{where}: after the forward, {name} still holds {numel} elements; free it in the forward hook"
                    )
                if kind != dtype:
                    return (
                        f"{where}: after the forward, {name} is an empty {kind} tensor, but the block is {dtype}: "
                        "free each parameter to an empty tensor of its own dtype (torch.empty(0, dtype=p.dtype, "
                        "device=p.device)), as shard_module left it; torch.empty(0) is float32"
                    )
    return None


def _describe_zero3(case):
    weights = case["width"] * case["width"] + (case["width"] if case["bias"] else 0)
    return (
        f"install_zero3_hooks on {case['world_size']} ranks, {case['blocks']} block(s) of "
        f"nn.Linear({case['width']}, {case['width']}, bias={case['bias']}) ({weights} weight(s) each) in "
        f"{case['dtype']}, two forwards"
    )


# ---- 07.stage_step ---------------------------------------------------------------------------


def _stage_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(p=st.integers(1, 3), m=st.integers(1, 4), order=st.sampled_from(("1F1B", "AFAB")), seed=st.integers(0, 9))
    )


def _judge_stage(functions, case):
    from ultrascale_grading.exercise_tests.ch07 import check_stages

    p = case["p"]
    one = (
        (
            " With p=1 rank 0 is also the last rank: it receives nothing, sends nothing, and its stage returns the "
            "loss. Test each of the text's conditions by itself (rank > 0: receive; rank < p - 1: send the output; "
            "the last rank: output.backward(); rank > 0: send the input's gradient), not first / middle / last "
            "branches"
        )
        if p == 1
        else ""
    )
    check_stages(*functions, p, case["order"], case["m"], case["seed"], TIMEOUT, hint=one)  # raises what is wrong
    return None


def _describe_stage(case):
    one = " (one stage: rank 0 is also the last)" if case["p"] == 1 else ""
    return f"{case['order']} on p={case['p']} rank(s){one}, m={case['m']} micro-batch(es), seed {case['seed']}"


PROPERTIES: dict = {
    "02.overlapped_dp_hooks": Property(
        _dp_cases,
        _judge_dp,
        _describe_dp,
        draws=(3, 12),
        examples=(
            # a frozen weight and an unused layer in one model, float64 (compared to 1e-10), on 3 ranks
            dict(world_size=3, dtype=torch.float64, width=2, frozen=True, unused=True, steps=2, seed=0),
        ),
    ),
    "03.zero1_step": Property(
        _zero1_cases,
        _judge_zero1,
        _describe_zero1,
        draws=(3, 12),
        examples=(
            # bf16 parameters, fp32 masters, 14 weights (padded on 3 ranks), two SGD steps
            dict(world_size=3, dtype=torch.bfloat16, inputs=1, width=3, optimizer="sgd", steps=2, seed=0),
        ),
    ),
    "03.zero3_gather_free": Property(
        _zero3_cases,
        _judge_zero3,
        _describe_zero3,
        draws=(3, 12),
        examples=(
            # two float64 blocks of one weight each: on 3 ranks, ranks 1 and 2 hold nothing but padding
            dict(world_size=3, dtype=torch.float64, width=1, blocks=2, bias=False, seed=0),
        ),
    ),
    "07.stage_step": Property(
        _stage_cases,
        _judge_stage,
        _describe_stage,
        argument=(0, 1),
        draws=(3, 12),
        examples=(dict(p=1, m=2, order="1F1B", seed=0),),
    ),
}
