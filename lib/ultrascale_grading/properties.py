"""Property-based cases: an exercise's function tried on inputs drawn by hypothesis.

An exercise's test runs fixed cases, chosen to name each classic mistake. A learner's answer can
still pass them and be wrong on an input they never give: another dtype, a 0-d or non-contiguous
tensor, a size the ranks do not divide, values near overflow, a size-1 axis. So after the fixed
cases pass, the exercise's *property* (declared in ``ultrascale_grading.exercise_tests.properties``)
draws inputs over those dimensions with `hypothesis <https://hypothesis.readthedocs.io>`_ and
checks each against the property's judge:

* a property may name cases always tried first (``examples``: edges the draws could miss);
* the draws are **seeded** by the exercise's id (the same inputs on every machine and run: a grade
  must not depend on luck) and few in QUICK (``QUICK_EXAMPLES``, or the property's own ``draws`` where a
  case is a whole training run on ranks), so the grader stays about as fast;
* a failing input is **shrunk** by hypothesis to the smallest one that still fails, and the
  learner sees that input and what was wrong with it;
* an exception the learner's code raises on a drawn input is reported the same way.

A property is a :class:`Property`: a hypothesis strategy of cases, a ``judge(fn, case)`` that
returns what is wrong (or None), and ``describe(case)`` for the message.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

QUICK_EXAMPLES = 25
FULL_EXAMPLES = 150


def strategies():
    """hypothesis's strategies module (imported when a property first draws, not with the grader)."""
    import hypothesis.strategies as st

    return st


def floats():
    """The dtypes a property draws where the technique admits any float: bf16 catches arithmetic
    that assumes float32, float64 a buffer or accumulator made in float32."""
    import torch

    return (torch.float32, torch.float64, torch.bfloat16)


def seeded_values(seed: int, shape, dtype, magnitude: float = 1.0):
    """A drawn case's tensor: normal values from a torch generator seeded by a drawn integer (so
    hypothesis shrinks the seed and the shape, never a float's last bits), made in float64 then cast."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return (magnitude * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)


@dataclasses.dataclass(frozen=True)
class Property:
    strategy: Callable[[], Any]  # () -> a hypothesis SearchStrategy of cases
    judge: Callable[[Callable, Any], str | None]
    describe: Callable[[Any], str]
    argument: int | tuple = 0  # which of check()'s objects is the function tried (a tuple
    # of indices: the judge gets those objects, as a tuple)
    examples: tuple = ()  # cases always tried first (the edges draws may miss)
    draws: tuple = (QUICK_EXAMPLES, FULL_EXAMPLES)  # how many cases drawn (QUICK, full): fewer where each
    # case is a run on ranks of a second or more


def tried(prop: Property, objects: tuple):
    """What the property's judge is given of ``check``'s objects: one, or a tuple of several (an
    exercise of two functions, B and W, is judged on the two together)."""
    if isinstance(prop.argument, int):
        return objects[prop.argument]
    return tuple(objects[i] for i in prop.argument)


def run(exercise_id: str, prop: Property, fn: Callable, quick: bool = True) -> None:
    """Try ``fn`` on the property's drawn cases; raise ``AssertionError`` naming the smallest
    failing case."""
    from hypothesis import HealthCheck, Phase, example, given, seed, settings

    # Seeded by the exercise's id, not derandomized: derandomize seeds from a hash of this function's
    # source, so any edit to these lines would draw other cases for every exercise.
    @seed(zlib.crc32(exercise_id.encode()))
    @settings(
        max_examples=prop.draws[0] if quick else prop.draws[1],
        database=None,
        deadline=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )
    @given(prop.strategy())
    def holds(case):
        try:
            problem = prop.judge(fn, case)
        except NotImplementedError:
            raise
        except AssertionError as err:  # the contract's findings, or a judge's own assertion
            problem = str(err)
        except Exception as err:
            problem = f"your function raised {type(err).__name__}: {err}"
        if problem:
            raise _Failed(problem, case)  # the case travels with its failure: hypothesis may run others after it

    for case in prop.examples:
        holds = example(case)(holds)
    try:
        holds()
    except _Failed as err:
        problem, case = err.args
        how = (
            "one of the edge cases always tried"
            if any(case == edge for edge in prop.examples)
            else "drawn by hypothesis, then shrunk to the smallest that still fails"
        )
        raise AssertionError(
            f"{exercise_id}: the fixed cases pass, but an input they do not cover fails ({how}): "
            f"{prop.describe(case)}. {problem}"
        ) from None


class _Failed(Exception):
    """A case failed (not an AssertionError: hypothesis must not take the judge's for its own)."""
