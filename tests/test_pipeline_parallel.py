"""Pipeline parallelism (parallel.pipeline_parallel, NB07) on real ranks: the schedules'
action lists executed with send/recv, against single-process gradient accumulation and
against torch.distributed.pipelining on the same stages and micro-batches.

Every run starts from the same weights and trains on the same seeded micro-batches: step t's
batch has M rows and micro-batch i is row i (``data.micro_batches``). The reference is one
process running ``train.run_steps(..., grad_acc=M)``: each micro-batch's loss divided by M,
gradients summed over the micro-batches, then the SGD step. We compare the loss, every
gradient of the first step (gathered by name from the stages' ranks) and the weights after
STEPS steps, with M = 5, which no p here divides.

Why float64 and ``parity.TOLERANCES``: a pipeline computes the same operations on the same
rows as one process. Only GPT's tied embedding/head weight gets its two gradient parts
summed in another order (across the first and last stage's ranks, Megatron-LM's embedding
all-reduce), and PyTorch's schedules add the micro-batches' gradients in their own order:
rounding of ~1e-16 relative, which the float64 tolerances (1e-10 for one backward and for
SGD) allow and a wrong scale, a lost micro-batch or a missing tied part cannot meet.
"""

import contextlib

import matplotlib
import pytest
import torch

from ultrascale.comm import CommLogger
from ultrascale.data import Batches, micro_batches
from ultrascale.model import GPT, GPTConfig
from ultrascale.parallel.mesh import init_mesh
from ultrascale.parallel.pipeline_parallel import apply_pp, backward_input, backward_weight, build_stage, split_layers
from ultrascale.parallel.timeline import Timeline
from ultrascale.parity import assert_same
from ultrascale.parity.pipeline_runs import (
    assert_same_as_one_process,
    calibrate_compute,
    first_step_and_train,
    one_process,
    pytorch_pipeline,
)
from ultrascale.runtime import shared_cluster

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]
from ultrascale.schedule import Schedule, ScheduleError, bubble_fraction, make_schedule, one_f_one_b_rank, simulate
from ultrascale.train import gradients
from ultrascale.viz.schedule import draw

matplotlib.use("Agg")

CFG = GPTConfig(vocab_size=64, hidden=32, layers=8, heads=2, seq_len=8)  # 8 layers: p=4 with v=2
DT = torch.float64
M = 5  # micro-batches per step: not a multiple of p = 2, 3 or 4
STEPS = 3


def fresh_model():
    torch.manual_seed(0)
    model = GPT(CFG).to(DT)
    with torch.no_grad():  # biases away from 0, norm weights away from 1: every gradient path shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def stream(m):
    """(step, micro) -> micro-batch: the rows of step's seeded batch, one per micro-batch."""
    data = Batches(CFG, mbs=m, seed=0)
    return lambda step, micro: micro_batches(data.global_batch(step), m)[micro]


def run_on(p, fn, *args, **kwargs):
    """fn on p ranks; a hang (a schedule waiting for a message) fails in a minute, with stacks."""
    return shared_cluster(p).run(fn, *args, timeout=60, **kwargs)


@contextlib.contextmanager
def one_thread():
    """The model is tiny: a second intra-op thread only spins against the ranks for the cores
    (measured on 2 busy cores: one forward and backward 17 ms with one thread, 340 ms with two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_REFERENCES = {}


def reference(m):
    """One process, gradient accumulation over m micro-batches: the loss, the first step's
    gradients and the weights after STEPS steps."""
    if m not in _REFERENCES:
        with one_thread():
            _REFERENCES[m] = one_process(fresh_model(), stream(m), m, STEPS, fresh=fresh_model)
    return _REFERENCES[m]


# --------------------------------------------------------------------------- on the ranks
def train(ctx, pipe, m):
    """The first step's loss and gradients, then STEPS steps of SGD; this rank's share."""
    return first_step_and_train(pipe, stream(m), STEPS, device=ctx.device)


def ours(ctx, schedule, v, m=M):
    mesh = init_mesh(ctx, pp=ctx.world_size)
    return train(ctx, apply_pp(fresh_model().to(ctx.device), mesh, schedule=schedule, microbatches=m, chunks=v), m)


def pytorchs(ctx, schedule, v, m):
    pipe = pytorch_pipeline(fresh_model().to(ctx.device), schedule=schedule, microbatches=m, chunks=v)
    return {**train(ctx, pipe, m), "order": pipe.pipeline_order()}


def assert_matches_reference(results, m, what):
    # merge_ranks inside also checks that the tied weight is equal on its two ranks; every name, none extra
    assert_same_as_one_process(results, reference(m), what)


# --------------------------------------------------------------------------- parity
# DualPipeV needs m >= 2p: m = 7 on 3 ranks. Interleaved on 2 ranks and DualPipeV on 3 also
# receive some messages before they are needed (not in the order a rank needs them).
CASES = [
    (p, name, v, M) for p in (2, 3, 4) for name, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
] + [(2, "dualpipe-v", 2, M), (3, "dualpipe-v", 2, 7)]


@pytest.mark.parametrize("p,schedule,v,m", CASES, ids=[f"p{p}-{s}-m{m}" for p, s, _, m in CASES])
def test_same_as_gradient_accumulation_in_one_process(p, schedule, v, m):
    results = run_on(p, ours, schedule, v, m)
    assert_matches_reference(results, m, f"{schedule} p={p}")
    # The activations each rank really held at once are the simulator's count.
    assert [r["peak"] for r in results] == simulate(make_schedule(schedule, p, m, v)).peak_activations


# --------------------------------------------------------------------------- PyTorch
TORCH_CASES = [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("dualpipe-v", 2)]


@pytest.mark.parametrize("schedule,v", TORCH_CASES, ids=[s for s, _ in TORCH_CASES])
def test_same_as_torch_distributed_pipelining(schedule, v):
    """PyTorch's schedule on our stages: the same numbers as one process and as ours, and the
    same per-rank action lists as our generator. m = 4: ScheduleInterleaved1F1B wants m to be a
    multiple of its rounds (m // p), ScheduleDualPipeV m >= 2p."""
    m = 4
    theirs = run_on(2, pytorchs, schedule, v, m)
    assert_matches_reference(theirs, m, f"torch.distributed.pipelining {schedule}")
    mine = run_on(2, ours, schedule, v, m)
    for a, b in zip(mine, theirs):
        assert_same(a["grads"], b["grads"], f"ours against PyTorch's {schedule}", optimizer=None)
    assert_same_lists(theirs[0]["order"], make_schedule(schedule, 2, m, v), schedule)


def _warmup_peers(ctx, p):
    """Whom each of this rank's DualPipeV stages would send or receive its warm-up tensor from."""
    pipe = pytorch_pipeline(fresh_model().to(ctx.device), schedule="dualpipe-v", microbatches=2 * p, chunks=2)
    for stage in pipe.torch_schedule._stages:  # the schedule sets this map before its first step
        stage.stage_index_to_group_rank = {s: min(s, 2 * p - 1 - s) for s in range(2 * p)}
    return {
        stage.stage_index: sorted(op.group_peer for op in stage._get_init_p2p_neighbors_ops())
        for stage in pipe.torch_schedule._stages
    }


def test_dualpipe_v_warm_up_sends_nothing_to_its_own_rank():
    """Torch 2.11's schedules open each pair of neighbour stages with a message, also at the
    turn of the V where both stages are on the last rank: gloo has no pair from a rank to itself
    ("Pair is not connected"), so PyTorch's DualPipeV failed there (chapter 07 on 2.11).
    ``pytorch_pipeline``'s stages leave those messages out; the other neighbours keep theirs."""
    peers = run_on(2, _warmup_peers, 2)
    # rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (adjacent: the turn of the V)
    assert peers[0] == {0: [1, 1], 3: [1, 1]}
    assert peers[1] == {1: [0, 0], 2: [0, 0]}


def assert_same_lists(torch_lists, schedule, name):
    """PyTorch's per-rank compute lists equal our generator's. One known difference:
    Schedule1F1B's ``pipeline_order`` (a description; ``step`` runs its own loop) numbers the
    last rank's forwards from 1 (F1 .. Fm, no F0), a list our simulator would reject."""
    ours = [list(acts) for acts in schedule.compute]
    if name == "1f1b":
        ours[-1] = [a._replace(microbatch=a.microbatch + 1) if a.op == "F" else a for a in ours[-1]]
        with pytest.raises(ScheduleError, match="outside micro-batches"):
            Schedule("PyTorch's 1F1B pipeline_order", torch_lists, schedule.microbatches)
    assert torch_lists == ours, name


def _torch_orders(ctx, m):
    return {
        name: pytorch_pipeline(fresh_model().to(ctx.device), schedule=name, microbatches=m, chunks=v).pipeline_order()
        for name, v in TORCH_CASES
    }


def test_action_lists_same_as_pytorchs_on_4_ranks():
    """PyTorch's per-rank lists for p=4, m=8 (built, not run) against our generators'."""
    orders = run_on(4, _torch_orders, 8)[0]
    for name, v in TORCH_CASES:
        assert_same_lists(orders[name], make_schedule(name, 4, 8, v), name)


def test_split_backward_is_the_whole_backward():
    """B (input gradient, graph kept) then W (weight gradients, accumulated) give what one
    backward() gives, on a stage that takes hidden states, over two micro-batches."""

    def stage():
        model = fresh_model()
        return build_stage(model, range(2, 5), first=False, last=False)

    xs = [
        torch.randn(1, CFG.seq_len, CFG.hidden, dtype=DT, generator=torch.Generator().manual_seed(i)) for i in range(2)
    ]
    dys = [torch.randn_like(x) for x in xs]
    whole, split = stage(), stage()
    want = []
    for x, dy in zip(xs, dys):
        x = x.clone().requires_grad_()
        whole(x).backward(dy)
        want.append(x.grad)
    params = list(split.parameters())
    for x, dy, dx in zip(xs, dys, want):
        x = x.clone().requires_grad_()
        y = split(x)
        before = gradients(split)
        assert_same(backward_input(y, x, dy), dx, "B's input gradient", optimizer=None)
        assert_same(gradients(split), before, "B leaves the weights' gradients alone", tol=dict(rtol=0, atol=0))
        backward_weight(y, params, dy)
    assert_same(gradients(split), gradients(whole), "W's weight gradients", optimizer=None)


# --------------------------------------------------------------------------- learners' schedules
def custom(ctx, lists):
    schedule = Schedule("mine", lists, M)
    return train(ctx, apply_pp(fresh_model().to(ctx.device), schedule=schedule), M)


def test_a_hand_written_schedule_runs():
    """What an exercise builds: per-rank lists, checked by the simulator, run as they are."""
    lists = [one_f_one_b_rank(3, M, r) for r in range(3)]
    assert_matches_reference(run_on(3, custom, lists), M, "hand-written 1F1B")


# --------------------------------------------------------------------------- timelines and bytes
def logged(ctx, schedule, delay):
    tl = Timeline(ctx.rank, device=ctx.device)
    pipe = apply_pp(fresh_model().to(ctx.device), schedule=schedule, microbatches=4, timeline=tl)
    if delay:
        calibrate_compute(pipe, t_f=delay)
    with CommLogger() as log:
        pipe.step([stream(4)(0, i).to(ctx.device) for i in range(4)])
    return {"rows": tl.rows(), "p2p": {op: t["bytes_sent"] + t["bytes_received"] for op, t in log.totals().items()}}


def test_timeline_and_communication_are_logged():
    results = run_on(2, logged, "1f1b", 0.0)
    rows = [r["rows"] for r in results]
    names = {e["name"] for e in rows[1]}
    assert {"forward 0 stage 1", "backward 3 stage 1", "recv activation 2 for stage 1"} <= names
    assert 0 < bubble_fraction(rows) < 10
    assert draw(rows).axes[0].get_xlabel() == "time (ms)"
    # Each micro-batch crosses the one link twice: its activation forward, its gradient back;
    # then the first and last stage swap their parts of the tied embedding's gradient, the send
    # and the receive posted as one batch (both go to one peer: NCCL's rule, comm.ring.exchange).
    activation = 1 * CFG.seq_len * CFG.hidden * 8  # a row of hidden states in float64
    embedding = CFG.vocab_size * CFG.hidden * 8
    assert results[0]["p2p"] == {"isend": 4 * activation, "irecv": 4 * activation, "batch_isend_irecv": 2 * embedding}


def test_calibrated_compute_sleeps_the_stated_times():
    """The forward bars last at least t_f (the sleep fills what the compute left), the backward
    ones at least t_b = 2 t_f: the premise of measuring the bubble against (p-1)/m."""
    rows = [e for r in run_on(2, logged, "1f1b", 0.01) for e in r["rows"]]
    forward = [e["end"] - e["start"] for e in rows if e["name"].startswith("forward")]
    backward = [e["end"] - e["start"] for e in rows if e["name"].startswith("backward")]
    assert len(forward) == len(backward) == 8
    assert min(forward) >= 0.01 and min(backward) >= 0.02


def held(ctx, schedule):
    pipe = apply_pp(fresh_model().to(ctx.device), schedule=schedule, microbatches=4, measure_activations=True)
    pipe.step([stream(4)(0, i).to(ctx.device) for i in range(4)])
    return pipe.peak_activations, pipe.peak_activation_bytes


def test_afab_holds_m_micro_batches_1f1b_at_most_p():
    """Measured on the ranks (bytes autograd saved): AFAB keeps all m = 4 micro-batches'
    activations, 1F1B p - rank of them: half as many bytes on rank 0, a quarter on rank 1."""
    afab, one = run_on(2, held, "afab"), run_on(2, held, "1f1b")
    assert [n for n, _ in afab] == [4, 4] and [n for n, _ in one] == [2, 1]
    assert afab[0][1] == 2 * one[0][1] and afab[1][1] == 4 * one[1][1] > 0


# --------------------------------------------------------------------------- bad input
def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"9 stages but the model has 8 layers.*p\*v <= 8"):
        split_layers(8, 9)
    with pytest.raises(ValueError, match="add up to 8"):
        split_layers(8, 2, plan=[3, 4])
    assert split_layers(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]


def _apply(ctx, **options):
    apply_pp(fresh_model().to(ctx.device), **options)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(schedule="interleaved", microbatches=4, chunks=5), "10 stages but the model has 8 layers"),
        (dict(schedule="1f1b", microbatches=0), "m=0"),
        (dict(schedule="1f1b"), "microbatches=m"),
        (dict(schedule=make_schedule("1f1b", 3, 4)), "p=3 ranks but the pipeline group has 2"),
    ],
)
def test_bad_input_on_the_ranks(options, message):
    with pytest.raises(Exception, match=message):
        run_on(2, _apply, **options)


def test_a_pipeline_is_not_called_like_a_model():
    def call(ctx):
        pipe = apply_pp(fresh_model().to(ctx.device), schedule="1f1b", microbatches=2)
        pipe(torch.zeros(1, 8, dtype=torch.long, device=ctx.device))

    with pytest.raises(Exception, match=r"call pipe\.step\(micro_batches\)"):
        run_on(2, call)


def _subset_pipeline_then_all(ctx):
    import torch.distributed as dist

    from ultrascale.parallel.pipeline_messages import twin_group

    sub = ctx.new_group([1, 2])  # made by every rank; only ranks 1 and 2 register it
    if ctx.rank in (1, 2):
        twin_group(sub)  # a pipeline over ranks 1 and 2 makes its twin
    twin = twin_group(ctx.group)  # then one over all three: before the fix, a hang
    t = torch.full((1,), float(ctx.rank), device=ctx.device)
    dist.all_reduce(t, group=twin)
    return t.item()


def test_a_twin_group_is_made_after_ranks_made_different_groups():
    """torch names a locally synchronized group after its ranks and the calling process's count of
    groups: ranks whose counts differ (rank 0 kept out of a smaller pipeline) picked different
    names and waited for each other forever (the hang of a pipeline test in a full CI run).
    twin_group first brings the counts level."""
    from ultrascale.runtime import Cluster

    with Cluster(3) as cluster:
        assert cluster.run(_subset_pipeline_then_all, timeout=60) == [3.0, 3.0, 3.0]
