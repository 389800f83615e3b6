"""Pipeline schedules (ultrascale.schedule, NB07): the generators' action lists, the book's
formulas asserted on the simulator, the memory the schedules hold, validity and deadlocks;
their drawing and interactive view (ultrascale.viz.schedule, ultrascale.viz.schedule_widget).

Pure Python and fast. Conventions (see ultrascale/schedule/simulate.py): t_f and t_b are one
micro-batch's forward and whole backward through one rank's layers, t_b = 2 t_f unless said;
a split backward runs B for t_b - t_w and W for t_w. The bubble fraction is the book's
r_bubble = idle time / compute time, m (t_f + t_b) per rank. The simulator adds exactly,
so the formulas are asserted to 1e-12.
"""

import subprocess
import sys

import matplotlib
import pytest

from ultrascale.schedule import (
    Action,
    DeadlockError,
    Schedule,
    afab,
    bubble_fraction,
    dualpipe_v,
    interleaved_1f1b,
    make_schedule,
    naive,
    one_f_one_b,
    one_f_one_b_rank,
    one_forward_one_backward,
    parse,
    predicted_bubble_fraction,
    simulate,
    zb_h1,
)
from ultrascale.viz.schedule import draw

matplotlib.use("Agg")
EXACT = 1e-12


# --------------------------------------------------------------------------- action lists
def test_1f1b_lists_are_the_books():
    """p-1-rank forwards to fill the pipe, then one forward and one backward, then the drain."""
    s = one_f_one_b(p=4, m=8)
    assert s.compute[0] == tuple(parse("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"))
    assert s.compute[3] == tuple(parse("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7", stage=3))
    assert one_f_one_b_rank(4, 8, 2) == list(s.compute[2])
    assert afab(4, 8).compute[1] == tuple(parse("F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7", stage=1))


def test_send_and_receive_come_from_the_placement():
    """A receive right before the action that needs the data, a send right after the producer."""
    s = one_f_one_b(p=2, m=3)
    assert s.actions(0) == parse("F0 send_F0 F1 send_F1 recv_B0 B0 F2 send_F2 recv_B1 B1 recv_B2 B2")
    assert s.actions(1) == parse("recv_F0 F0 B0 send_B0 recv_F1 F1 B1 send_B1 recv_F2 F2 B2 send_B2", stage=1)
    # Interleaved: rank 1's chunks are stages 1 and 3; V placement: rank 1 holds stages 1 and 2.
    assert interleaved_1f1b(p=2, m=4, v=2).stages_of(1) == [1, 3]
    v = dualpipe_v(p=2, m=4)
    assert v.stages_of(0) == [0, 3] and v.stages_of(1) == [1, 2] and v.chunk_of(2) == 1
    # Stages 1 -> 2 live on one rank: no message between them.
    local = {Action("send_F", mb, 1) for mb in range(4)} | {Action("recv_F", mb, 2) for mb in range(4)}
    local |= {Action("send_B", mb, 2) for mb in range(4)} | {Action("recv_B", mb, 1) for mb in range(4)}
    assert not local & set(v.actions(1))
    assert Action("recv_F", 0, 1) in v.actions(1) and Action("send_F", 0, 2) in v.actions(1)


def test_make_schedule_by_name():
    assert make_schedule("1f1b", 4, 8).compute == one_f_one_b(4, 8).compute
    assert make_schedule("interleaved", 4, 8).chunks == 2
    assert make_schedule("interleaved-bf", 4, 8, v=3).name == "interleaved 1F1B (breadth-first)"
    assert make_schedule("naive", 3, 1).microbatches == 1


# --------------------------------------------------------------------------- the book's formulas
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_naive_bubble_is_p_minus_1(p):
    """One batch: t_pb = (p-1)(t_f + t_b) against t_id = t_f + t_b."""
    assert simulate(naive(p)).bubble_fraction == pytest.approx(p - 1, abs=EXACT)
    assert predicted_bubble_fraction(p, 1) == p - 1


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (3, 5), (4, 5), (8, 32)])
@pytest.mark.parametrize("build", [afab, one_f_one_b], ids=["AFAB", "1F1B"])
def test_afab_and_1f1b_bubble_is_p_minus_1_over_m(build, p, m):
    sim = simulate(build(p, m))
    assert sim.bubble_fraction == pytest.approx((p - 1) / m, abs=EXACT)
    assert sim.makespan == pytest.approx((m + p - 1) * (sim.t_f + sim.t_b), abs=EXACT)
    # The formula does not depend on t_b = 2 t_f: t_f + t_b cancels.
    assert simulate(build(p, m), t_b=3.0).bubble_fraction == pytest.approx((p - 1) / m, abs=EXACT)


def test_the_books_numbers():
    """p=4, m=8: 0.375; interleaved p=8, m=32, v=2: 7/64."""
    assert simulate(one_f_one_b(4, 8)).bubble_fraction == pytest.approx(0.375, abs=EXACT)
    assert simulate(interleaved_1f1b(8, 32, v=2)).bubble_fraction == pytest.approx(7 / 64, abs=EXACT)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (2, 5, 2), (3, 5, 2), (4, 5, 2), (4, 6, 3), (4, 4, 4), (5, 12, 2)])
@pytest.mark.parametrize("order", ["depth-first", "breadth-first"])
def test_interleaved_bubble_is_p_minus_1_over_vm(p, m, v, order):
    """Any m >= p: m that p does not divide is spread over rounds of at least p micro-batches."""
    sim = simulate(interleaved_1f1b(p, m, v, order))
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m), abs=EXACT)
    assert sim.bubble_fraction == pytest.approx(predicted_bubble_fraction(p, m, v), abs=EXACT)


def test_interleaving_communicates_v_times_more():
    """Each chunk boundary between ranks is a message: (p v - 1) activations per micro-batch."""

    def messages(s):
        return sum(a.op == "send_F" for r in range(s.ranks) for a in s.actions(r))

    assert messages(one_f_one_b(4, 8)) == 8 * 3
    assert messages(interleaved_1f1b(4, 8, v=2)) == 8 * 7
    assert messages(interleaved_1f1b(4, 8, v=4)) == 8 * 15


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 5), (8, 32)])
@pytest.mark.parametrize("t_w", [0.5, 1.0])
def test_zb_h1_bubble(p, m, t_w):
    """ZB-H1 takes t_w out of the critical path twice per stage (B travels without W, and W fills
    the drain): idle (p-1)(t_f + t_b - 2 t_w) instead of 1F1B's (p-1)(t_f + t_b). With
    t_f = B = W (t_b = 2, t_w = 1) that is a third of 1F1B's bubble. Holds for m >= p, t_w <= t_f."""
    t_f, t_b = 1.0, 2.0
    sim = simulate(zb_h1(p, m), t_f, t_b, t_w)
    assert sim.bubble_fraction == pytest.approx((p - 1) * (t_f + t_b - 2 * t_w) / (m * (t_f + t_b)), abs=EXACT)
    assert sim.bubble_fraction < simulate(one_f_one_b(p, m), t_f, t_b).bubble_fraction


def test_p2p_cost_adds_two_trips_per_stage_to_afab():
    """AFAB: the first forward crosses p-1 links, the last backward p-1 links back."""
    for p, m in [(2, 4), (4, 8), (3, 5)]:
        sim = simulate(afab(p, m), t_comm=0.1)
        assert sim.makespan == pytest.approx((m + p - 1) * 3 + 2 * (p - 1) * 0.1, abs=1e-9)
        assert simulate(one_f_one_b(p, m), t_comm=0.1).makespan >= sim.makespan - 1e-9


# --------------------------------------------------------------------------- memory
@pytest.mark.parametrize("p,m", [(4, 8), (4, 3), (3, 5), (8, 32)])
def test_peak_activations_m_for_afab_at_most_p_for_1f1b(p, m):
    assert simulate(afab(p, m)).peak_activations == [m] * p
    one = simulate(one_f_one_b(p, m)).peak_activations
    assert one == [min(p - r, m) for r in range(p)]  # rank 0 holds p: the first stage needs most
    assert max(one) <= p
    # ZB-H1 keeps 1F1B's peak (the deferred W's hold activations a little longer on later ranks).
    assert max(simulate(zb_h1(p, m)).peak_activations) == max(one)


def test_breadth_first_holds_more_than_depth_first():
    """Same bubble, but breadth-first pushes all m micro-batches through a chunk first."""
    depth, breadth = (simulate(interleaved_1f1b(8, 32, 2, order)) for order in ("depth-first", "breadth-first"))
    assert depth.bubble_fraction == pytest.approx(breadth.bubble_fraction, abs=EXACT)
    assert max(depth.peak_activations) < max(breadth.peak_activations)


# --------------------------------------------------------------------------- DualPipeV
@pytest.mark.parametrize("p,m", [(2, 4), (2, 5), (3, 6), (4, 8), (4, 16)])
def test_dualpipe_v_is_valid_and_beats_1f1b(p, m):
    s = dualpipe_v(p, m)
    assert s.placement == "v" and s.chunks == 2
    assert all(s.stages_of(r) == sorted([r, 2 * p - 1 - r]) for r in range(p))
    sim = simulate(s)
    assert sim.bubble_fraction < simulate(one_f_one_b(p, m)).bubble_fraction
    assert sim.bubble_fraction < predicted_bubble_fraction(p, m, v=2)
    fig = draw(sim)
    assert {t.get_text() for t in fig.axes[0].texts} >= {str(mb) for mb in range(m)}


# --------------------------------------------------------------------------- validity and errors
def test_every_generated_schedule_is_valid():
    """Building a Schedule runs the simulator; none of these may raise."""
    for p in range(1, 6):
        for m in range(1, 10):
            for build in (afab, one_f_one_b, zb_h1):
                build(p, m)
            for v in (2, 3):
                interleaved_1f1b(p, m, v, "depth-first")
                interleaved_1f1b(p, m, v, "breadth-first")
            if m >= 2 * p:
                dualpipe_v(p, m)


def test_a_deadlock_names_the_blocked_actions():
    """Rank 0 does 1F1B without warm-up, so it waits for B0's gradient before sending F1, while
    rank 1 waits for F1 before it runs B0."""
    with pytest.raises(DeadlockError) as info:
        Schedule("no warm-up", [parse("F0 B0 F1 B1"), parse("F0 F1 B0 B1", stage=1)], 2)
    text = str(info.value)
    assert "rank 0 waits at action 2 (recv_B0s0) for B0s1 from rank 1" in text
    assert "rank 1 waits at action 2 (recv_F1s1) for F1s0 from rank 0" in text


def test_interleaving_with_rounds_smaller_than_p_deadlocks():
    """Megatron's warm-up assumes rounds of p micro-batches; the simulator finds what happens
    with a partial round (p=4, m=5, v=3 in rounds of 4 and 1)."""
    with pytest.raises(DeadlockError, match="deadlocks"):
        Schedule("partial round", [_rounds_of_4_then_1(r) for r in range(4)], 5, chunks=3)


def _rounds_of_4_then_1(rank):
    """Rank lists built as interleaved_rank builds them, but with rounds of 4 and 1."""
    stages = [c * 4 + rank for c in range(3)]
    groups = [range(0, 4), range(4, 5)]
    forwards = [Action("F", mb, s) for g in groups for s in stages for mb in g]
    backwards = [Action("B", mb, s) for g in groups for s in reversed(stages) for mb in g]
    return one_forward_one_backward(forwards, backwards, min(2 * 4 + 2 * (3 - rank), 15))


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: one_f_one_b(4, 0), "m=0"),
        (lambda: afab(0, 4), "p=0"),
        (lambda: interleaved_1f1b(4, 8, v=0), "v=0"),
        (lambda: dualpipe_v(4, 5), "needs m >= 8"),
        (lambda: interleaved_1f1b(4, 8, rounds=3), r"choose 1 \.\. 2 rounds"),
        (lambda: make_schedule("gpipe", 4, 8), "unknown schedule 'gpipe'"),
        (lambda: make_schedule("1f1b", 4, 8, v=2), "use 'interleaved'"),
        (lambda: make_schedule("naive", 4, 8), "runs the batch whole"),
        (lambda: Schedule("x", [parse("B0 F0")], 1), "rank 0 runs B0s0 before F0s0.*move B0s0 after it"),
        (lambda: Schedule("x", [parse("F0s1 F0 B0 B0s1")], 1, chunks=2), "F0s1 before F0s0 \\(the input of stage 1\\)"),
        (lambda: Schedule("x", [parse("F0 B0"), parse("F0", stage=1)], 1), "missing: B0s1"),
        (lambda: Schedule("x", [parse("F0 B0 F0"), parse("F0 B0", stage=1)], 1), "runs F0s0 twice"),
        (lambda: Schedule("x", [parse("F0 B0 F0s1"), parse("B0", stage=1)], 1), "stage 1 lives on rank 1"),
        (lambda: Schedule("x", [parse("F0 B0 F1 B1")], 1), r"outside micro-batches 0\.\.0"),
        (lambda: parse("X0"), "cannot read 'X0'"),
    ],
)
def test_bad_input_is_refused_with_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# --------------------------------------------------------------------------- timelines
def test_bubble_fraction_reads_timeline_rows():
    """The same function measures real ranks: their Timeline rows use the simulator's names."""
    sim = simulate(one_f_one_b(4, 8))
    rows = sim.rows()
    assert rows[0]["name"] == "forward 0 stage 0"
    per_rank = [
        [e for e in rows if e["rank"] == r] + [dict(rank=r, lane="communication", name="recv", start=0, end=99)]
        for r in range(4)
    ]
    assert bubble_fraction(per_rank) == pytest.approx(0.375, abs=EXACT)
    with pytest.raises(ValueError, match="no pipeline compute events"):
        bubble_fraction([dict(rank=0, lane="compute", name="optimizer", start=0, end=1)])


def test_draw_puts_micro_batch_ids_in_the_boxes():
    sim = simulate(interleaved_1f1b(4, 8, 2))
    fig = draw(sim)
    ax = fig.axes[0]
    assert "bubble fraction 0.188" in ax.get_title()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert sorted({t.get_text() for t in ax.texts}, key=int) == [str(i) for i in range(8)]
    assert {t.get_text() for t in draw(sim, number_from=1).axes[0].texts} == {str(i) for i in range(1, 9)}
    # Measured rows (ms since the first event) draw the same way.
    rows = [dict(e, start=e["start"] / 1e3, end=e["end"] / 1e3) for e in sim.rows()]
    assert draw(rows).axes[0].get_xlabel() == "time (ms)"


def test_schedule_needs_no_torch():
    code = (
        "import sys, ultrascale.schedule as s; s.simulate(s.one_f_one_b(4, 8)); "
        "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- the interactive view
def test_schedule_figure_and_widget():
    """The static figure with its summary; the widget redraws, shows the generators' refusals as
    text, and saves as one readable line."""
    from ultrascale.viz.schedule_widget import schedule_figure, schedule_widget

    fig, text = schedule_figure("interleaved", p=4, m=8, v=2)
    assert "bubble 0.188 (formula (p-1)/(v m) = 0.188)" in text and "[11, 9, 7, 5]" in text
    assert "bubble fraction 0.188" in fig.axes[0].get_title()
    assert "1F1B: bubble 0.375" in schedule_figure("1f1b", p=4, m=8, v=3)[1]  # v ignored for one-stage schedules
    widget = schedule_widget()
    assert repr(widget) == "[pipeline simulator: run this cell in JupyterLab for its menus and sliders]"
    controls, message, image = widget.children
    name, p, m, v = controls.children
    assert image.value and "1F1B: bubble 0.375" in message.value
    name.value = "dualpipe-v"
    m.value = 5  # DualPipeV needs m >= 2p = 8
    assert "Cannot build" in message.value and "needs m >= 8" in message.value
    m.value = 8
    assert "DualPipeV: bubble 0.062" in message.value
