"""The chapter 1 exercise tests: the solutions pass, and the usual mistakes fail with a useful hint."""

from pathlib import Path

import nbformat
import pytest
import torch

from ultrascale_grading import FAIL, PASS, check

torch.set_num_threads(1)
SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions" / "01_one_gpu_exercises.ipynb"


@pytest.fixture(scope="module")
def solution():
    """The functions defined in the solution notebook."""
    namespace = {}
    for cell in nbformat.read(SOLUTIONS, as_version=4).cells:
        if cell.cell_type == "code" and cell.source.lstrip().startswith("def "):
            exec(cell.source, namespace)
    return namespace


@pytest.mark.parametrize(
    "exercise_id,name",
    [
        ("01.param_count", "gpt_param_count"),
        ("01.activation_memory", "activation_memory"),
        ("01.grad_accumulation", "accumulate_gradients"),
    ],
)
def test_solutions_pass(solution, exercise_id, name):
    assert check(exercise_id, solution[name], quick=True).status == PASS


def test_param_count_mistakes():
    missing_final_norm = lambda h, v, L, tied=True: h * v + L * (12 * h * h + 13 * h) + (0 if tied else h * v)  # noqa: E731
    result = check("01.param_count", missing_final_norm)
    assert result.status == FAIL and "final LayerNorm" in result.message
    always_tied = lambda h, v, L, tied=True: h * v + L * (12 * h * h + 13 * h) + 2 * h  # noqa: E731
    result = check("01.param_count", always_tied)
    assert result.status == FAIL and "tied=False" in result.message


def test_activation_memory_mistakes():
    def no_scores(layers, hidden, heads, seq, micro_batch, recompute="none"):
        return layers * seq * micro_batch * hidden * (2 if recompute == "full" else 34)

    result = check("01.activation_memory", no_scores)
    assert result.status == FAIL and "5*a*seq/h" in result.message

    def accepts_anything(layers, hidden, heads, seq, micro_batch, recompute="none"):
        lin = layers * seq * micro_batch * hidden
        return {"selective": lin * 34, "full": lin * 2}.get(recompute, lin * (34 + 5 * heads * seq / hidden))

    result = check("01.activation_memory", accepts_anything)
    assert result.status == FAIL and "ValueError" in result.message


def _accumulate(model, inputs, targets, grad_acc, divide=True, clear=True, split=True):
    if clear:
        model.zero_grad(set_to_none=True)
    chunks = zip(inputs.chunk(grad_acc), targets.chunk(grad_acc)) if split else [(inputs, targets)]
    total = 0.0
    for x, y in chunks:
        loss = model.loss(x, y) / (grad_acc if divide and split else 1)
        loss.backward()
        total += loss.item()
    return total if divide else total / grad_acc


@pytest.mark.parametrize(
    "mistake,hint",
    [
        ({"divide": False}, "divide each micro-batch loss by grad_acc"),
        ({"clear": False}, "clear them first"),
        ({"split": False}, "split it into grad_acc micro-batches"),
    ],
)
def test_grad_accumulation_mistakes(mistake, hint):
    def accumulate_gradients(model, inputs, targets, grad_acc):  # named as the exercise's, which the
        return _accumulate(model, inputs, targets, grad_acc, **mistake)  # contract's allowance reads

    result = check("01.grad_accumulation", accumulate_gradients)
    assert result.status == FAIL and hint in result.message, result.message
