"""Tests of the chapter 10 exercises (solutions/10_best_configuration_exercises.ipynb).

* ``10.enumerate``: ``layouts(gpus, global_batch_tokens, seq, layers, heads, kv_heads,
  gpus_per_node=8)``, the set of ``(dp, tp, pp, cp, mbs, gas)`` tuples of a dense model
  (``dp*pp*cp*tp = gpus``, ``mbs*gas*dp*seq = batch``, TP inside a node and dividing the
  heads and K/V heads, ``pp <= layers``, cp > 1 cutting seq into ``2*cp`` chunks), compared
  with ``plan.enumerate_configs`` on the book's sizes and random ones; a batch that is not a
  whole number of sequences must raise ValueError.
* ``10.memory_filter``: ``fitting(model, configs, seq, memory_bytes, headroom)``, the configs
  whose busiest GPU fits in ``memory_bytes * (1 - headroom)``, each with the bytes it needs,
  through ``memory.breakdown`` (allowed); compared with ``plan.fit.memory_filter`` on dense
  Llama 3 models and on an MoE one (its experts split by ep); a pipeline's first stage holds
  the micro-batches its schedule keeps in flight (gas of them when gas < pp under 1F1B).
* ``10.step1``: ``step1_techniques(n_params, gpus, gpus_per_node=8, long_sequence=False,
  moe=False)``, the book's step-1 rule as a list of sets of technique names, compared (as a set
  of sets) with ``plan.rules.step1_techniques`` at the rule's boundaries (511/512 and 1023/1024
  GPUs; 10B parameters on each side of them), on nodes of 1, 4, 8 and 16 GPUs, and on random
  inputs.
* ``10.smallest_pp``: ``smallest_pp(model, layout, seq, memory_bytes)``, the smallest pp
  dividing the layers at which rank 0 (the first 1F1B stage, pp micro-batches of one sequence,
  bf16, selective recomputation) fits, held against dry runs (``dryrun_extrapolated``; a
  process remembers its dry runs, so the learner's scan and the check's measurements run once).

While the learner's code runs, the planner's own functions (``ultrascale.plan``) refuse to run
(in the first three exercises; the fourth may use anything).
"""

from __future__ import annotations

import dataclasses
import math
import random

from ultrascale import memory
from ultrascale import plan as _plan
from ultrascale_grading import exercise
from ultrascale_grading.guards import call_learner, expect_value_error, without_library
from ultrascale.model import LLAMA3_8B, LLAMA3_70B, LlamaConfig
from ultrascale.plan import enumerate as _enumerate
from ultrascale.plan import fit as _fit
from ultrascale.plan import rules as _rules
from ultrascale.plan import search as _search
from ultrascale.plan import steptime as _steptime

PLANNER = [
    _enumerate.enumerate_configs,
    _enumerate.violations,
    _enumerate.sequences_per_step,
    _enumerate.divisors,
    _fit.memory_per_gpu,
    _fit.memory_filter,
    _fit.fits,
    _search.plan,
    _steptime.step_time,
    _rules.step1_techniques,
    _rules.step2_gradient_accumulation,
    _rules.techniques,
]


def _model(layers, heads, kv_heads):
    return LlamaConfig(
        vocab_size=256, hidden=8 * heads, layers=layers, heads=heads, kv_heads=kv_heads, ffn=16 * heads, seq_len=64
    )


def _reference_layouts(gpus, batch, seq, layers, heads, kv_heads, gpus_per_node=8) -> set:
    model = _model(layers, heads, kv_heads)
    return {
        (c.dp, c.tp, c.pp, c.cp, c.mbs, c.gas)
        for c in _plan.enumerate_configs(
            model,
            gpus=gpus,
            global_batch_tokens=batch,
            seq=seq,
            gpus_per_node=gpus_per_node,
            zero_stages=(0,),
            recompute=("none",),
            max_cp=gpus,
        )
    }


def _enumerate_cases(quick: bool):
    fixed = [
        (8, 2**20, 4096, 32, 32, 8),
        (16, 2**20, 4096, 32, 32, 8),
        (12, 24 * 64, 64, 6, 12, 4),
        (6, 6 * 32, 32, 2, 6, 6),
        (7, 14 * 64, 64, 8, 4, 4),
        (32, 64 * 128, 128, 4, 24, 8, 4),
        (8, 8 * 24, 24, 1, 4, 4),
    ]  # cp 8 divides seq 24 but 2 cp does not: the zig-zag rule
    rng = random.Random(10)
    more = []
    for _ in range(6 if quick else 40):
        heads = rng.choice([4, 6, 8, 12, 16, 32])
        more.append(
            (
                rng.randint(1, 24),
                rng.choice([1, 2, 3, 4, 6, 8, 12, 16]) * 64 * rng.randint(1, 4),
                64,
                rng.randint(1, 12),
                heads,
                rng.choice([k for k in (1, 2, 4, heads) if heads % k == 0]),
            )
        )
    return fixed + more


def _layout_hint(got: set, expected: set) -> str:
    extra, missing = sorted(got - expected), sorted(expected - got)
    text = ""
    if extra:
        dp, tp, pp, cp, mbs, gas = extra[0]
        text += f" You return {len(extra)} layout(s) that break a rule, e.g. (dp, tp, pp, cp, mbs, gas) = {extra[0]}"
    if missing:
        text += f"{';' if text else ''} you miss {len(missing)} valid layout(s), e.g. {missing[0]}"
    return (
        text + ". Rules: TP divides the GPUs of a node and the heads and K/V heads; pp <= layers; cp > 1 needs seq "
        "divisible by 2*cp; dp*pp*cp*tp = gpus; mbs*gas*dp*seq = batch."
    )


@exercise("10.enumerate", points=1)
def test_enumerate(layouts, quick: bool = True):
    """The set of valid layouts equals the planner's on the book's sizes and random small ones."""
    layouts = without_library(layouts, PLANNER, "10.enumerate", "enumerate the degrees yourself")
    for case in _enumerate_cases(quick):
        gpus, batch, seq, layers, heads, kv = case[:6]
        node = case[6] if len(case) > 6 else 8
        call = (
            f"layouts(gpus={gpus}, global_batch_tokens={batch}, seq={seq}, layers={layers}, heads={heads}, "
            f"kv_heads={kv}, gpus_per_node={node})"
        )
        expected = _reference_layouts(gpus, batch, seq, layers, heads, kv, node)
        got = call_learner(layouts, gpus, batch, seq, layers, heads, kv, gpus_per_node=node, call=call)
        assert got is not None, f"{call} returned None; return a set of (dp, tp, pp, cp, mbs, gas) tuples"
        got = {tuple(int(x) for x in t) for t in got}
        assert got == expected, f"{call}: {len(got)} layouts, expected {len(expected)}.{_layout_hint(got, expected)}"
    expect_value_error(layouts, 8, 2**20 + 1, 4096, 32, 32, 8, why="the batch is not a whole number of sequences")


# Llama 3 8B with 8 experts in every block: only ep splits the experts, so a filter that ignores
# them (or splits everything by ep) keeps the wrong configs or gives the wrong bytes.
MOE_8B = dataclasses.replace(LLAMA3_8B, experts=8, top_k=2)


def _filter_cases(quick: bool):
    rng = random.Random(11)
    n = 30 if quick else 200
    cases = []
    for model, gpus in ((LLAMA3_8B, 16), (LLAMA3_70B, 64)):
        configs = list(_plan.enumerate_configs(model, gpus=gpus, global_batch_tokens=2**20, seq=4096, max_cp=4))
        cases.append((model, rng.sample(configs, n), 4096, rng.choice([40e9, 80e9, 141e9]), rng.choice([0.0, 0.1])))
    # Half of the MoE sample has ep > 1; on 80 GB every one of those that fits would not fit unsplit.
    configs = list(_plan.enumerate_configs(MOE_8B, gpus=16, global_batch_tokens=2**20, seq=2048, max_cp=4))
    split = [c for c in configs if c.ep > 1]
    cases.append((MOE_8B, rng.sample(split, n // 2) + rng.sample(configs, n // 2), 2048, 80e9, 0.1))
    return cases


def _experts_hint(model, c, seq, usable, *, kept=None, nbytes=None) -> str:
    """Name the mistake when the learner's decision on ``c`` (``kept``) or its bytes (``nbytes``)
    is what the memory model gives with the experts left whole, or with ep taken for more TP."""
    if c.ep == 1:
        return ""
    mistakes = (
        (
            dataclasses.replace(c, ep=1),
            f" With {model.experts} experts per block and ep={c.ep}, each GPU holds {model.experts // c.ep} of them: "
            "pass breakdown ep=c.ep (it divides the expert parameters, and only those, by ep)",
        ),
        (
            dataclasses.replace(c, tp=c.tp * c.ep, ep=1),
            f" You divided every weight (and the activations) by ep={c.ep}, as TP would: ep splits only the experts; "
            "attention and norms stay whole on every ep rank. Pass breakdown ep=c.ep",
        ),
    )
    for wrong, hint in mistakes:
        need = _fit.memory_per_gpu(model, wrong, seq)["total"]
        if (kept is not None and kept == (need <= usable)) or (
            nbytes is not None and math.isclose(nbytes, need, rel_tol=1e-9)
        ):
            return hint
    return ""


def _pipeline_hint(model, c, seq, usable, *, kept=None, nbytes=None) -> str:
    """Name the mistake when the learner's decision on ``c`` (``kept``) or its bytes (``nbytes``)
    is the memory model's default pipeline, pp micro-batches in flight, where gas < pp holds fewer."""
    if c.pp == 1 or (c.schedule == "1f1b" and c.gas >= c.pp):
        return ""
    default = memory.breakdown(
        model,
        seq=seq,
        micro_batch=c.mbs,
        recompute=c.recompute,
        zero_stage=c.zero,
        tp=c.tp,
        dp=c.dp * c.cp,
        pp=c.pp,
        cp=c.cp,
        ep=c.ep,
        sequence_parallel=True,
    )
    need = sum(default[k] for k in _fit.CONSUMERS)
    if (kept is not None and kept == (need <= usable)) or (
        nbytes is not None and math.isclose(nbytes, need, rel_tol=1e-9)
    ):
        return (
            f" With pp={c.pp} and gas={c.gas} micro-batches under {c.schedule}, the first stage holds "
            f"{min(c.pp, c.gas) if c.schedule == '1f1b' else 'what the schedule keeps'} in flight, not pp: "
            "pass breakdown schedule=c.schedule and micro_batches=c.gas"
        )
    return ""


@exercise("10.memory_filter", points=1)
def test_memory_filter(fitting, quick: bool = True):
    """The configs that fit and their bytes equal the planner's filter (within 1e-9 relative)."""
    fitting = without_library(fitting, PLANNER, "10.memory_filter", "call memory.breakdown yourself")
    for model, configs, seq, memory_bytes, headroom in _filter_cases(quick):
        usable = memory_bytes * (1 - headroom)
        expected, _ = _fit.memory_filter(
            model, configs, seq, _plan.Hardware(memory_bytes=memory_bytes, memory_headroom=headroom)
        )
        assert not model.experts or any(c.ep > 1 for c, _ in expected), "the MoE case must keep configs with ep > 1"
        call = (
            f"fitting({model.hidden=}, {model.experts=}, {len(configs)} configs, seq={seq}, "
            f"memory_bytes={memory_bytes:.3g}, headroom={headroom})"
        )
        got = call_learner(fitting, model, configs, seq, memory_bytes, headroom, call=call)
        assert got is not None, f"{call} returned None; return a list of (config, bytes) pairs"
        got = list(got)
        expected_set = {c for c, _ in expected}
        got_set = {c for c, _ in got}
        if got_set != expected_set:
            wrong = sorted(got_set ^ expected_set)[0]
            need = _fit.memory_per_gpu(model, wrong, seq)["total"]
            raise AssertionError(
                f"{call}: {wrong.short()} needs {need / 1e9:.2f} GB of the {usable / 1e9:.2f} GB usable, so it "
                f"{'fits' if wrong in expected_set else 'does not fit'}, but you "
                f"{'left it out' if wrong in expected_set else 'kept it'}. Pass ZeRO the ranks that hold the same "
                "weights (dp * cp), the memory model tp, pp, cp, ep, the micro-batch and (pp > 1) the schedule and its "
                "micro-batches, and compare with memory_bytes * (1 - headroom)."
                + _experts_hint(model, wrong, seq, usable, kept=wrong in got_set)
                + _pipeline_hint(model, wrong, seq, usable, kept=wrong in got_set)
            )
        for c, nbytes in got:
            want = _fit.memory_per_gpu(model, c, seq)["total"]
            assert math.isclose(nbytes, want, rel_tol=1e-9), (
                f"{call}: {c.short()} needs {want / 1e9:.4f} GB, you say {nbytes / 1e9:.4f}: call breakdown with "
                "the layout's degrees (ZeRO shards over dp * cp ranks, ep splits the experts) and add parameters, "
                "gradients, optimizer states and activations."
                + _experts_hint(model, c, seq, usable, nbytes=nbytes)
                + _pipeline_hint(model, c, seq, usable, nbytes=nbytes)
            )


STEP1_CASES = [
    (3e9, 8),
    (9.99e9, 8),
    (10e9, 8),
    (3e9, 12),
    (3e9, 16),
    (70e9, 64),
    (70e9, 511),
    (70e9, 512),
    (8e9, 1023),
    (405e9, 1024),
    (405e9, 16384),
    (1e9, 1),
    (100e9, 256),
    # the 10B boundary again where the GPUs' count decides first: 512-1023 and 1024+
    (9.99e9, 512),
    (10e9, 512),
    (10e9, 1023),
    (9.99e9, 1024),
    (10e9, 1024),
    (3e9, 16384),
]
# (n_params, gpus, gpus_per_node): nodes of 4, 16 and 1 GPU move a small model's one-node limit
STEP1_NODE_CASES = [(3e9, 4, 4), (3e9, 5, 4), (3e9, 8, 4), (3e9, 16, 16), (3e9, 9, 16), (3e9, 1, 1), (3e9, 2, 1)]


def _step1_hint(got, n, gpus, node, long_sequence, moe) -> str:
    """Name the mistake when ``got`` is the other side of a small model's one-node test, or (from
    512 GPUs) the other side of the 10B test."""
    if gpus >= 512:
        other = _rules.step1_techniques(1e9 if n >= 10e9 else 10e9, gpus, long_sequence=long_sequence, moe=moe)
        if got != {frozenset(o) for o in other}:
            return ""
        return (
            f". At {gpus} GPUs the options still depend on the model's size: this one has "
            f"{'10B parameters or more' if n >= 10e9 else 'under 10B (n_params < 10e9)'}, and a model under 10B "
            "needs no PP (it fits without, as the under-10B rule says)"
        )
    if n >= 10e9:
        return ""
    one_node = gpus <= node
    flipped = _rules.step1_techniques(
        n, gpus, gpus_per_node=gpus - 1 if one_node else gpus, long_sequence=long_sequence, moe=moe
    )
    if got != {frozenset(o) for o in flipped}:
        return ""
    if one_node:
        where = f". {gpus} GPUs fit on one node of gpus_per_node={node} (gpus <= gpus_per_node)"
    else:
        where = f". {gpus} GPUs on nodes of gpus_per_node={node} take {math.ceil(gpus / node)} nodes, more than one"
    eight = node != 8 and got == {
        frozenset(o) for o in _rules.step1_techniques(n, gpus, long_sequence=long_sequence, moe=moe)
    }
    return (
        where
        + ", so a model under 10B gets the "
        + ("one-node" if one_node else "multi-node")
        + " options"
        + (": compare gpus with the gpus_per_node you are given, not with 8" if eight else "")
    )


@exercise("10.step1", points=1)
def test_step1(step1_techniques, quick: bool = True):
    """The combinations equal the library's rule at its boundaries, with CP and EP extras, on
    nodes of 8 GPUs (the default) and of other sizes."""
    step1_techniques = without_library(step1_techniques, PLANNER, "10.step1", "write the rule's branches")
    rng = random.Random(12)
    cases = [(n, gpus, None) for n, gpus in STEP1_CASES] + STEP1_NODE_CASES
    cases += [(10 ** rng.uniform(8, 12), rng.randint(1, 20000), None) for _ in range(10 if quick else 100)]
    for n, gpus, node in cases:
        # None: the default of 8 GPUs per node, not passed
        options = {} if node is None else {"gpus_per_node": node}
        for long_sequence, moe in ((False, False), (True, False), (False, True), (True, True)):
            call = (
                f"step1_techniques({n:.4g}, {gpus}, {''.join(f'{k}={v}, ' for k, v in options.items())}"
                f"long_sequence={long_sequence}, moe={moe})"
            )
            expected = {
                frozenset(o) for o in _rules.step1_techniques(n, gpus, long_sequence=long_sequence, moe=moe, **options)
            }
            got = call_learner(step1_techniques, n, gpus, long_sequence=long_sequence, moe=moe, call=call, **options)
            assert got is not None, f"{call} returned None; return a list of sets of technique names"
            got = {frozenset(o) for o in got}
            assert got == expected, (
                f"{call}: expected {sorted(sorted(o) for o in expected)}, got "
                f"{sorted(sorted(o) for o in got)}" + _step1_hint(got, n, gpus, node or 8, long_sequence, moe)
            )


# ---- 10.smallest_pp: the smallest pipeline that fits, measured by dry runs -------------------
# (model, layout without PP, seq, memory_bytes): on 45 GB the formula's pp is 2, the dry run's 4
# (70B's activations are 1.5x the formula's); on 36 GB for 8B at 8192 tokens the same (2 and 4).
PP_CASES = [
    (LLAMA3_70B, dict(tp=8, sp=True, dp=4, zero=1, optimizer="adam"), 4096, 45e9),
    (LLAMA3_8B, dict(tp=2, sp=True, dp=8, zero=1, optimizer="adam"), 8192, 36e9),
]


def _pp_candidates(model) -> list:
    return [d for d in range(1, model.layers + 1) if model.layers % d == 0]


def measured_first_stage(model, layout, seq, pp):
    """Rank 0 (the first stage) of ``layout`` with ``pp`` stages, as the exercise's text says to run it."""
    import torch

    from ultrascale.dryrun import dryrun_extrapolated

    stage = dataclasses.replace(layout, pp=pp, microbatches=pp)
    return dryrun_extrapolated(stage, model, 0, micro_batch=1, seq=seq, dtype=torch.bfloat16, recompute="selective")


def _formula_total(model, layout, seq, pp) -> float:
    parts = memory.breakdown(
        model,
        seq=seq,
        micro_batch=1,
        recompute="selective",
        zero_stage=layout.zero,
        tp=layout.tp,
        dp=layout.dp,
        pp=pp,
        schedule="1f1b",
        micro_batches=pp,
    )
    return sum(parts[k] for k in _fit.CONSUMERS)


@exercise("10.smallest_pp", points=1)
def test_smallest_pp(smallest_pp, quick: bool = True):
    """The answer is the smallest pp dividing the layers whose first stage, measured by a dry run,
    fits; the pp below it does not (memory only falls as pp grows: the weights split further, the
    activations of 1F1B's first stage stay those of about all the layers)."""
    from ultrascale.parallel.compose import ParallelConfig as Layout

    for model, fields, seq, memory_bytes in PP_CASES[: 1 if quick else None]:
        check_smallest_pp(smallest_pp, model, Layout(**fields), seq, memory_bytes)


def check_smallest_pp(smallest_pp, model, layout, seq, memory_bytes) -> None:
    """The learner's answer for one problem against the dry runs; raise what is wrong.
    ultrascale.dryrun remembers each dry run by its arguments: the learner's scan, the contract's
    second call and the measurements here are one set of dry runs."""
    call = f"smallest_pp(Llama 3 of hidden {model.hidden}, {layout}, seq={seq}, memory_bytes={memory_bytes:.4g})"
    got = call_learner(smallest_pp, model, layout, seq, memory_bytes, call=call)
    candidates = _pp_candidates(model)
    assert got is None or got in candidates, (
        f"{call} returned {got!r}: a stage count must divide the {model.layers} layers (even stages), "
        f"one of {candidates}"
    )
    fits = {}
    for pp in candidates:  # up to the first that fits, as a learner's scan does
        fits[pp] = measured_first_stage(model, layout, seq, pp)
        if fits[pp].total_bytes <= memory_bytes:
            break
    answer = next((pp for pp, dry in fits.items() if dry.total_bytes <= memory_bytes), None)
    if got != answer:
        _wrong_pp(call, got, answer, model, layout, seq, memory_bytes, candidates, fits)


def _wrong_pp(call, got, answer, model, layout, seq, memory_bytes, candidates, fits) -> None:
    assert got is not None, f"{call} returned None, but a pipeline of some depth fits: measure each pp"
    dry = fits.get(got) or measured_first_stage(model, layout, seq, got)
    gb = {k: f"{v / 1e9:.1f}" for k, v in dry.memory().items()}
    if dry.total_bytes > memory_bytes:
        hints = ""
        if _formula_total(model, layout, seq, got) <= memory_bytes:
            hints += (
                " memory.breakdown's formula says it fits: its activations are GPT's (34 bytes per "
                "token and hidden unit, no loss), and a Llama block keeps more; measure with the dry "
                "run rather than the formula."
            )
        if dry.total_bytes - dry.optimizer_states <= memory_bytes:
            hints += " Without its optimizer states it would fit: count them too (ZeRO's shards of Adam's)."
        raise AssertionError(
            f"{call} returned {got}, but at pp={got} the first stage holds {dry.total_bytes / 1e9:.1f} GB "
            f"measured (parameters {gb['parameters']}, gradients {gb['gradients']}, optimizer states "
            f"{gb['optimizer states']}, activations {gb['activations']}): more than {memory_bytes / 1e9:.0f} "
            f"GB, it does not fit.{hints} (A scan returns the first depth that fits, not the last that does "
            "not.)"
        )
    smaller = [pp for pp in candidates if pp < got]
    beyond = smaller and smaller[-1] == answer
    powers = answer & (answer - 1) and not got & (got - 1)  # the answer is no power of two, the one given is
    raise AssertionError(
        f"{call} returned {got}, which fits ({dry.total_bytes / 1e9:.1f} GB measured), but a smaller pp "
        f"that divides the layers fits too: return the smallest."
        + (" You went one stage count too far: stop at the first pp that fits." if beyond else "")
        + (
            f" Only powers of two were tried: every divisor of the {model.layers} layers is a depth, {candidates}."
            if powers
            else ""
        )
    )
