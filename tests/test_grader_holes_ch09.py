"""The chapter 9 exercises cannot be fooled: plausible wrong answers fail with a message that
says what to fix, and the solution notebook's own answers pass."""

from __future__ import annotations

import math

from test_grader_holes import _fails

from ultrascale_grading import PASS, check


def test_the_solutions_pass(ch09):
    for exercise, answer in (
        ("09.group_ranks", ch09["group_ranks"]),
        ("09.pp_activations", ch09["pp_activations"]),
        ("09.rank_parameters", ch09["rank_parameters"]),
        ("09.quiz", ch09["quiz_answers"]),
    ):
        assert check(exercise, answer).status == PASS, exercise


def test_group_ranks_refuses_tp_outermost_and_the_library(ch09):
    def tp_outermost(sizes, axis):
        import torch

        order = [a for a in ("tp", "cp", "ep", "pp", "dp") if a in sizes]
        grid = torch.arange(math.prod(sizes.values())).view([sizes[a] for a in order])
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        dims = [order.index(a) for a in order if a in axes]
        others = [d for d in range(len(order)) if d not in dims]
        return sorted(grid.permute(others + dims).reshape(-1, math.prod(sizes[a] for a in axes)).tolist())

    def unsorted(sizes, axis):
        return [list(reversed(g)) for g in ch09["group_ranks"](sizes, axis)]

    def library(sizes, axis):
        from ultrascale.parallel.mesh import Mesh

        return Mesh(**sizes).group_ranks(axis)

    _fails(check("09.group_ranks", tp_outermost), "tp *outermost*", "tp innermost")
    _fails(check("09.group_ranks", unsorted), "the right groups, but listed as")
    _fails(check("09.group_ranks", library), "your code called the course library")


def test_pp_activations_refuses_a_missing_in_flight_term(ch09):
    def one_micro_batch(per_layer, layers, pp, micro_batches, schedule):
        return per_layer * math.ceil(layers / pp)

    def all_in_flight(per_layer, layers, pp, micro_batches, schedule):
        return per_layer * math.ceil(layers / pp) * micro_batches

    def pp_always(per_layer, layers, pp, micro_batches, schedule):
        return per_layer * math.ceil(layers / pp) * (micro_batches if schedule == "afab" else pp)

    def library(per_layer, layers, pp, micro_batches, schedule):
        from ultrascale.memory import pp_in_flight

        return per_layer * math.ceil(layers / pp) * max(pp_in_flight(schedule, pp, micro_batches))

    _fails(check("09.pp_activations", one_micro_batch), "several in flight")
    _fails(check("09.pp_activations", all_in_flight), "min(pp, m), not m")
    _fails(check("09.pp_activations", pp_always), "only m can be in flight")
    _fails(check("09.pp_activations", library), "your code called the course library")


def test_rank_parameters_refuses_the_even_split_and_a_missing_embedding(ch09):
    from ultrascale.model import count_params

    def even(config, tp=1, pp=1, stage=0):
        return count_params(config) / (tp * pp)

    def embedding_on_first_only(config, tp=1, pp=1, stage=0):
        tied = config.vocab_size * config.hidden // tp
        return ch09["rank_parameters"](config, tp, pp, stage) - (tied if stage == pp - 1 and pp > 1 else 0)

    def norms_split_too(config, tp=1, pp=1, stage=0):
        h, L = config.hidden, config.layers
        blocks = L // pp + (stage < L % pp)
        return ch09["rank_parameters"](config, tp, pp, stage) - blocks * (6 * h - 6 * h // tp)

    _fails(check("09.rank_parameters", even), "calculator's even split")
    _fails(check("09.rank_parameters", embedding_on_first_only), "expected")
    _fails(check("09.rank_parameters", norms_split_too), "expected")


def test_quiz_refuses_wrong_answers(ch09):
    def changed(question, answer):
        return lambda: {**ch09["quiz_answers"](), question: answer}

    # forgot DP's smaller local batch
    _fails(
        check("09.quiz", changed("Which methods save activation memory?", {"TP/SP", "CP"})),
        "1 of 6 answers are wrong",
        "activation memory",
    )
    _fails(
        check("09.quiz", changed("Which method moves activations between ranks, ZeRO-3 or PP?", "ZeRO-3")),
        "ZeRO-3 or PP",
    )
    _fails(
        check("09.quiz", lambda: {k: v for k, v in ch09["quiz_answers"]().items() if "model-specific" not in k}),
        "no answer to",
    )

    def library():
        from ultrascale.methods import quiz

        return quiz()

    _fails(check("09.quiz", library), "your code called the course library")
