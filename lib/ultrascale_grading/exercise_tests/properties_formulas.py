"""Properties of the exercises that are formulas, counts and schedules (no ranks): each drawn
input is checked against the library's own function for the same quantity, or the exercise
test's public reference where the library has none (see ``exercise_tests.properties`` for how
they run).

What the draws reach that the fixed cases do not:

* **sizes the fixed cases happen to avoid**: layers the stages do not divide and values far past
  2**53 (a float division or ``h ** 2.0`` is exact on every fixed case and wrong there), 1 x n
  tiles of a transposed matrix, a 0-d one-element tensor, TP degrees of 3 and 6 on nodes of 6
  GPUs, sequences divisible by cp but not by 2 cp, TP degrees above 64;
* **inputs that must be refused** (ValueError): pp outside 1..L, a recompute mode that is a
  substring of a valid one, a sequence that does not cut into 2 cp chunks, a batch that is not
  whole sequences, a matrix the tiles do not divide;
* **realistic magnitudes**: timelines stamped with ``time.time()`` (about 1.7e9 s), loss scales
  within a factor 2 of float32's largest value, Llama 3 405B's shapes and batches.

Every draw is cheap (a formula, or a simulator run of at most a few hundred actions), so 25 of them
cost each exercise well under a second. Exercises whose check passes two functions name the one
tried with ``argument``. None of the 21 is left out: the inputs of each can be drawn.
"""

from __future__ import annotations

import importlib
import math
from fractions import Fraction
from numbers import Integral, Real
from types import SimpleNamespace

import torch

from ultrascale_grading.guards import expect_value_error
from ultrascale_grading.properties import Property
from ultrascale_grading.properties import strategies as _st

FLOAT_EXACT = 2**53  # above this a float no longer holds every integer


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _exact_hint(got, want) -> str:
    """When a float (or an int made from one) misses an exact count that is past 2**53."""
    if isinstance(got, float) or (abs(want) > FLOAT_EXACT and _number(got) and math.isclose(got, want, rel_tol=1e-12)):
        return (
            " Past 2**53 a float no longer holds every integer: count with integers only (h * h, never "
            "h ** 2.0, math.pow or a / b; // and divmod for shares)"
        )
    return ""


def _call(name: str, *args, **kwargs) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


# ---- 00.pipeline_stage_layers ----------------------------------------------------------------


def _stage_layer_cases():
    st = _st()
    layers = st.one_of(st.integers(1, 40), st.integers(2**53, 2**62))  # a 405B count and beyond
    return layers.flatmap(
        lambda n: st.fixed_dictionaries(
            dict(layers=st.just(n), pp=st.one_of(st.integers(1, min(n, 24)), st.sampled_from((0, -1, n + 1, n + 5))))
        )
    )


def _judge_stage_layers(fn, case):
    from ultrascale_grading.exercise_tests.ch00 import reference_stage_layers

    n, pp = case["layers"], case["pp"]
    if not 1 <= pp <= n:
        expect_value_error(fn, n, pp, why=f"{pp} stages cannot each hold at least one of {n} layers")
        return None
    want = reference_stage_layers(n, pp)
    got = list(fn(n, pp))
    if got == want:
        return None
    if not all(_is_int(g) for g in got):
        return f"expected {want}, got {got}: return whole numbers of layers (ints)." + _exact_hint(got[0], want[0])
    if sum(got) != n:
        return f"the stages hold {sum(got)} layers in total, not {n}." + _exact_hint(float(sum(got)), n)
    return f"expected {want}, got {got} (as even as possible, the first num_layers % pp_degree stages one more)"


def _describe_stage_layers(case):
    return _call("pipeline_stage_layers", case["layers"], case["pp"])


# ---- 00.memory_per_stage ---------------------------------------------------------------------


def _memory_stage_cases():
    st = _st()
    return st.integers(1, 130).flatmap(
        lambda n: st.fixed_dictionaries(
            dict(
                layers=st.just(n),
                pp=st.integers(1, min(n, 16)),
                hidden=st.one_of(st.integers(1, 16), st.sampled_from((4096, 12288, 16384))),
                vocab=st.one_of(st.integers(1, 300), st.sampled_from((50257, 128256))),
                bytes_per_param=st.sampled_from((16, 1, 2, 6, 18)),
            )
        )
    )


def _judge_memory_stage(fn, case):
    from ultrascale_grading.exercise_tests.ch00 import reference_memory_per_stage

    args = (case["layers"], case["pp"], case["hidden"], case["vocab"])
    want = reference_memory_per_stage(*args, bytes_per_param=case["bytes_per_param"])
    got = fn(*args, bytes_per_param=case["bytes_per_param"])
    got = list(got) if got is not None else None
    if got is None or len(got) != len(want):
        return f"expected one entry per stage, {want}, got {got}"
    bad = [s for s, (g, w) in enumerate(zip(got, want)) if not (_number(g) and math.isclose(g, w, rel_tol=1e-9))]
    if bad:
        return (
            f"stage {bad[0]} should hold {want[bad[0]]:,} bytes, got {got[bad[0]]!r}: expected {want} (the first "
            "stages take the extra layers; stage 0 the embedding; the last the final LayerNorm and, with more "
            "than one stage, its own copy of the output projection)"
        )
    return None


def _describe_memory_stage(case):
    return _call(
        "memory_per_stage",
        case["layers"],
        case["pp"],
        case["hidden"],
        case["vocab"],
        bytes_per_param=case["bytes_per_param"],
    )


# ---- 01.param_count ----------------------------------------------------------------------------


def _param_count_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            hidden=st.integers(1, 2**20), vocab=st.integers(1, 2**18), layers=st.integers(1, 2**12), tied=st.booleans()
        )
    )


def _judge_param_count(fn, case):
    from ultrascale_grading.exercise_tests.ch01 import reference_param_count

    h, v, L, tied = case["hidden"], case["vocab"], case["layers"], case["tied"]
    want = reference_param_count(h, v, L, tied)
    got = fn(h, v, L, tied=tied)
    if _number(got) and got == want and not isinstance(got, float):
        return None
    if isinstance(got, float) and got == want and got.is_integer():
        return None  # a float the fixed cases accept too: exact here
    return f"expected {want:,}, got {got!r}.{_exact_hint(got, want)}"


def _describe_param_count(case):
    return _call("gpt_param_count", case["hidden"], case["vocab"], case["layers"], tied=case["tied"])


# ---- 01.activation_memory ---------------------------------------------------------------------

MODES = ("none", "selective", "full")
# Not modes: each a typo, a case change or a piece of a valid name (a membership test against the
# string "none selective full", a tuple missing its commas, accepts the pieces).
NOT_MODES = ("None", "FULL", "partial", "", "sel", "ful", "none ", "selective full")


def _activation_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            layers=st.integers(1, 130),
            hidden=st.integers(1, 20000),
            heads=st.integers(1, 128),
            seq=st.integers(1, 2**17),
            micro_batch=st.integers(1, 64),
            recompute=st.one_of(st.sampled_from(MODES), st.sampled_from(NOT_MODES)),
        )
    )


def _judge_activation(fn, case):
    from ultrascale_grading.exercise_tests.ch01 import reference_activation_memory

    args = (case["layers"], case["hidden"], case["heads"], case["seq"], case["micro_batch"], case["recompute"])
    if case["recompute"] not in MODES:
        expect_value_error(
            fn,
            *args,
            why=f"recompute={case['recompute']!r} is none of {MODES} (compare the whole "
            "string with each mode, not a substring)",
        )
        return None
    want = reference_activation_memory(*args)
    got = fn(*args)
    if _number(got) and math.isclose(got, want, rel_tol=1e-9):
        return None
    return f"expected {want:,} bytes, got {got!r}"


def _describe_activation(case):
    return _call(
        "activation_memory",
        case["layers"],
        case["hidden"],
        case["heads"],
        case["seq"],
        case["micro_batch"],
        recompute=case["recompute"],
    )


# ---- 02.grad_acc_steps -------------------------------------------------------------------------


def _grad_acc_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            samples=st.floats(0.75, 2.0**20),  # gbs_tokens / seq_len, before rounding
            seq_len=st.sampled_from((1, 1000, 2048, 3000, 4096, 8192, 131072)),
            mbs=st.integers(1, 8),
            dp=st.one_of(st.integers(1, 24), st.sampled_from((48, 64, 96, 256, 1000, 1024, 4096))),
            as_int=st.booleans(),
        )
    )


def _grad_acc_args(case):
    tokens = case["samples"] * case["seq_len"]
    return (round(tokens) if case["as_int"] else tokens), case["seq_len"], case["mbs"], case["dp"]


def _judge_grad_acc(fn, case):
    from ultrascale.batch_size import samples_per_step
    from ultrascale_grading.exercise_tests.ch02 import reference_grad_acc_steps

    tokens, seq_len, mbs, dp = _grad_acc_args(case)
    try:
        want = reference_grad_acc_steps(tokens, seq_len, mbs, dp)
    except ValueError:
        gbs = samples_per_step(tokens, seq_len)
        expect_value_error(
            fn,
            tokens,
            seq_len,
            mbs,
            dp,
            why=(
                f"mbs x dp = {mbs * dp} exceeds the global batch of {gbs} samples"
                if mbs * dp > gbs
                else f"mbs x dp = {mbs * dp} does not divide the global batch of {gbs} samples"
            ),
        )
        return None
    got = fn(tokens, seq_len, mbs, dp)
    if _is_int(got) and got == want:
        return None
    return (
        f"expected grad_acc = {want} (gbs = {want * mbs * dp} samples, the power of two nearest "
        f"{tokens / seq_len:.4g} on a log scale), got {got!r}" + ("" if _is_int(got) else ": return an int")
    )


def _describe_grad_acc(case):
    return _call("grad_acc_steps", *_grad_acc_args(case))


# ---- 05.activation_memory ---------------------------------------------------------------------


def _sp_activation_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            layers=st.integers(1, 130),
            hidden=st.integers(1, 20000),
            heads=st.integers(1, 128),
            seq=st.integers(1, 2**15),
            micro_batch=st.integers(1, 8),
            tp=st.integers(1, 16),
            sequence_parallel=st.booleans(),
            recompute=st.sampled_from(MODES),
        )
    )


def _judge_sp_activation(fn, case):
    from ultrascale.memory import activation_bytes

    config = SimpleNamespace(layers=case["layers"], hidden=case["hidden"], heads=case["heads"])
    kw = dict(tp=case["tp"], sequence_parallel=case["sequence_parallel"], recompute=case["recompute"])
    want = activation_bytes(config, case["seq"], case["micro_batch"], **kw)
    got = fn(config, case["seq"], case["micro_batch"], **kw)
    if _number(got) and math.isclose(got, want, rel_tol=1e-9):
        return None
    return f"expected {want:,} bytes, got {got!r}" + (
        " (tp does not divide the count here: return the fraction, divide with /, not //)"
        if isinstance(want, float)
        else ""
    )


def _describe_sp_activation(case):
    return (
        f"activation_bytes_per_rank(config with layers={case['layers']}, hidden={case['hidden']}, "
        f"heads={case['heads']}; seq={case['seq']}, micro_batch={case['micro_batch']}, tp={case['tp']}, "
        f"sequence_parallel={case['sequence_parallel']}, recompute={case['recompute']!r})"
    )


# ---- 06.zigzag_chunks (zigzag_positions) --------------------------------------------------------


def _zigzag_cases():
    st = _st()
    return st.integers(1, 8).flatmap(
        lambda cp: st.fixed_dictionaries(
            dict(
                cp=st.just(cp),
                rank=st.integers(0, cp - 1),
                chunk=st.integers(1, 6),
                # 0: whole chunks; k > 0: k tokens more, which do not cut into 2 cp chunks (a multiple of cp
                # among them when k = cp); -1: fewer tokens than chunks
                extra=st.one_of(st.just(0), st.integers(1, 2 * cp - 1), st.just(-1)),
            )
        )
    )


def _zigzag_seq(case):
    if case["extra"] == -1 and case["cp"] > 1:
        return case["cp"]
    return 2 * case["cp"] * case["chunk"] + max(case["extra"], 0)


def _judge_zigzag(fn, case):
    from ultrascale import data

    seq, rank, cp = _zigzag_seq(case), case["rank"], case["cp"]
    if seq % (2 * cp):
        expect_value_error(
            fn,
            seq,
            rank,
            cp,
            why=f"{seq} tokens do not cut into 2 * {cp} = {2 * cp} equal chunks"
            + (f" (that cp = {cp} divides {seq} is not enough)" if seq % cp == 0 else ""),
        )
        return None
    want = data.sequence_positions(seq, rank, cp, "zigzag")
    got = fn(seq, rank, cp)
    if torch.is_tensor(got) and got.dim() == 1 and not got.is_floating_point() and torch.equal(got.long(), want):
        return None
    shown = got.tolist() if torch.is_tensor(got) else got
    return f"expected the 1-D integer tensor {want.tolist()}, got {shown!r}"


def _describe_zigzag(case):
    return _call("zigzag_positions", _zigzag_seq(case), case["rank"], case["cp"])


# ---- 07.one_f_one_b -----------------------------------------------------------------------------


def _one_f_one_b_cases():
    st = _st()
    return st.fixed_dictionaries(dict(p=st.integers(1, 8), m=st.integers(1, 12)))


def _actions(got, rank):
    from ultrascale.schedule import Action, parse

    if not isinstance(got, (list, tuple)):
        raise AssertionError(f"rank {rank}: return a list such as ['F0', 'F1', 'B0', ...], got {type(got).__name__}")
    out = []
    for item in got:
        actions = parse(item, stage=rank) if isinstance(item, str) else [Action(*item)]
        if len(actions) != 1:
            raise AssertionError(f"rank {rank}: {item!r} is not one action; write one per item, e.g. 'F3'")
        out += actions
    return out


def _judge_one_f_one_b(fn, case):
    from ultrascale.schedule import Schedule, ScheduleError, simulate

    p, m = case["p"], case["m"]
    lists = [_actions(fn(p, m, rank), rank) for rank in range(p)]
    beyond = [
        f"rank {r}: {a.op}{a.microbatch}" for r, acts in enumerate(lists) for a in acts if not 0 <= a.microbatch < m
    ]
    if beyond:
        return f"{beyond[0]}, but there are only m={m} micro-batches (0..{m - 1}): cap the warm-up at m"
    try:
        sim = simulate(Schedule("your 1F1B", lists, m))
    except ScheduleError as err:
        return f"the lists of the {p} ranks are not a schedule that can run: {err}"
    want = [min(p - r, m) for r in range(p)]
    if abs(sim.bubble_fraction - (p - 1) / m) > 1e-9:
        return f"the simulated bubble is {sim.bubble_fraction:.4f}, not (p-1)/m = {(p - 1) / m:.4f}"
    if sim.peak_activations != want:
        return f"the ranks hold {sim.peak_activations} micro-batches at once; 1F1B holds {want} (min(p - rank, m))"
    return None


def _describe_one_f_one_b(case):
    return f"one_f_one_b_list(p={case['p']}, m={case['m']}, rank) for every rank"


# ---- 07.bubble_fraction ---------------------------------------------------------------------------


def _bubble_cases():
    st = _st()
    span = st.tuples(st.integers(0, 40), st.integers(1, 40))  # (gap before it, duration), in ms
    return st.fixed_dictionaries(
        dict(
            ranks=st.lists(st.lists(span, min_size=1, max_size=5), min_size=1, max_size=5),
            start=st.sampled_from((0.0, 100.0, 1.7e9)),  # 1.7e9: a time.time() stamp
            reverse=st.booleans(),
        )
    )


def _bubble_spans(case):
    spans = []
    for r, rank in enumerate(case["ranks"]):
        t, own = case["start"] + 0.003 * r, []
        for gap, duration in rank:
            t += gap * 1e-3
            own.append((t, t + duration * 1e-3))
            t += duration * 1e-3
        spans.append(own[::-1] if case["reverse"] else own)
    return spans


def _judge_bubble(fn, case):
    simulate = importlib.import_module("ultrascale.schedule.simulate")  # the package has a function so named

    spans = _bubble_spans(case)
    rows = [
        [dict(rank=r, name=f"forward {i} stage {r}", start=a, end=b) for i, (a, b) in enumerate(rank)]
        for r, rank in enumerate(spans)
    ]
    want = simulate.bubble_fraction(rows)
    got = fn([list(rank) for rank in spans])
    if _number(got) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9):
        return None
    hint = ""
    if case["start"] > 1e6:
        hint = (
            ". The times are large (about 1.7e9 s, as time.time() gives) and the spans milliseconds: take each "
            "span's own end - start before adding, since a sum of the ends minus a sum of the starts cancels "
            "almost every digit"
        )
    return f"expected r_bubble = {want:.6g}, got {got!r}{hint}"


def _describe_bubble(case):
    spans = _bubble_spans(case)
    return (
        f"bubble(spans) with {len(spans)} rank(s) of {[len(r) for r in spans]} spans, starting at "
        f"t = {case['start']:g} s{', each rank listed newest first' if case['reverse'] else ''}: {spans}"
    )


# ---- 09.pp_activations --------------------------------------------------------------------------


def _pp_activation_cases():
    st = _st()
    return st.integers(1, 64).flatmap(
        lambda layers: st.fixed_dictionaries(
            dict(
                per_layer=st.one_of(st.integers(1, 10**4), st.integers(2**30, 2**40)),
                layers=st.just(layers),
                pp=st.integers(1, min(layers, 12)),
                micro_batches=st.integers(1, 24),
                schedule=st.sampled_from(("afab", "1f1b")),
            )
        )
    )


def _judge_pp_activation(fn, case):
    from ultrascale_grading.exercise_tests.ch09 import reference_pp_activations

    args = (case["per_layer"], case["layers"], case["pp"], case["micro_batches"], case["schedule"])
    want = reference_pp_activations(*args)
    got = fn(*args)
    if _number(got) and got == want:
        return None
    return (
        f"expected {want:,} bytes (ceil(layers / pp) = {math.ceil(case['layers'] / case['pp'])} layers on the "
        f"first stage), got {got!r}"
    )


def _describe_pp_activation(case):
    return _call(
        "pp_activations", case["per_layer"], case["layers"], case["pp"], case["micro_batches"], case["schedule"]
    )


# ---- 09.rank_parameters -------------------------------------------------------------------------


def _rank_param_cases():
    st = _st()
    # pp and stage drawn as raw integers and folded into range, so that each shrinks on its own
    return st.fixed_dictionaries(
        dict(
            tp=st.sampled_from((1, 2, 3, 4, 8)),
            heads_per_tp=st.integers(1, 6),
            head_dim=st.integers(1, 8),
            vocab_per_tp=st.integers(1, 80),
            layers=st.integers(1, 40),
            pp_raw=st.integers(0, 7),
            stage_raw=st.integers(0, 7),
        )
    )


def _rank_param_split(case):
    pp = 1 + case["pp_raw"] % min(case["layers"], 8)
    return pp, case["stage_raw"] % pp


def _rank_param_config(case):
    from ultrascale.model import GPTConfig

    heads = case["heads_per_tp"] * case["tp"]  # tp divides the heads, the hidden size and the vocabulary
    return GPTConfig(
        vocab_size=case["vocab_per_tp"] * case["tp"],
        hidden=heads * 2 * case["head_dim"],
        heads=heads,
        layers=case["layers"],
    )  # RoPE: an even head_dim


def _judge_rank_param(fn, case):
    from ultrascale.parallel import compose

    config = _rank_param_config(case)
    pp, stage = _rank_param_split(case)
    want = compose.rank_parameters(config, tp=case["tp"], pp=pp, stage=stage)
    got = fn(config, tp=case["tp"], pp=pp, stage=stage)
    if _number(got) and got == want:
        return None
    blocks = case["layers"] // pp + (stage < case["layers"] % pp)
    return (
        f"expected {want:,}, got {got!r} (stage {stage} holds {blocks} blocks: the first layers % pp stages one more)"
    )


def _describe_rank_param(case):
    c, (pp, stage) = _rank_param_config(case), _rank_param_split(case)
    return (
        f"rank_parameters(GPTConfig(vocab_size={c.vocab_size}, hidden={c.hidden}, heads={c.heads}, "
        f"layers={c.layers}), tp={case['tp']}, pp={pp}, stage={stage})"
    )


# ---- 10.enumerate ---------------------------------------------------------------------------------


def _enumerate_cases():
    st = _st()
    return st.sampled_from((1, 2, 3, 4, 6, 8, 12)).flatmap(
        lambda heads: st.fixed_dictionaries(
            dict(
                gpus=st.integers(1, 24),
                sequences=st.integers(1, 24),
                seq=st.sampled_from((8, 12, 16, 24, 64)),
                layers=st.integers(1, 12),
                heads=st.just(heads),
                kv_heads=st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0]),
                gpus_per_node=st.sampled_from((1, 2, 3, 4, 6, 8, 16)),
                ragged=st.integers(0, 3),
            )
        )
    )  # > 0: that many tokens past whole sequences (refused)


def _enumerate_args(case):
    batch = case["sequences"] * case["seq"] + case["ragged"]
    return case["gpus"], batch, case["seq"], case["layers"], case["heads"], case["kv_heads"]


def _judge_enumerate(fn, case):
    from ultrascale import plan
    from ultrascale.model import LlamaConfig

    args, node = _enumerate_args(case), case["gpus_per_node"]
    gpus, batch, seq, layers, heads, kv = args
    if case["ragged"]:
        expect_value_error(
            fn, *args, gpus_per_node=node, why=f"{batch} tokens are not a whole number of {seq}-token sequences"
        )
        return None
    model = LlamaConfig(
        vocab_size=256, hidden=8 * heads, layers=layers, heads=heads, kv_heads=kv, ffn=16 * heads, seq_len=64
    )
    want = {
        (c.dp, c.tp, c.pp, c.cp, c.mbs, c.gas)
        for c in plan.enumerate_configs(
            model,
            gpus=gpus,
            global_batch_tokens=batch,
            seq=seq,
            gpus_per_node=node,
            zero_stages=(0,),
            recompute=("none",),
            max_cp=gpus,
        )
    }
    got = {tuple(int(x) for x in t) for t in fn(*args, gpus_per_node=node)}
    if got == want:
        return None
    extra, missing = sorted(got - want), sorted(want - got)
    text = f"{len(got)} layouts, expected {len(want)}"
    if extra:
        text += f"; {extra[0]} (dp, tp, pp, cp, mbs, gas) breaks a rule"
    if missing:
        text += f"; the valid {missing[0]} is missing"
    return text + (
        ". TP may be any divisor of gpus_per_node that divides the heads and K/V heads, not only a power of two"
        if any(t[1] & (t[1] - 1) for t in missing)
        else ""
    )


def _describe_enumerate(case):
    return _call("layouts", *_enumerate_args(case), gpus_per_node=case["gpus_per_node"])


# ---- 12.decode_float -------------------------------------------------------------------------------

DECODE_FORMATS = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
SAME_WIDTH = {32: torch.int32, 16: torch.int16, 8: torch.uint8}


def _decode_cases():
    st = _st()
    return st.sampled_from(DECODE_FORMATS).flatmap(
        lambda dtype: st.fixed_dictionaries(
            dict(
                dtype=st.just(dtype),
                bits=st.integers(0, 2 ** torch.finfo(dtype).bits - 1),  # any pattern: NaNs too
                shape=st.sampled_from(((1,), (), (1, 1), (1, 1, 1))),
            )
        )
    )


def _decode_tensor(case):
    width = torch.finfo(case["dtype"]).bits
    bits = case["bits"]
    if width > 8 and bits >= 1 << (width - 1):  # int16 and int32 are signed: the same bits, as a negative number
        bits -= 1 << width
    return torch.tensor([bits], dtype=SAME_WIDTH[width]).view(case["dtype"]).reshape(case["shape"])


def _judge_decode(fn, case):
    from ultrascale.precision import formats

    x = _decode_tensor(case)
    ref = formats.decode(x)
    want = (ref.sign, ref.exponent, ref.mantissa)
    got = fn(x)
    if isinstance(got, (tuple, list)) and len(got) == 3 and tuple(int(v) for v in got) == want:
        return None
    return f"expected (sign, exponent, mantissa) = {want} (bits {ref.bit_string()}), got {got!r}" + (
        ". A one-element tensor may have any shape, 0-d included: x.reshape(1) before indexing" if x.dim() != 1 else ""
    )


def _describe_decode(case):
    x = _decode_tensor(case)
    return (
        f"decode_float(x) with x of shape {tuple(x.shape)}{' (0-d)' if x.dim() == 0 else ''}, {case['dtype']}, "
        f"holding the bits {case['bits']:#x} ({x.float().item()!r})"
    )


# ---- 12.quantize_tiles -------------------------------------------------------------------------------

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _tile_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            tile_rows=st.integers(1, 4),
            tile_cols=st.integers(1, 5),
            grid_rows=st.integers(1, 3),
            grid_cols=st.integers(1, 3),
            fp8=st.sampled_from(FP8),
            dtype=st.sampled_from((torch.float32, torch.float64, torch.bfloat16)),
            exponent=st.integers(-6, 30),
            zero_tile=st.booleans(),
            transposed=st.booleans(),
            ragged=st.sampled_from((0, 0, 0, 1)),
            seed=st.integers(0, 99),
        )
    )


def _tile_input(case):
    rows = case["tile_rows"] * case["grid_rows"] + case["ragged"]
    cols = case["tile_cols"] * case["grid_cols"]
    g = torch.Generator().manual_seed(case["seed"])
    x = (
        torch.randn(cols, rows, generator=g, dtype=torch.float64).t()
        if case["transposed"]
        else torch.randn(rows, cols, generator=g, dtype=torch.float64)
    )
    x = x * 10.0 ** case["exponent"]
    if case["zero_tile"]:
        x[: case["tile_rows"], : case["tile_cols"]] = 0.0  # tile (0, 0) all zeros
    return x.to(case["dtype"])  # .to keeps a transposed view's strides: still not contiguous


def _judge_tiles(fn, case):
    from ultrascale.precision import scaling

    x, tr, tc, fp8 = _tile_input(case), case["tile_rows"], case["tile_cols"], case["fp8"]
    if x.shape[0] % tr:
        expect_value_error(fn, x, tr, tc, fp8, why=f"{x.shape[0]} rows do not split into tiles of {tr} rows")
        return None
    want_q, want_scales = scaling.quantize_tiles(x, (tr, tc), fp8)
    got = fn(x, tr, tc, fp8)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return "return the pair (q, scales)"
    q, scales = got
    if not (torch.is_tensor(q) and q.dtype == fp8 and q.shape == x.shape):
        return f"q must be a {fp8} tensor of x's shape {tuple(x.shape)}"
    if not (torch.is_tensor(scales) and scales.shape == want_scales.shape):
        return f"scales must have one entry per tile, shape {tuple(want_scales.shape)}"
    scales = scales.double()
    zero = want_scales.double() * fp8_max_of(fp8) <= 2 * scaling.MIN_AMAX  # all-zero tiles: any tiny positive scale
    if not (torch.isfinite(scales).all() and (scales > 0).all()):
        return f"every scale must be finite and positive, got {scales.flatten().tolist()}" + (
            ": an all-zero tile has amax 0, so clamp each tile's amax away from 0 (e.g. 1e-12) before dividing"
            if bool(zero.any())
            else ""
        )
    if not torch.allclose(scales[~zero], want_scales.double()[~zero], rtol=1e-5, atol=0):
        return (
            f"the scales should be each tile's max|x| / {fp8_max_of(fp8):g}: {want_scales.tolist()}, got "
            f"{scales.tolist()}"
        )
    per_element = scales.repeat_interleave(tr, 0).repeat_interleave(tc, 1)
    deq = q.double() * per_element
    bound = scaling.rounding_bound(x.float(), per_element.float(), fp8).double() * (1 + 1e-5) + 1e-30
    if not (torch.isfinite(deq).all() and ((deq - x.double()).abs() <= bound).all()):
        return "q * scale is farther from x than FP8's rounding to nearest allows"
    return None


def fp8_max_of(dtype) -> float:
    return torch.finfo(dtype).max


def _describe_tiles(case):
    x = _tile_input(case)
    return (
        f"quantize_tiles(x, {case['tile_rows']}, {case['tile_cols']}, {case['fp8']}) with x of shape "
        f"{tuple(x.shape)}, {case['dtype']}{' (a transposed view, not contiguous)' if case['transposed'] else ''}, "
        f"values of size ~1e{case['exponent']}{', tile (0, 0) all zeros' if case['zero_tile'] else ''}"
    )


# ---- 12.update_scale ---------------------------------------------------------------------------------


def _update_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            # a float32 scale: 24 bits of mantissa times a power of two, up to float32's largest binade, so
            # that a power-of-two factor keeps it exact and the overflow test is decided by the last bits
            mantissa=st.integers(2**23, 2**24 - 1),
            exponent=st.one_of(st.integers(-60, 127), st.integers(120, 127)),
            growth_interval=st.integers(1, 6),
            found_inf=st.booleans(),
            growth_factor=st.sampled_from((2.0, 4.0, 8.0)),
            backoff_factor=st.sampled_from((0.5, 0.25, 0.125)),
            tracker_left=st.integers(1, 6),
        )
    )  # good steps left before growing (1: this step grows)


def _update_args(case):
    scale = math.ldexp(case["mantissa"], case["exponent"] - 23)
    tracker = max(case["growth_interval"] - case["tracker_left"], 0)
    return scale, tracker, case["found_inf"]


def _update_settings(case):
    return {k: case[k] for k in ("growth_factor", "backoff_factor", "growth_interval")}


def _judge_update(fn, case):
    from ultrascale.precision import loss_scaling

    scale, tracker, found = _update_args(case)
    want = loss_scaling.update_scale(scale, tracker, found, **_update_settings(case))
    got = fn(scale, tracker, found, **_update_settings(case))
    if isinstance(got, (tuple, list)) and len(got) == 2 and (float(got[0]), int(got[1])) == (float(want[0]), want[1]):
        return None
    grown = scale * case["growth_factor"]
    hint = ""
    if not found and want[1] == 0 and abs(grown - torch.finfo(torch.float32).max) < 1e-3 * grown:
        hint = (
            f". The grown scale {grown!r} is this close to float32's largest value, "
            f"{torch.finfo(torch.float32).max!r}: compare with torch.finfo(torch.float32).max itself, not a "
            "rounded constant"
        )
    return f"expected {tuple(want)} (torch.amp.GradScaler's rule), got {got!r}{hint}"


def _describe_update(case):
    return _call("update_scale", *_update_args(case), **_update_settings(case))


# ---- a2.scale_counts ----------------------------------------------------------------------------------


def _scale_count_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            h=st.integers(1, 2**20),
            layers=st.integers(1, 2**12),
            vocab=st.integers(1, 2**18),
            seq=st.integers(1, 2**17),
            mbs=st.integers(1, 64),
            glu=st.booleans(),
            tied=st.booleans(),
        )
    )


def _judge_scale_counts(fn, case):
    from ultrascale_grading.exercise_tests.cha2 import reference_scale_counts

    args = (case["h"], case["layers"], case["vocab"], case["seq"], case["mbs"])
    want = reference_scale_counts(*args, glu=case["glu"], tied=case["tied"])
    got = fn(*args, glu=case["glu"], tied=case["tied"])
    if not isinstance(got, dict):
        return f"return a dict with the keys {list(want)}, got {type(got).__name__}"
    for key, value in want.items():
        if key not in got:
            return f"the dict has no {key!r}"
        if not (_is_int(got[key]) and got[key] == value):
            return f"[{key!r}]: expected {value:,}, got {got[key]!r}.{_exact_hint(got[key], value)}"
    return None


def _describe_scale_counts(case):
    return _call(
        "scale_counts",
        case["h"],
        case["layers"],
        case["vocab"],
        case["seq"],
        case["mbs"],
        glu=case["glu"],
        tied=case["tied"],
    )


# ---- a2.forward_flops ---------------------------------------------------------------------------------


def _flop_config_cases():
    st = _st()
    small = st.fixed_dictionaries(
        dict(
            kind=st.sampled_from(("gpt", "llama")),
            kv_heads=st.integers(1, 4),
            groups=st.integers(1, 4),
            head_dim=st.integers(1, 8),
            layers=st.integers(1, 6),
            vocab=st.integers(1, 300),
            ffn=st.integers(1, 300),
            tied=st.booleans(),
        )
    )
    big = st.sampled_from(("LLAMA3_8B", "LLAMA3_70B", "LLAMA3_405B"))
    return st.fixed_dictionaries(
        dict(
            config=st.one_of(small, big),
            batch=st.integers(1, 8),
            seq=st.one_of(st.integers(1, 64), st.sampled_from((4096, 8192, 131072))),
        )
    )


def _flop_config(spec):
    from ultrascale import model

    if isinstance(spec, str):
        return getattr(model, spec)
    heads = spec["kv_heads"] * spec["groups"]
    if spec["kind"] == "gpt":
        return model.GPTConfig(
            vocab_size=spec["vocab"], hidden=heads * 2 * spec["head_dim"], layers=spec["layers"], heads=heads
        )  # RoPE: an even head_dim
    return model.LlamaConfig(
        vocab_size=spec["vocab"],
        hidden=heads * 2 * spec["head_dim"],
        layers=spec["layers"],
        heads=heads,
        kv_heads=spec["kv_heads"],
        ffn=spec["ffn"],
        tie_embeddings=spec["tied"],
    )


def reference_forward_flops(config, batch: int, seq: int) -> int:
    """The library's count of one forward's matmul FLOPs: 2 per weight a token multiplies, plus the
    attention products, 4 seq h per layer (a third of ``attention_flops_per_token``'s forward +
    backward); tests/test_properties_formulas.py checks it against FlopCounterMode."""
    from ultrascale.model import attention_flops_per_token, matmul_params

    tokens = batch * seq
    return 2 * tokens * matmul_params(config) + tokens * attention_flops_per_token(config, seq) // 3


def _judge_flops(fn, case):
    config = _flop_config(case["config"])
    want = reference_forward_flops(config, case["batch"], case["seq"])
    with torch.device("meta"):  # a model built anyway costs no memory (the fixed cases refuse it)
        got = fn(config, case["batch"], case["seq"])
    if _number(got) and got == want and not isinstance(got, float):
        return None
    if isinstance(got, float) and got == want and got.is_integer():
        return None
    return f"expected {want:,} FLOPs, got {got!r}.{_exact_hint(got, want)}"


def _describe_flops(case):
    c = _flop_config(case["config"])
    name = case["config"] if isinstance(case["config"], str) else type(c).__name__
    return (
        f"forward_flops({name} with hidden={c.hidden}, layers={c.layers}, heads={c.heads}, kv_heads={c.kv_heads}, "
        f"vocab={c.vocab_size}, batch={case['batch']}, seq={case['seq']})"
    )


# ---- a2.llama_params ----------------------------------------------------------------------------------


def _llama_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            kv_heads=st.integers(1, 16),
            groups=st.integers(1, 16),
            head_dim=st.integers(1, 128),
            layers=st.integers(1, 200),
            vocab=st.integers(1, 2**18),
            ffn=st.integers(1, 2**16),
            tied=st.booleans(),
        )
    )


def _llama_config(case):
    from ultrascale.model import LlamaConfig

    heads = case["kv_heads"] * case["groups"]
    return LlamaConfig(
        vocab_size=case["vocab"],
        hidden=heads * 2 * case["head_dim"],
        layers=case["layers"],
        heads=heads,
        kv_heads=case["kv_heads"],
        ffn=case["ffn"],
        tie_embeddings=case["tied"],
    )


def _judge_llama(fn, case):
    from ultrascale.model import count_params

    config = _llama_config(case)
    want = count_params(config)
    with torch.device("meta"):
        got = fn(config)
    if _is_int(got) and got == want:
        return None
    return f"expected {want:,}, got {got!r}.{_exact_hint(got, want)}"


def _describe_llama(case):
    c = _llama_config(case)
    return (
        f"llama_params(LlamaConfig(vocab_size={c.vocab_size}, hidden={c.hidden}, layers={c.layers}, "
        f"heads={c.heads}, kv_heads={c.kv_heads}, ffn={c.ffn}, tie_embeddings={c.tie_embeddings}))"
    )


# ---- a3.dp_ratio ----------------------------------------------------------------------------------------


def _dp_ratio_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            num_tokens=st.integers(1, 10**6),
            num_params=st.integers(1, 10**12),
            dp=st.integers(1, 2**16),
            peak_flops=st.floats(1e6, 1e16),
            peak_bw=st.floats(1e6, 1e13),
        )
    )


def _judge_dp_ratio(fn, case):
    from ultrascale import overlap

    args = tuple(case[k] for k in ("num_tokens", "num_params", "dp", "peak_flops", "peak_bw"))
    want = overlap.dp_ratio(*args)
    got = fn(*args)
    if _number(got) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-300):
        return None
    return f"expected {want!r}, got {got!r}" + (
        " (dp = 1 all-reduces nothing: the ratio is 0)" if case["dp"] == 1 else ""
    )


def _describe_dp_ratio(case):
    return _call("dp_ratio", *(case[k] for k in ("num_tokens", "num_params", "dp", "peak_flops", "peak_bw")))


# ---- a3.hiding_limits (max_tp) ----------------------------------------------------------------------------


def _max_tp_cases():
    st = _st()
    # spec-sheet-like numbers (a few significant digits times a power of ten): exact as floats, so
    # Fraction gives the true boundary; bandwidths up to the FLOP rate, where TP in the hundreds hides
    flops = st.tuples(st.integers(1, 9999), st.integers(9, 15)).map(lambda me: float(me[0] * 10 ** me[1]))
    bw = st.tuples(st.integers(1, 9999), st.integers(3, 12)).map(lambda me: float(me[0] * 10 ** me[1]))
    return st.fixed_dictionaries(
        dict(h=st.integers(1, 2**15), peak_flops=flops, peak_bw=bw, bytes_per_element=st.sampled_from((1, 2, 4)))
    ).filter(_tp_at_most_4096)


def _tp_at_most_4096(case) -> bool:
    # the text lets a learner count upwards: a degree in the millions would only test patience
    return 2 * case["h"] * case["peak_bw"] <= 4096 * case["bytes_per_element"] * case["peak_flops"]


def _judge_max_tp(fn, case):
    from ultrascale_grading.exercise_tests.cha3 import reference_max_tp

    h, f, b, nbytes = case["h"], case["peak_flops"], case["peak_bw"], case["bytes_per_element"]
    want = reference_max_tp(h, f, b, nbytes)
    got = fn(h, f, b, bytes_per_element=nbytes)
    if _number(got) and float(got).is_integer() and got == want:
        return None
    bound = Fraction(2 * h) * Fraction(b) / (Fraction(nbytes) * Fraction(f))
    if _number(got) and abs(got - want) == 1 and abs(bound - round(bound)) < Fraction(1, 10**9) * bound:
        return None  # the ratio lands on 1 within a float's rounding: either neighbour is fair
    hint = ""
    if _number(got) and got < want and want > 64:
        hint = f": TP = {want} still gives a ratio of at most 1 here; search no fixed range of degrees (solve for TP)"
    return f"expected {want}, got {got!r}{hint}"


def _describe_max_tp(case):
    return _call("max_tp", case["h"], case["peak_flops"], case["peak_bw"], bytes_per_element=case["bytes_per_element"])


# ---- a3.bucketed_exposure ---------------------------------------------------------------------------------


def _exposure_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            buckets=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 10**9)), min_size=0, max_size=8),
            dp=st.integers(1, 1024),
            peak_bw=st.sampled_from((1e5, 12.5e9, 50e9, 450e9)),
            generator=st.booleans(),
            tuple_bytes=st.booleans(),
        )
    )


def _exposure_args(case):
    times = [t / 8000 for t, _ in case["buckets"]]  # up to 50 ms per segment, in exact eighths of a ms
    nbytes = [n for _, n in case["buckets"]]
    return times, (tuple(nbytes) if case["tuple_bytes"] else nbytes), case["dp"], case["peak_bw"]


def _judge_exposure(fn, case):
    from ultrascale_grading.exercise_tests.cha3_bucketed_exposure import reference_exposed

    times, nbytes, dp, bw = _exposure_args(case)
    want = float(reference_exposed(times, nbytes, dp, bw))
    given = (t for t in times) if case["generator"] else list(times)
    got = fn(given, nbytes, dp, bw)
    if _number(got) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
        return None
    return f"expected {want:.9g} s, got {got!r}"


def _describe_exposure(case):
    times, nbytes, dp, bw = _exposure_args(case)
    return _call("exposed_allreduce_time", times, nbytes, dp, bw) + (
        " with backward_times as a generator" if case["generator"] else ""
    )


PROPERTIES: dict = {
    "00.pipeline_stage_layers": Property(
        _stage_layer_cases,
        _judge_stage_layers,
        _describe_stage_layers,
        examples=(dict(layers=2**62 + 1, pp=3), dict(layers=7, pp=8)),
    ),
    "00.memory_per_stage": Property(_memory_stage_cases, _judge_memory_stage, _describe_memory_stage),
    "01.param_count": Property(
        _param_count_cases,
        _judge_param_count,
        _describe_param_count,
        examples=(dict(hidden=2**20 - 1, vocab=2**18 - 3, layers=2**12 - 1, tied=False),),
    ),
    "01.activation_memory": Property(
        _activation_cases,
        _judge_activation,
        _describe_activation,
        examples=(dict(layers=2, hidden=64, heads=4, seq=128, micro_batch=1, recompute="sel"),),
    ),
    "02.grad_acc_steps": Property(_grad_acc_cases, _judge_grad_acc, _describe_grad_acc),
    "05.activation_memory": Property(_sp_activation_cases, _judge_sp_activation, _describe_sp_activation),
    "06.zigzag_chunks": Property(
        _zigzag_cases, _judge_zigzag, _describe_zigzag, argument=0, examples=(dict(cp=4, rank=0, chunk=1, extra=4),)
    ),  # 12 tokens: cp divides them, 2 cp does not
    "07.one_f_one_b": Property(
        _one_f_one_b_cases, _judge_one_f_one_b, _describe_one_f_one_b, examples=(dict(p=8, m=3), dict(p=5, m=1))
    ),
    "07.bubble_fraction": Property(
        _bubble_cases,
        _judge_bubble,
        _describe_bubble,
        examples=(dict(ranks=[[(0, 1), (3, 7)], [(2, 5)]], start=1.7e9, reverse=False),),
    ),
    "09.pp_activations": Property(_pp_activation_cases, _judge_pp_activation, _describe_pp_activation),
    "09.rank_parameters": Property(_rank_param_cases, _judge_rank_param, _describe_rank_param),
    "10.enumerate": Property(
        _enumerate_cases,
        _judge_enumerate,
        _describe_enumerate,
        examples=(dict(gpus=6, sequences=6, seq=12, layers=2, heads=6, kv_heads=3, gpus_per_node=6, ragged=0),),
    ),
    "12.decode_float": Property(
        _decode_cases, _judge_decode, _describe_decode, examples=(dict(dtype=torch.bfloat16, bits=0xC0B8, shape=()),)
    ),
    "12.quantize_tiles": Property(
        _tile_cases,
        _judge_tiles,
        _describe_tiles,
        examples=(
            # an all-zero tile (no fixed case has one) in a transposed bf16 matrix
            dict(
                tile_rows=2,
                tile_cols=3,
                grid_rows=2,
                grid_cols=2,
                fp8=torch.float8_e5m2,
                dtype=torch.bfloat16,
                exponent=0,
                zero_tile=True,
                transposed=True,
                ragged=0,
                seed=0,
            ),
        ),
    ),
    "12.update_scale": Property(
        _update_cases,
        _judge_update,
        _describe_update,
        examples=(
            # grows to 3.4014e38: still below float32's largest value, 3.40282e38
            dict(
                mantissa=0xFFE000,
                exponent=126,
                growth_interval=1,
                found_inf=False,
                growth_factor=2.0,
                backoff_factor=0.5,
                tracker_left=1,
            ),
        ),
    ),
    "a2.scale_counts": Property(
        _scale_count_cases,
        _judge_scale_counts,
        _describe_scale_counts,
        examples=(dict(h=2**20 - 1, layers=2**12 - 1, vocab=2**18 - 1, seq=2**17, mbs=64, glu=True, tied=False),),
    ),
    "a2.forward_flops": Property(
        _flop_config_cases, _judge_flops, _describe_flops, examples=(dict(config="LLAMA3_405B", batch=8, seq=8192),)
    ),
    "a2.llama_params": Property(_llama_cases, _judge_llama, _describe_llama),
    "a3.dp_ratio": Property(
        _dp_ratio_cases,
        _judge_dp_ratio,
        _describe_dp_ratio,
        examples=(dict(num_tokens=4096, num_params=405_000_000_000, dp=1, peak_flops=989e12, peak_bw=450e9),),
    ),
    "a3.hiding_limits": Property(
        _max_tp_cases,
        _judge_max_tp,
        _describe_max_tp,
        argument=0,
        examples=(dict(h=16384, peak_flops=1e12, peak_bw=450e9, bytes_per_element=1),),
    ),  # TP up to 14,746 hides
    "a3.bucketed_exposure": Property(
        _exposure_cases,
        _judge_exposure,
        _describe_exposure,
        examples=(
            dict(
                buckets=[(8, 10**8), (8, 10**8), (8, 10**8)], dp=64, peak_bw=12.5e9, generator=True, tuple_bytes=False
            ),
        ),
    ),
}
