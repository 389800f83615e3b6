"""Tests of the chapter 0 warm-up exercises (solutions/00_orientation_exercises.ipynb).

* ``00.mean_across_ranks``: average a tensor over all ranks with ``all_reduce``, leaving
  the input tensor unchanged (``all_reduce`` works in place, so on a copy).
* ``00.pipeline_stage_layers``: split L layers over p pipeline stages.
* ``00.memory_per_stage``: the model-state memory each pipeline stage holds, the
  pipeline-parallel input missing from the book's memory widget.
"""

from __future__ import annotations

import math

import torch

from ultrascale_grading import exercise
from ultrascale_grading.guards import call_learner, expect_value_error


# ---- 00.mean_across_ranks ----------------------------------------------------------

SHAPES = [(1,), (7,), (5, 3), (2, 3, 5)]  # odd lengths on purpose: no even split hides a bug


def rank_input(shape, rank: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """The tensor rank ``rank`` averages: different on every rank, reproducible anywhere."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=gen, dtype=dtype)


def _mean_on_rank(ctx, mean_across_ranks, shapes, seed):
    """Runs on every rank: call the learner's function on this rank's inputs."""
    results = []
    for shape in shapes:
        x = rank_input(shape, ctx.rank, seed).to(ctx.device)
        given = x.clone()
        out = mean_across_ranks(ctx, x)
        out = out.detach().cpu() if isinstance(out, torch.Tensor) else out
        results.append((out, torch.equal(x.cpu(), given.cpu())))
    return results


@exercise("00.mean_across_ranks", points=1)
def test_mean_across_ranks(
    mean_across_ranks, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60
):
    """Each rank must return the element-wise mean of every rank's input tensor.

    Runs on several cluster sizes, so that dividing by a fixed number fails.
    """
    from ultrascale.runtime import grading_cluster

    sizes = sorted({2, 3, world_size} if quick else {2, 3, 4, world_size})
    for size in sizes:
        outputs = grading_cluster(size).run(_mean_on_rank, mean_across_ranks, SHAPES, seed, timeout=timeout)
        for i, shape in enumerate(SHAPES):
            inputs = [rank_input(shape, r, seed) for r in range(size)]
            expected = torch.stack(inputs).mean(dim=0)
            for rank in range(size):
                got, input_kept = outputs[rank][i]
                where = f"world_size={size}, shape={shape}, rank {rank}"
                assert isinstance(got, torch.Tensor), f"{where}: expected a tensor back, got {type(got).__name__}"
                assert tuple(got.shape) == shape, f"{where}: expected shape {shape}, got {tuple(got.shape)}"
                if not torch.allclose(got.float(), expected, rtol=1e-5, atol=1e-6):
                    raise AssertionError(
                        f"{where}: wrong values. {_diagnose(got.float(), expected, inputs, rank, size)}"
                    )
                assert input_kept, (
                    f"{where}: the values are right, but your function changed the tensor it was given "
                    "(dist.all_reduce overwrites its argument in place). Leave the caller's tensor alone: "
                    "all-reduce a copy, e.g. total = tensor.clone()"
                )


def _diagnose(got, expected, inputs, rank, size) -> str:
    """Name the usual mistakes, so the message says what to fix."""
    total = torch.stack(inputs).sum(dim=0)
    if torch.allclose(got, total, rtol=1e-5, atol=1e-6):
        return "This is the sum over ranks: divide by the world size."
    if torch.allclose(got, inputs[rank], rtol=1e-5, atol=1e-6):
        return "This is the rank's own input: the values were never combined across ranks."
    for n in range(1, 9):
        if n != size and torch.allclose(got, total / n, rtol=1e-5, atol=1e-6):
            return f"This is the sum divided by {n}, but there are {size} ranks: use ctx.world_size."
    err = (got - expected).abs().max().item()
    return f"Largest difference from the mean of all ranks' inputs: {err:.3g}."


# ---- 00.pipeline_stage_layers ------------------------------------------------------


def reference_stage_layers(num_layers: int, pp_degree: int) -> list:
    """As even as possible; the first ``num_layers % pp_degree`` stages get one extra."""
    if pp_degree < 1 or pp_degree > num_layers:
        raise ValueError(f"pp_degree must be between 1 and num_layers={num_layers}, got {pp_degree}")
    base, extra = divmod(num_layers, pp_degree)
    return [base + 1 if stage < extra else base for stage in range(pp_degree)]


def _cases(quick: bool):
    max_layers = 24 if quick else 96
    for num_layers in range(1, max_layers + 1):
        for pp in range(1, num_layers + 1):
            yield num_layers, pp


@exercise("00.pipeline_stage_layers", points=1)
def test_pipeline_stage_layers(pipeline_stage_layers, quick: bool = True):
    for num_layers, pp in _cases(quick):
        expected = reference_stage_layers(num_layers, pp)
        call = f"pipeline_stage_layers({num_layers}, {pp})"
        got = call_learner(pipeline_stage_layers, num_layers, pp, call=call, expected=str(expected))
        assert got is not None, f"{call} returned None: return the list of layer counts"
        got = list(got)
        assert len(got) == pp, f"{call}: expected one entry per stage ({pp}), got {len(got)}: {got}"
        assert sum(got) == num_layers, f"{call}: the stages hold {sum(got)} layers in total, not {num_layers}: {got}"
        assert got == expected, (
            f"{call}: expected {expected}, got {got} (as even as possible, extra layers on the first stages)"
        )
    for num_layers, pp in [(4, 0), (4, 5), (1, 2)]:
        why = (
            "there must be at least one stage"
            if pp < 1
            else f"{pp} stages cannot each get at least one of {num_layers} layers"
        )
        expect_value_error(pipeline_stage_layers, num_layers, pp, why=why)


# ---- 00.memory_per_stage -----------------------------------------------------------


def layer_params(hidden_size: int) -> int:
    """Parameters of one transformer block in the book's formula: 12h^2 + 13h."""
    return 12 * hidden_size**2 + 13 * hidden_size


def reference_memory_per_stage(num_layers, pp_degree, hidden_size, vocab_size, bytes_per_param=16) -> list:
    """Bytes of weights, gradients and optimizer states on each pipeline stage.

    Stage 0 holds the token embedding (h*v) and the last stage the final LayerNorm
    (2h) and the output projection. The projection shares its weights with the
    embedding, so with one stage they are stored once; with several stages the
    last stage keeps its own copy (h*v), as Megatron-LM and nanotron do.
    """
    h, v = hidden_size, vocab_size
    params = [n * layer_params(h) for n in reference_stage_layers(num_layers, pp_degree)]
    params[0] += h * v
    params[-1] += 2 * h + (h * v if pp_degree > 1 else 0)
    return [p * bytes_per_param for p in params]


@exercise("00.memory_per_stage", points=1)
def test_memory_per_stage(memory_per_stage, quick: bool = True):
    layer_counts = [1, 2, 3, 5, 12, 30] if quick else [1, 2, 3, 5, 7, 12, 30, 32, 80, 126]
    for h in (8, 768, 4096):
        for v in (100, 50257):
            for num_layers in layer_counts:
                for pp in sorted({1, 2, 3, 4, 8, num_layers}):
                    if pp > num_layers:
                        continue
                    _compare(memory_per_stage, (num_layers, pp, h, v), {})
    # The byte count per parameter must be used, not assumed.
    for bpp in (2, 4, 18):
        _compare(memory_per_stage, (10, 4, 64, 1000), {"bytes_per_param": bpp})


def _compare(memory_per_stage, args, kwargs):
    call = f"memory_per_stage({', '.join(map(str, args))}{''.join(f', {k}={v}' for k, v in kwargs.items())})"
    expected = reference_memory_per_stage(*args, **kwargs)
    got = call_learner(memory_per_stage, *args, call=call, expected=f"{expected}", **kwargs)
    assert got is not None, f"{call} returned None: return the list of bytes per stage"
    got = list(got)
    assert len(got) == len(expected), f"{call}: expected {len(expected)} stages, got {len(got)}"
    for stage, (g, e) in enumerate(zip(got, expected)):
        if not math.isclose(g, e, rel_tol=1e-9):
            hint = ""
            if len(expected) == 1:
                hint = " (a single stage holds the whole model: h*v + L*(12h^2 + 13h) + 2h parameters)"
            elif stage == 0:
                hint = " (stage 0 also holds the token embedding, h*v)"
            elif stage == len(expected) - 1:
                hint = " (the last stage also holds the final LayerNorm, 2h, and its own copy of the output projection, h*v)"
            raise AssertionError(f"{call}: stage {stage} should hold {e:,} bytes, got {g:,}{hint}. Expected {expected}")
