"""Tests of the chapter 1 exercises (solutions/01_one_gpu_exercises.ipynb).

* ``01.param_count``: the parameters of the book's GPT, ``h*v + L*(12h^2 + 13h) + 2h``,
  checked against ``count_params`` and against models actually built, tied or not.
* ``01.activation_memory``: activation bytes with no, selective or full recomputation,
  checked against ``ultrascale.memory.activation_bytes``.
* ``01.grad_accumulation``: gradients accumulated over micro-batches must equal the
  gradient of the whole batch, on random models and data.

The first two are the library's own ``count_params`` and ``activation_bytes``; while the
learner's function runs those refuse to be called (``ultrascale_grading.guards``), so
that calling them is not an answer.
"""

from __future__ import annotations

import copy
import math
from numbers import Integral
from types import SimpleNamespace

import torch
import torch.nn as nn

from ultrascale_grading import exercise
from ultrascale_grading.guards import call_learner, expect_value_error, without_library
from ultrascale.memory import activation_bytes
from ultrascale.model import GPT, GPTConfig, LlamaConfig, build_model, count_params


# ---- 01.param_count ------------------------------------------------------------------


def reference_param_count(hidden: int, vocab: int, layers: int, tied: bool = True) -> int:
    h, v, L = hidden, vocab, layers
    return h * v + L * (12 * h * h + 13 * h) + 2 * h + (0 if tied else h * v)


def _built_count(config: GPTConfig, tied: bool) -> int:
    model = GPT(config)
    if not tied:  # give the output layer its own matrix, as an untied model has
        model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    return sum(p.numel() for p in model.parameters())


def _check_count(gpt_param_count, args, tied, expected):
    call = f"gpt_param_count({', '.join(map(str, args))}{'' if tied else ', tied=False'})"
    kwargs = {} if tied else {"tied": False}
    got = call_learner(gpt_param_count, *args, call=call, expected=f"{expected:,}", **kwargs)
    assert got is not None, f"{call} returned None: return the number of parameters"
    if isinstance(got, float) and not isinstance(got, Integral):
        assert got == expected and got.is_integer(), (
            f"{call} returned the float {got!r}, expected {expected:,}: count with integers "
            "(h * h, not math.pow or h ** 2.0) so that large models stay exact"
        )
    if got == expected:
        return
    h, v, L = args
    hint = ""
    if got == expected - 2 * h:
        hint = " (the final LayerNorm, 2h, is missing)"
    elif tied and got == expected + h * v:
        hint = " (the output layer shares the embedding matrix: count h*v once when tied=True)"
    elif not tied and got == expected - h * v:
        hint = " (with tied=False the output layer has its own h*v matrix)"
    elif got == expected - 13 * h * L:
        hint = " (the biases and LayerNorm weights of each block, 13h, are missing)"
    elif got == expected - 4 * h * L:
        hint = " (the two LayerNorms of each block, 2h each, are missing)"
    raise AssertionError(f"{call}: expected {expected:,}, got {got:,}{hint}")


@exercise("01.param_count", points=1)
def test_param_count(gpt_param_count, quick: bool = True):
    """Against the formula for many shapes, count_params for valid configs, and built models."""
    from ultrascale.model import GPT, Block

    # building the model and summing its parameters answers without counting (on the meta device it
    # even costs nothing): refused, as the library's own count is
    gpt_param_count = without_library(
        gpt_param_count,
        [count_params, GPT, Block],
        "01.param_count",
        "add up the blocks, the embedding, the final LayerNorm and maybe the head",
    )
    # realistic shapes first (their messages are the easiest to read), then degenerate ones
    hiddens = (64, 768, 4096, 12288, 1, 2, 7) if quick else (64, 100, 768, 2048, 4096, 12288, 16384, 1, 2, 3, 7, 8)
    for h in hiddens:
        for v in (256, 50257, 1):
            for L in (2, 96, 1):
                for tied in (True, False):
                    _check_count(gpt_param_count, (h, v, L), tied, reference_param_count(h, v, L, tied))
    # the same numbers as the course model's own counter
    for h, v, L in [(64, 256, 2), (768, 50257, 12), (12288, 50257, 96)]:
        assert reference_param_count(h, v, L) == count_params(GPTConfig(vocab_size=v, hidden=h, layers=L, heads=4))
        _check_count(
            gpt_param_count, (h, v, L), True, count_params(GPTConfig(vocab_size=v, hidden=h, layers=L, heads=4))
        )
    # and the parameters PyTorch really allocates
    shapes = (
        [(8, 10, 1, 2), (16, 97, 2, 4), (32, 256, 3, 4)]
        if quick
        else [(8, 10, 1, 2), (16, 97, 2, 4), (32, 256, 3, 4), (48, 50, 5, 6), (64, 256, 2, 4)]
    )
    for h, v, L, heads in shapes:
        config = GPTConfig(vocab_size=v, hidden=h, layers=L, heads=heads)
        for tied in (True, False):
            _check_count(gpt_param_count, (h, v, L), tied, _built_count(config, tied))


# ---- 01.activation_memory ------------------------------------------------------------


def reference_activation_memory(layers, hidden, heads, seq, micro_batch, recompute="none"):
    shape = SimpleNamespace(layers=layers, hidden=hidden, heads=heads)
    return activation_bytes(shape, seq, micro_batch, recompute)


def _activation_hint(got, layers, hidden, heads, seq, bs, mode) -> str:
    lin = layers * seq * bs * hidden
    if mode == "none" and math.isclose(got, lin * 34):
        return " (this is the selective value: keep the attention-score term 5*a*seq/h when nothing is recomputed)"
    if mode == "selective" and math.isclose(got, lin * (34 + 5 * heads * seq / hidden)):
        return " (selective recomputation drops the attention-score term 5*a*seq/h)"
    if mode == "full" and math.isclose(got, lin * 34):
        return " (full recomputation keeps only each layer's 16-bit input: 2 bytes per token and hidden unit)"
    if math.isclose(got, reference_activation_memory(layers, hidden, heads, seq, bs, mode) / bs):
        return " (the micro-batch size is missing: activations grow linearly with it)"
    return ""


@exercise("01.activation_memory", points=1)
def test_activation_memory(activation_memory, quick: bool = True):
    """Every recomputation mode over many shapes, the default mode, and a clear error."""
    activation_memory = without_library(
        activation_memory, [activation_bytes], "01.activation_memory", "write the three formulas of the exercise"
    )
    shapes = [(1, 64, 4), (2, 64, 1), (32, 4096, 32), (80, 8192, 64), (126, 16384, 128), (96, 12288, 96)]
    seqs = (1, 128, 1000, 4096) if quick else (1, 2, 128, 1000, 2048, 4096, 8192, 32768)
    batches = (1, 3) if quick else (1, 2, 3, 8, 32)
    for layers, hidden, heads in shapes:
        for seq in seqs:
            for bs in batches:
                for mode in ("none", "selective", "full"):
                    call = f"activation_memory({layers}, {hidden}, {heads}, seq={seq}, micro_batch={bs}, recompute={mode!r})"
                    expected = reference_activation_memory(layers, hidden, heads, seq, bs, mode)
                    got = call_learner(
                        activation_memory,
                        layers,
                        hidden,
                        heads,
                        seq,
                        bs,
                        mode,
                        call=call,
                        expected=f"{expected:,} bytes",
                    )
                    assert got is not None, f"{call} returned None: return the number of bytes"
                    assert math.isclose(got, expected, rel_tol=1e-9), (
                        f"{call}: expected {expected:,} bytes, got {got:,}"
                        f"{_activation_hint(got, layers, hidden, heads, seq, bs, mode)}"
                    )
    default = call_learner(activation_memory, 32, 4096, 32, 4096, 1)
    assert math.isclose(default, reference_activation_memory(32, 4096, 32, 4096, 1), rel_tol=1e-9), (
        f"activation_memory(32, 4096, 32, 4096, 1) should default to recompute='none' "
        f"({reference_activation_memory(32, 4096, 32, 4096, 1):,} bytes, about 1.04e11), got {default:,}"
    )
    expect_value_error(activation_memory, 2, 64, 4, 128, 1, "partial", why="only 'none', 'selective' and 'full' exist")


# ---- 01.grad_accumulation ------------------------------------------------------------


def _grad_cases(quick: bool):
    configs = [
        GPTConfig(vocab_size=50, hidden=32, layers=2, heads=4),
        LlamaConfig(vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48),
    ]
    if not quick:
        configs.append(GPTConfig(vocab_size=97, hidden=48, layers=3, heads=6))
    plans = (
        [(1, 1, 8), (2, 4, 6), (3, 1, 5), (4, 2, 7)]
        if quick
        else [(1, 1, 8), (1, 5, 4), (2, 4, 6), (3, 1, 5), (3, 2, 9), (4, 2, 7), (8, 1, 4)]
    )
    for i, config in enumerate(configs):
        for j, (grad_acc, mbs, seq) in enumerate(plans):
            yield 100 * i + j, config, grad_acc, mbs, seq


@exercise("01.grad_accumulation", points=1)
def test_grad_accumulation(accumulate_gradients, quick: bool = True, seed: int = 0):
    """On random models and data: the gradients left in .grad, the loss returned, and that the
    work really was split into grad_acc micro-batches of the same size."""
    for case, config, grad_acc, mbs, seq in _grad_cases(quick):
        gen = torch.Generator().manual_seed(1000 * seed + case)
        torch.manual_seed(1000 * seed + case)
        model = build_model(config)
        reference = copy.deepcopy(model)
        batch = mbs * grad_acc
        inputs = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        targets = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        where = f"{type(model).__name__}, batch of {batch} = {mbs} x grad_acc {grad_acc}, seq {seq}"

        loss = reference.loss(inputs, targets)
        loss.backward()
        expected_loss = loss.item()

        stale = {}
        for name, p in model.named_parameters():  # gradients left over from an earlier step
            p.grad = torch.randn(p.shape, generator=gen)
            stale[name] = p.grad.clone()
        sizes = []
        hook = model.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
        try:
            got_loss = accumulate_gradients(model, inputs, targets, grad_acc)
        finally:
            hook.remove()

        assert sizes, f"{where}: the model was never called"
        assert sizes == [mbs] * grad_acc, (
            f"{where}: expected {grad_acc} forward passes of {mbs} sequences each, got batch sizes {sizes}"
            + (
                " (the whole batch went through at once: split it into grad_acc micro-batches)"
                if sizes == [batch] and grad_acc > 1
                else ""
            )
        )
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), f"{where}: parameter {name} changed: accumulate gradients, do not step"
            assert p.grad is not None, f"{where}: parameter {name} has no gradient"
            if torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6):
                continue
            hint = ""
            if torch.allclose(p.grad, grad_acc * q.grad, rtol=1e-5, atol=1e-6):
                hint = " It is grad_acc times too large: divide each micro-batch loss by grad_acc."
            elif torch.allclose(p.grad - stale[name], q.grad, rtol=1e-5, atol=1e-5):
                hint = " The gradients of an earlier step were still in .grad: clear them first."
            elif torch.allclose(p.grad - stale[name], grad_acc * q.grad, rtol=1e-5, atol=1e-5):
                hint = " Clear the old gradients first, and divide each micro-batch loss by grad_acc."
            err = (p.grad - q.grad).abs().max().item()
            raise AssertionError(
                f"{where}: the gradient of {name} differs from the whole-batch gradient "
                f"(largest difference {err:.3g}).{hint}"
            )
        assert got_loss is not None, f"{where}: return the mean loss over the whole batch"
        got_loss = float(got_loss)
        assert math.isclose(got_loss, expected_loss, rel_tol=1e-5), (
            f"{where}: returned loss {got_loss:.6f}, the whole batch's mean loss is {expected_loss:.6f}"
            + (
                " (that is the sum of the micro-batch means: return their mean)"
                if math.isclose(got_loss, grad_acc * expected_loss, rel_tol=1e-5) and grad_acc > 1
                else ""
            )
        )
