"""Tests of the A2 exercises (solutions/a2_typical_scales_exercises.ipynb).

* ``a2.scale_counts``: ``scale_counts(h, layers, vocab, seq, mbs, glu=True, tied=True)``
  returns A2's element counts (tokens, hidden states, parameters, gradients, optimizer
  states), checked against ``ultrascale.scales`` on many shapes, as exact integers.
* ``a2.forward_flops``: ``forward_flops(config, batch, seq)`` predicts the FLOPs of one
  forward pass of the course model, checked to the last FLOP against PyTorch's own
  counter (``FlopCounterMode``) run on models actually built: GPT and Llama, grouped-query
  attention, tied and untied heads.

While the learner's function runs, the library functions that would give the answer away
(``ultrascale.scales``'s counts; ``model.matmul_params`` and the FLOP counters) refuse to be
called, and so does ``FlopCounterMode``: the exercise is to predict, not to measure.
"""

from __future__ import annotations

import contextlib
import functools
from numbers import Integral

import torch
from torch.utils.flop_counter import FlopCounterMode

from ultrascale import scales
from ultrascale.grading import exercise
from ultrascale.grading.guards import ForbiddenCall, call_learner, without_library
from ultrascale.model import (GPTConfig, LlamaConfig, attention_flops_per_token, build_model, count_params, hfu,
                              matmul_params, mfu, training_flops)

KEYS = ("tokens", "hidden states", "parameters", "gradients", "optimizer states")
SCALE_FUNCTIONS = [scales.tokens, scales.hidden_state_elements, scales.weight_elements,
                   scales.optimizer_state_elements, scales.block_matrices, scales.block_params,
                   scales.embedding_params, scales.model_params, scales.scale_row]


# ---- a2.scale_counts -------------------------------------------------------------------

def reference_scale_counts(h, layers, vocab, seq, mbs, glu=True, tied=True) -> dict:
    params = scales.model_params(h, layers, vocab, glu=glu, tied=tied)
    return {"tokens": scales.tokens(seq, mbs), "hidden states": scales.hidden_state_elements(seq, mbs, h),
            "parameters": params, "gradients": params,
            "optimizer states": sum(scales.optimizer_state_elements(params).values())}


def _scale_hint(key, got, expected, h, layers, vocab, glu, tied) -> str:
    params = expected["parameters"]
    if key == "optimizer states":
        if got == 2 * params:
            return " (momentum and variance are there; the fp32 master weights are missing: 3 per parameter)"
        if got == 6 * params:
            return (" (6 per parameter is the book's '6h²' as printed; the states it lists, momentum, variance "
                    "and master weights, are 3 fp32 elements per parameter)")
        if got == 12 * params:
            return " (that is bytes: 3 fp32 elements of 4 bytes; return elements)"
    if key == "parameters":
        other_block = scales.model_params(h, layers, vocab, glu=not glu, tied=tied)
        if got == other_block:
            return f" (with glu={glu} a block has {16 if glu else 12}h², not {12 if glu else 16}h²)"
        if got == scales.model_params(h, layers, vocab, glu=glu, tied=not tied):
            return (" (tied=True: the head reuses the embedding, v·h once; tied=False: v·h twice)")
        if got == layers * scales.block_params(h, glu):
            return " (the embedding, v·h, is missing)"
    if key == "hidden states" and got == expected["tokens"]:
        return " (each token is a vector of h numbers)"
    return ""


@exercise("a2.scale_counts", points=1)
def test_scale_counts(scale_counts, quick: bool = True):
    """Every count for many shapes, GLU or not, tied or not; exact integers."""
    scale_counts = without_library(scale_counts, SCALE_FUNCTIONS, "a2.scale_counts",
                                   "write A2's formulas yourself")
    shapes = [(4096, 32, 128256, 8192, 1), (8192, 80, 128256, 8192, 2), (16384, 126, 128256, 8192, 1),
              (64, 2, 256, 64, 4), (1, 1, 1, 1, 1), (12288, 96, 50257, 2048, 3)]
    if not quick:
        shapes += [(768, 12, 50257, 1024, 8), (5, 3, 7, 11, 13)]
    for h, layers, vocab, seq, mbs in shapes:
        for glu in (True, False):
            for tied in (True, False):
                call = (f"scale_counts(h={h}, layers={layers}, vocab={vocab}, seq={seq}, mbs={mbs}, glu={glu}, "
                        f"tied={tied})")
                expected = reference_scale_counts(h, layers, vocab, seq, mbs, glu, tied)
                got = call_learner(scale_counts, h, layers, vocab, seq, mbs, glu=glu, tied=tied, call=call,
                                   expected=str(expected))
                assert isinstance(got, dict), f"{call} returned {type(got).__name__}; return a dict with keys {KEYS}"
                missing = [k for k in KEYS if k not in got]
                assert not missing, f"{call}: the dict has no {missing}; its keys must be {KEYS}"
                for key in KEYS:
                    value = got[key]
                    assert isinstance(value, Integral), (
                        f"{call}[{key!r}] is {value!r} ({type(value).__name__}): count with integers "
                        "(h * h, not h ** 2.0 or math.pow), so that large models stay exact")
                    assert value == expected[key], (
                        f"{call}[{key!r}]: expected {expected[key]:,}, got {value:,}"
                        f"{_scale_hint(key, value, expected, h, layers, vocab, glu, tied)}")
    default = call_learner(scale_counts, 64, 2, 256, 64, 4)
    assert isinstance(default, dict) and default.get("parameters") == reference_scale_counts(64, 2, 256, 64, 4)[
        "parameters"], "scale_counts(64, 2, 256, 64, 4) should default to glu=True, tied=True"


# ---- a2.forward_flops ------------------------------------------------------------------

@contextlib.contextmanager
def _no_flop_counter():
    """FlopCounterMode refuses to start while the learner's prediction runs."""
    own = FlopCounterMode.__dict__.get("__enter__")   # None if inherited

    def refuse(self):
        raise ForbiddenCall("a2.forward_flops: your code used FlopCounterMode, which measures; this exercise asks "
                            "you to predict the count from the configuration alone")

    FlopCounterMode.__enter__ = refuse
    try:
        yield
    finally:
        if own is None:
            del FlopCounterMode.__enter__
        else:
            FlopCounterMode.__enter__ = own


def _guarded(forward_flops):
    inner = without_library(forward_flops, [matmul_params, attention_flops_per_token, training_flops, mfu, hfu],
                            "a2.forward_flops", "add up 2 FLOPs per multiply-add of every matrix product")

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
        return (" That is 2·T·N for the weight matrices alone: attention's Q·K^T and scores·V, which use no "
                "weights, are missing (4·seq·h per layer and token)")
    if got == 2 * t * count_params(config) + attention or got == 2 * t * count_params(config):
        return (" You multiplied by every parameter: norms, biases and a separate input embedding do no matrix "
                "product (the embedding is a table lookup); the head, tied or not, does")
    if isinstance(config, LlamaConfig) and config.kv_heads != config.heads:
        wide = 2 * t * (mm + config.layers * 2 * config.hidden * (config.hidden - config.kv_heads * config.head_dim))
        if got in (wide, wide + attention):
            return (" k and v are narrower than h x h with grouped-query attention: kv_heads · head_dim outputs each")
    if got == 2 * t * mm + 2 * attention or got == 2 * t * mm + attention // 2:
        return " The attention term is off by a factor 2: Q·K^T and scores·V cost 2·seq·h each per layer and token"
    return ""


FLOP_CASES = [
    (GPTConfig(vocab_size=50, hidden=32, layers=2, heads=4, seq_len=16), 2, 16),
    (GPTConfig(vocab_size=97, hidden=48, layers=3, heads=6, seq_len=16), 1, 24),
    (LlamaConfig(vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, seq_len=16), 3, 16),
    (LlamaConfig(vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=4, ffn=40, seq_len=16,
                 tie_embeddings=True), 2, 12),
    (LlamaConfig(vocab_size=128, hidden=64, layers=1, heads=8, kv_heads=1, ffn=176, seq_len=16), 1, 32),
]   # in the third, heads / kv_heads = kv_heads, so h / kv_heads is kv_heads · head_dim there too


@exercise("a2.forward_flops", points=1)
def test_forward_flops(forward_flops, quick: bool = True):
    """Predicted FLOPs of model(idx) equal FlopCounterMode's count on the built model, exactly."""
    forward_flops = _guarded(forward_flops)
    cases = FLOP_CASES   # QUICK too: only the last (8 heads, 1 K/V head) tells h / kv_heads from kv_heads·head_dim
    for config, batch, seq in cases:
        expected = measured_forward_flops(config, batch, seq)
        kind = type(config).__name__
        call = f"forward_flops({kind}(hidden={config.hidden}, layers={config.layers}, ...), batch={batch}, seq={seq})"
        got = call_learner(forward_flops, config, batch, seq, call=call, expected=f"{expected:,} FLOPs")
        assert got is not None, f"{call} returned None: return the number of FLOPs"
        assert got == expected, (f"{call} (heads {config.heads}, kv_heads {config.kv_heads}, vocab "
                                 f"{config.vocab_size}{', tied' if getattr(config, 'tie_embeddings', True) else ''}):"
                                 f" FlopCounterMode counts {expected:,} FLOPs, you predicted {got:,}."
                                 f"{_flops_hint(got, config, batch, seq)}")
