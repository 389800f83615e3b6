"""Tests of the A2 exercises (solutions/a2_typical_scales_exercises.ipynb).

* ``a2.scale_counts``: ``scale_counts(h, layers, vocab, seq, mbs, glu=True, tied=True)``
  returns A2's element counts (tokens, hidden states, parameters, gradients, optimizer
  states), checked against ``ultrascale.scales`` on many shapes, as exact integers.
* ``a2.forward_flops``: ``forward_flops(config, batch, seq)`` predicts the FLOPs of one
  forward pass of the course model, checked to the last FLOP against PyTorch's own
  counter (``FlopCounterMode``) run on models actually built: GPT and Llama, grouped-query
  attention, tied and untied heads.
* ``a2.llama_params``: ``llama_params(config)``, the exact parameter count of the course's Llama
  for a ``LlamaConfig``, as section 6 tabulates it for the published shapes: checked against
  ``model.count_params`` on Llama 3 8B (8,030,261,248), 70B and 405B and on small and odd
  shapes (one K/V head, as many as query heads, tied, vocab 1), whose counts the test first
  checks against the built model. Building the model (or calling the library's counters) is
  refused, and the call runs on the meta device, so a 405B model built anyway costs nothing.

While the learner's function runs, the library functions that would give the answer away
(``ultrascale.scales``'s counts; ``model.matmul_params`` and the FLOP counters) refuse to be
called, and so does ``FlopCounterMode``: the exercise is to predict, not to measure.
"""

from __future__ import annotations

import contextlib
import functools
import random
from numbers import Integral

import torch
from torch.utils.flop_counter import FlopCounterMode

from ultrascale import scales
from ultrascale_grading import exercise
from ultrascale_grading.guards import ForbiddenCall, call_learner, without_library
from ultrascale.model import (
    GPTConfig,
    LlamaConfig,
    attention_flops_per_token,
    build_model,
    count_params,
    hfu,
    matmul_params,
    mfu,
    training_flops,
)

KEYS = ("tokens", "hidden states", "parameters", "gradients", "optimizer states")
SCALE_FUNCTIONS = [
    scales.tokens,
    scales.hidden_state_elements,
    scales.weight_elements,
    scales.optimizer_state_elements,
    scales.block_matrices,
    scales.block_params,
    scales.embedding_params,
    scales.model_params,
    scales.scale_row,
]


# ---- a2.scale_counts -------------------------------------------------------------------


def reference_scale_counts(h, layers, vocab, seq, mbs, glu=True, tied=True) -> dict:
    params = scales.model_params(h, layers, vocab, glu=glu, tied=tied)
    return {
        "tokens": scales.tokens(seq, mbs),
        "hidden states": scales.hidden_state_elements(seq, mbs, h),
        "parameters": params,
        "gradients": params,
        "optimizer states": sum(scales.optimizer_state_elements(params).values()),
    }


def _scale_hint(key, got, expected, h, layers, vocab, glu, tied) -> str:
    params = expected["parameters"]
    if key == "optimizer states":
        if got == 2 * params:
            return " (momentum and variance are there; the fp32 master weights are missing: 3 per parameter)"
        if got == 6 * params:
            return (
                " (6 per parameter is the book's '6h²' as printed; the states it lists, momentum, variance "
                "and master weights, are 3 fp32 elements per parameter)"
            )
        if got == 12 * params:
            return " (that is bytes: 3 fp32 elements of 4 bytes; return elements)"
    if key == "parameters":
        other_block = scales.model_params(h, layers, vocab, glu=not glu, tied=tied)
        if got == other_block:
            return f" (with glu={glu} a block has {16 if glu else 12}h², not {12 if glu else 16}h²)"
        if got == scales.model_params(h, layers, vocab, glu=glu, tied=not tied):
            return " (tied=True: the head reuses the embedding, v·h once; tied=False: v·h twice)"
        if got == layers * scales.block_params(h, glu):
            return " (the embedding, v·h, is missing)"
    if key == "hidden states" and got == expected["tokens"]:
        return " (each token is a vector of h numbers)"
    return ""


@exercise("a2.scale_counts", points=1)
def test_scale_counts(scale_counts, quick: bool = True):
    """Every count for many shapes, GLU or not, tied or not; exact integers."""
    scale_counts = without_library(scale_counts, SCALE_FUNCTIONS, "a2.scale_counts", "write A2's formulas yourself")
    shapes = [
        (4096, 32, 128256, 8192, 1),
        (8192, 80, 128256, 8192, 2),
        (16384, 126, 128256, 8192, 1),
        (64, 2, 256, 64, 4),
        (1, 1, 1, 1, 1),
        (12288, 96, 50257, 2048, 3),
    ]
    if not quick:
        shapes += [(768, 12, 50257, 1024, 8), (5, 3, 7, 11, 13)]
    for h, layers, vocab, seq, mbs in shapes:
        for glu in (True, False):
            for tied in (True, False):
                call = (
                    f"scale_counts(h={h}, layers={layers}, vocab={vocab}, seq={seq}, mbs={mbs}, glu={glu}, tied={tied})"
                )
                expected = reference_scale_counts(h, layers, vocab, seq, mbs, glu, tied)
                got = call_learner(
                    scale_counts, h, layers, vocab, seq, mbs, glu=glu, tied=tied, call=call, expected=str(expected)
                )
                assert isinstance(got, dict), f"{call} returned {type(got).__name__}; return a dict with keys {KEYS}"
                missing = [k for k in KEYS if k not in got]
                assert not missing, f"{call}: the dict has no {missing}; its keys must be {KEYS}"
                for key in KEYS:
                    value = got[key]
                    assert isinstance(value, Integral), (
                        f"{call}[{key!r}] is {value!r} ({type(value).__name__}): count with integers "
                        "(h * h, not h ** 2.0 or math.pow), so that large models stay exact"
                    )
                    assert value == expected[key], (
                        f"{call}[{key!r}]: expected {expected[key]:,}, got {value:,}"
                        f"{_scale_hint(key, value, expected, h, layers, vocab, glu, tied)}"
                    )
    default = call_learner(scale_counts, 64, 2, 256, 64, 4)
    assert (
        isinstance(default, dict)
        and default.get("parameters") == reference_scale_counts(64, 2, 256, 64, 4)["parameters"]
    ), "scale_counts(64, 2, 256, 64, 4) should default to glu=True, tied=True"


# ---- a2.forward_flops ------------------------------------------------------------------


@contextlib.contextmanager
def _no_flop_counter():
    """FlopCounterMode refuses to start while the learner's prediction runs."""
    own = FlopCounterMode.__dict__.get("__enter__")  # None if inherited

    def refuse(self):
        raise ForbiddenCall(
            "a2.forward_flops: your code used FlopCounterMode, which measures; this exercise asks "
            "you to predict the count from the configuration alone"
        )

    FlopCounterMode.__enter__ = refuse
    try:
        yield
    finally:
        if own is None:
            del FlopCounterMode.__enter__
        else:
            FlopCounterMode.__enter__ = own


def _guarded(forward_flops):
    inner = without_library(
        forward_flops,
        [matmul_params, attention_flops_per_token, training_flops, mfu, hfu],
        "a2.forward_flops",
        "add up 2 FLOPs per multiply-add of every matrix product",
    )

    @functools.wraps(forward_flops)
    def guarded(*args, **kwargs):
        with _no_flop_counter():
            return inner(*args, **kwargs)

    return guarded


def measured_forward_flops(config, batch: int, seq: int) -> int:
    torch.manual_seed(0)
    model = build_model(config)
    idx = torch.randint(0, config.vocab_size, (batch, seq))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(idx)
    return counter.get_total_flops()


def _flops_hint(got, config, batch, seq) -> str:
    t = batch * seq
    attention = t * 4 * config.layers * config.hidden * seq
    mm = matmul_params(config)
    if got == 2 * t * mm:
        return (
            " That is 2·T·N for the weight matrices alone: attention's Q·K^T and scores·V, which use no "
            "weights, are missing (4·seq·h per layer and token)"
        )
    if got == 2 * t * count_params(config) + attention or got == 2 * t * count_params(config):
        return (
            " You multiplied by every parameter: norms, biases and a separate input embedding do no matrix "
            "product (the embedding is a table lookup); the head, tied or not, does"
        )
    if isinstance(config, LlamaConfig) and config.kv_heads != config.heads:
        wide = 2 * t * (mm + config.layers * 2 * config.hidden * (config.hidden - config.kv_heads * config.head_dim))
        if got in (wide, wide + attention):
            return " k and v are narrower than h x h with grouped-query attention: kv_heads · head_dim outputs each"
    if got == 2 * t * mm + 2 * attention or got == 2 * t * mm + attention // 2:
        return " The attention term is off by a factor 2: Q·K^T and scores·V cost 2·seq·h each per layer and token"
    return ""


FLOP_CASES = [
    (GPTConfig(vocab_size=50, hidden=32, layers=2, heads=4, seq_len=16), 2, 16),
    (GPTConfig(vocab_size=97, hidden=48, layers=3, heads=6, seq_len=16), 1, 24),
    (LlamaConfig(vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, seq_len=16), 3, 16),
    (
        LlamaConfig(vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=4, ffn=40, seq_len=16, tie_embeddings=True),
        2,
        12,
    ),
    (LlamaConfig(vocab_size=128, hidden=64, layers=1, heads=8, kv_heads=1, ffn=176, seq_len=16), 1, 32),
]  # in the third, heads / kv_heads = kv_heads, so h / kv_heads is kv_heads · head_dim there too


@exercise("a2.forward_flops", points=1)
def test_forward_flops(forward_flops, quick: bool = True):
    """Predicted FLOPs of model(idx) equal FlopCounterMode's count on the built model, exactly."""
    forward_flops = _guarded(forward_flops)
    cases = FLOP_CASES  # QUICK too: only the last (8 heads, 1 K/V head) tells h / kv_heads from kv_heads·head_dim
    for config, batch, seq in cases:
        expected = measured_forward_flops(config, batch, seq)
        kind = type(config).__name__
        call = f"forward_flops({kind}(hidden={config.hidden}, layers={config.layers}, ...), batch={batch}, seq={seq})"
        got = call_learner(forward_flops, config, batch, seq, call=call, expected=f"{expected:,} FLOPs")
        assert got is not None, f"{call} returned None: return the number of FLOPs"
        assert got == expected, (
            f"{call} (heads {config.heads}, kv_heads {config.kv_heads}, vocab "
            f"{config.vocab_size}{', tied' if getattr(config, 'tie_embeddings', True) else ''}):"
            f" FlopCounterMode counts {expected:,} FLOPs, you predicted {got:,}."
            f"{_flops_hint(got, config, batch, seq)}"
        )


# ---- a2.llama_params -------------------------------------------------------------------


def _llama_cases(quick: bool):
    from ultrascale.model import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B

    small = [
        LlamaConfig(),
        LlamaConfig(vocab_size=61, hidden=32, layers=3, heads=4, kv_heads=1, ffn=40, tie_embeddings=True),
        LlamaConfig(vocab_size=97, hidden=48, layers=1, heads=6, kv_heads=6, ffn=130),
        LlamaConfig(vocab_size=1, hidden=2, layers=1, heads=1, kv_heads=1, ffn=1, tie_embeddings=True),
    ]
    if not quick:
        rng = random.Random(0)
        for _ in range(20):
            kv = rng.choice([1, 2, 3])
            heads = kv * rng.choice([1, 2, 4])
            small.append(
                LlamaConfig(
                    vocab_size=rng.randint(1, 300),
                    hidden=heads * 2 * rng.randint(1, 6),
                    layers=rng.randint(1, 4),
                    heads=heads,
                    kv_heads=kv,
                    ffn=rng.randint(1, 100),
                    tie_embeddings=rng.random() < 0.5,
                )
            )
    return [LLAMA3_8B, LLAMA3_70B, LLAMA3_405B], small


def _built_params(config) -> int:
    torch.manual_seed(0)
    return sum(p.numel() for p in build_model(config).parameters())


def _llama_hint(got, c) -> str:
    right, h, L, v = count_params(c), c.hidden, c.layers, c.vocab_size
    kv = c.kv_heads * c.head_dim
    tied = c.tie_embeddings
    hints = [
        (right - L * 2 * h - h, "the RMSNorm weights are parameters too: two norms of h per layer, and a final one"),
        (right - h, "the final RMSNorm after the last layer (h weights) is missing"),
        (right - L * 2 * h, "the two RMSNorms of every layer (h weights each) are missing"),
        (right + L * 2 * h * (h - kv), "k and v are h x (kv_heads · head_dim) with grouped-query attention, not h x h"),
        (
            right + v * h if tied else right - v * h,
            "tie_embeddings=True: the head reuses the embedding, v·h once; False: a separate head, v·h twice",
        ),
        (
            scales.model_params(h, L, v, glu=True, tied=tied),
            "that is A2's 16h² estimate; count Llama's real matrices: narrower k and v, three h x ffn MLP matrices",
        ),
    ]
    return next((" " + why + "." for value, why in hints if got == value and value != right), "")


@exercise("a2.llama_params", points=1)
def test_llama_params(llama_params, quick: bool = True):
    """Exact parameter counts of Llama 3 8B, 70B and 405B (8,030,261,248 for the 8B) and of small shapes
    (GQA or not, tied or not, odd sizes), checked for the small ones against the built model."""
    from ultrascale.model import _ffn_params, _llama_matmul_params_per_layer, active_params, feed_forward

    learner = without_library(
        llama_params,
        [
            count_params,
            active_params,
            matmul_params,
            _ffn_params,
            _llama_matmul_params_per_layer,
            build_model,
            feed_forward,
            *SCALE_FUNCTIONS,
        ],
        "a2.llama_params",
        "count the parameters from the config's shape, without building the model",
    )
    published, small = _llama_cases(quick)
    assert count_params(published[0]) == 8_030_261_248  # the test's own reference
    for config in published + small:
        expected = count_params(config)
        if config not in published:
            assert _built_params(config) == expected, config  # the reference, against the real model
        call = (
            f"llama_params(LlamaConfig(vocab_size={config.vocab_size}, hidden={config.hidden}, "
            f"layers={config.layers}, heads={config.heads}, kv_heads={config.kv_heads}, ffn={config.ffn}, "
            f"tie_embeddings={config.tie_embeddings}))"
        )
        with torch.device("meta"):  # a model built anyway costs no memory
            got = call_learner(learner, config, call=call, expected=f"{expected:,}")
        assert isinstance(got, Integral) and not isinstance(got, bool), (
            f"{call} returned {got!r} ({type(got).__name__}): count with integers"
        )
        assert got == expected, f"{call}: expected {expected:,} parameters, got {got:,}.{_llama_hint(got, config)}"
