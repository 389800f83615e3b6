"""Pipeline schedules in pure Python: generate, check and simulate them (NB07).

A schedule is, for every rank, the list of actions it runs in order: F (forward of one
micro-batch through one stage), B (its backward), W (the weight-gradient half of a split
backward), and the send/recv between stages on different ranks. The same lists drive the
simulator here and the real ranks in ``ultrascale.parallel.pipeline_parallel``::

    from ultrascale.schedule import one_f_one_b, simulate
    from ultrascale.viz.schedule import draw
    schedule = one_f_one_b(p=4, m=8)
    print(schedule)                     # the F/B lists, rank by rank
    schedule.actions(1)                 # rank 1's list with its send/recv
    sim = simulate(schedule)            # t_f = 1, t_b = 2 t_f (the book's assumption)
    sim.bubble_fraction                 # (p-1)/m = 0.375
    sim.peak_activations                # [4, 3, 2, 1]: at most p in flight
    draw(sim)                           # the book's picture, micro-batch ids in the boxes

Modules: ``ops`` (Action, the ops, ScheduleError), ``actions`` (Schedule, the placement of
stages on ranks), ``generators`` (naive, AFAB, 1F1B, interleaved, ZB-H1, DualPipeV),
``simulate`` (the discrete-event simulator, the bubble fraction, deadlock detection).
Nothing here imports torch, or draws: the pictures are ``ultrascale.viz.schedule`` (``draw``)
and ``ultrascale.viz.schedule_widget`` (the simulator behind menus and sliders).
"""

from .actions import COMM_OPS, COMPUTE_OPS, Action, Schedule, ScheduleError, parse, rank_of_stage
from .generators import (
    SCHEDULES,
    afab,
    afab_rank,
    dualpipe_v,
    dualpipe_v_rank,
    interleaved_1f1b,
    interleaved_rank,
    make_schedule,
    naive,
    one_f_one_b,
    one_f_one_b_rank,
    one_forward_one_backward,
    zb_h1,
    zb_h1_rank,
)
from .simulate import (
    DeadlockError,
    Simulation,
    Span,
    action_of,
    bubble_fraction,
    duration,
    event_name,
    predicted_bubble_fraction,
    simulate,
)

__all__ = [
    "Action",
    "COMM_OPS",
    "COMPUTE_OPS",
    "DeadlockError",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "Span",
    "action_of",
    "afab",
    "afab_rank",
    "bubble_fraction",
    "dualpipe_v",
    "dualpipe_v_rank",
    "duration",
    "event_name",
    "interleaved_1f1b",
    "interleaved_rank",
    "make_schedule",
    "naive",
    "one_f_one_b",
    "one_f_one_b_rank",
    "one_forward_one_backward",
    "parse",
    "predicted_bubble_fraction",
    "rank_of_stage",
    "simulate",
    "zb_h1",
    "zb_h1_rank",
]
