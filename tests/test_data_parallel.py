"""Data parallelism (NB02): naive, overlapped and bucketed DP against single-process
training and PyTorch DDP, no_sync accumulation, hook order, timelines, the batch-size recipe.

Tolerances: each rank averages its own micro-batch gradient and the all-reduce sums
those averages, while the single-process reference averages the concatenated batch in
one go. The two agree exactly in real arithmetic; in fp32 the sums are associated
differently, so gradients differ in the last bits (~1e-7 relative). Three SGD steps
with lr 0.1 turn that into weight differences of ~1e-8 (measured); we allow 1e-6.
"""
import matplotlib
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ultrascale.batch_size import global_batch_size, plan_batch, samples_per_step
from ultrascale.model import GPT
from ultrascale.parallel import (BucketedDataParallel, NaiveDataParallel, OverlappedDataParallel,
                                 Timeline, build_buckets, covered_seconds, overlap_seconds)
from dp_common import CFG, batch, cluster  # noqa: F401  (cluster is a fixture)

matplotlib.use("Agg")

MBS, STEPS, LR = 2, 3, 0.1
TOL = dict(rtol=1e-5, atol=1e-6)
BUCKET_MB = 0.02   # ~20 KB: the tiny model (110 KB of fp32 gradients) fills several buckets
WRAPPERS = {
    "naive": NaiveDataParallel,
    "overlap": OverlappedDataParallel,
    "bucket": lambda m, **kw: BucketedDataParallel(m, bucket_cap_mb=BUCKET_MB, **kw),
}


def loss_of(model, tokens):
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def single_process(world, grad_acc=1):
    """The reference: one process, the concatenated batch of every rank."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        for micro in range(grad_acc):
            (loss_of(model, batch(step, MBS * world, micro)) / grad_acc).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _model_on_rank(ctx):
    torch.manual_seed(ctx.rank)  # different on each rank: the wrapper's broadcast must fix it
    model = GPT(CFG)
    if ctx.rank == 0:
        torch.manual_seed(0)
        model = GPT(CFG)
    return model


def train_dp(ctx, kind, grad_acc, use_no_sync):
    import contextlib

    model = _model_on_rank(ctx)
    dp = WRAPPERS[kind](model, timeline=Timeline(ctx.rank))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    mine = slice(MBS * ctx.rank, MBS * (ctx.rank + 1))
    for step in range(STEPS):
        for micro in range(grad_acc):
            last = micro == grad_acc - 1
            sync = contextlib.nullcontext() if last or not use_no_sync else dp.no_sync()
            with sync:
                with dp.timeline.span("forward"):
                    loss = loss_of(dp, batch(step, MBS * ctx.world_size, micro)[mine]) / grad_acc
                with dp.timeline.span("backward"):
                    loss.backward()
                if not use_no_sync or last:
                    dp.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    return {"params": {n: p.detach() for n, p in model.named_parameters()},
            "all_reduces": dp.num_all_reduces, "syncs": dp.num_syncs,
            "order": getattr(dp, "ready_order", []), "rows": dp.timeline.rows()}


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_dp_equals_single_process_on_concatenated_batch(cluster, kind):
    world = cluster.world_size
    results = cluster.run(train_dp, kind, 1, False)
    reference = single_process(world)
    for name, expected in reference.items():
        torch.testing.assert_close(results[0]["params"][name], expected, **TOL, msg=name)
        for r in results[1:]:   # the replicas stay identical: the same update everywhere
            assert torch.equal(r["params"][name], results[0]["params"][name]), name


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_no_sync_accumulation_saves_grad_acc_minus_one_syncs(cluster, kind):
    grad_acc = 3
    with_no_sync = cluster.run(train_dp, kind, grad_acc, True)[0]
    every_micro = cluster.run(train_dp, kind, grad_acc, False)[0]
    reference = single_process(cluster.world_size, grad_acc)
    for name, expected in reference.items():
        torch.testing.assert_close(with_no_sync["params"][name], expected, **TOL, msg=name)
        torch.testing.assert_close(every_micro["params"][name], expected, **TOL, msg=name)
    assert with_no_sync["syncs"] == STEPS and every_micro["syncs"] == STEPS * grad_acc
    per_sync = with_no_sync["all_reduces"] // STEPS
    assert every_micro["all_reduces"] - with_no_sync["all_reduces"] == STEPS * (grad_acc - 1) * per_sync


def train_ddp_and_ours(ctx, grad_acc):
    """DDP and our bucketed DP, same bucket cap, same data, no_sync accumulation."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for name in ("ddp", "ours"):
        model = _model_on_rank(ctx)
        wrapped = (DDP(model, bucket_cap_mb=BUCKET_MB) if name == "ddp"
                   else BucketedDataParallel(model, bucket_cap_mb=BUCKET_MB))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        mine = slice(MBS * ctx.rank, MBS * (ctx.rank + 1))
        for step in range(STEPS):
            for micro in range(grad_acc):
                with wrapped.no_sync() if micro < grad_acc - 1 else _nothing():
                    (loss_of(wrapped, batch(step, MBS * ctx.world_size, micro)[mine]) / grad_acc).backward()
            if name == "ours":
                wrapped.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad()
        out[name] = {n: p.detach() for n, p in model.named_parameters()}
    return out


def _nothing():
    import contextlib
    return contextlib.nullcontext()


def test_bucketed_dp_matches_pytorch_ddp(cluster):
    out = cluster.run(train_ddp_and_ours, 2)[0]
    for name, expected in out["ddp"].items():
        torch.testing.assert_close(out["ours"][name], expected, **TOL, msg=name)


def test_hooks_fire_in_reverse_layer_order_and_overlap_backward(cluster):
    overlap = cluster.run(train_dp, "overlap", 1, False)[0]
    order = overlap["order"][: len(overlap["order"]) // STEPS]   # first step
    blocks = [int(n.split(".")[1]) for n in order if n.startswith("blocks.")]
    assert blocks == sorted(blocks, reverse=True), "block gradients should arrive last layer first"
    assert order[-1] == "embed.weight"   # the (tied) embedding is the very first layer
    for kind, expect_inside in (("overlap", True), ("bucket", True), ("naive", False)):
        rows = cluster.run(train_dp, kind, 1, False)[0]["rows"]
        backward = [e for e in rows if e["name"] == "backward"][0]
        comm = [e for e in rows if e["lane"] == "communication" and backward["start"] <= e["start"]]
        first_comm = min(e["start"] for e in comm)
        # Overlapped versions launch their first all-reduce while backward still runs;
        # naive DP only starts after backward has returned.
        assert (first_comm < backward["end"]) is expect_inside, kind


def count_all_reduce_calls(ctx, kind):
    model = _model_on_rank(ctx)
    dp = WRAPPERS[kind](model)
    tokens = batch(0, MBS * ctx.world_size)[MBS * ctx.rank: MBS * (ctx.rank + 1)]
    try:
        from ultrascale.comm import CommLogger
    except ImportError:
        CommLogger = None
    logged = None
    if CommLogger is not None:
        with CommLogger() as log:
            loss_of(dp, tokens).backward()
            dp.finish_gradient_synchronization()
        logged = log.totals().get("all_reduce", {}).get("calls")
    else:
        loss_of(dp, tokens).backward()
        dp.finish_gradient_synchronization()
    n_buckets = len(getattr(dp, "buckets", []))
    return dp.num_all_reduces, logged, n_buckets


def test_bucketing_makes_fewer_larger_calls(cluster):
    n_params = len(list(GPT(CFG).parameters()))
    per_tensor, logged, _ = cluster.run(count_all_reduce_calls, "overlap")[0]
    bucketed, logged_b, n_buckets = cluster.run(count_all_reduce_calls, "bucket")[0]
    assert per_tensor == n_params and bucketed == n_buckets < n_params
    if logged is not None:   # the communication logger sees the same calls
        assert (logged, logged_b) == (per_tensor, bucketed)


def test_build_buckets_respects_cap_and_order():
    params = [torch.zeros(n) for n in (10, 10, 30, 5, 5, 5)]   # fp32: 40, 40, 120, 20, 20, 20 bytes
    buckets = build_buckets(params, bucket_cap_bytes=80)
    assert [[p.numel() for p in b] for b in buckets] == [[10, 10], [30], [5, 5, 5]]
    assert [p for b in buckets for p in b] == params


def test_timeline_interval_arithmetic():
    assert covered_seconds([(0, 2), (1, 3), (5, 6)]) == 4
    rows = [{"rank": 0, "lane": "compute", "start": 0.0, "end": 4.0},
            {"rank": 0, "lane": "communication", "start": 3.0, "end": 6.0},
            {"rank": 1, "lane": "communication", "start": 0.0, "end": 1.0}]
    assert overlap_seconds(rows) == pytest.approx(1.0)
    tl = Timeline(rank=0)
    with tl.span("forward"):
        pass
    tl.mark("grad ready x")
    assert [e["name"] for e in tl.rows()] == ["forward", "grad ready x"]
    assert Timeline(enabled=False).rows() == []


def test_gantt_draws_one_bar_per_event():
    from ultrascale.viz.gantt import lane_summary, plot_gantt

    rows = [[{"rank": r, "lane": lane, "name": name, "start": s, "end": e, "nbytes": 0}
             for lane, name, s, e in (("compute", "backward", 0.0, 0.004),
                                      ("communication", "all_reduce bucket 0", 0.002, 0.006))]
            for r in range(2)]
    fig = plot_gantt(rows, title="test")
    assert len(fig.axes[0].collections) == 4
    summary = lane_summary(rows)
    assert summary[0]["overlapped"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no events"):
        plot_gantt([])


def test_wrapper_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        NaiveDataParallel(torch.nn.Linear(2, 2))


def test_batch_size_recipe_reproduces_the_book():
    assert global_batch_size(mbs=2, grad_acc=4, dp=128) == 1024
    assert samples_per_step(4e6, 4096) == 1024            # 976.6 rounds to the power of two 1024
    assert samples_per_step(4 * 2 ** 20, 4096) == 1024
    assert plan_batch(4e6, 4096, mbs=2, dp=128).grad_acc == 4
    fast = plan_batch(4e6, 4096, mbs=2, dp=512)
    assert fast.grad_acc == 1 and fast.achieved_gbs == 1024 and fast.tokens_per_step == 1024 * 4096
    rich = plan_batch(4e6, 4096, mbs=2, dp=1024)          # 2048 samples per step > 1024
    assert rich.gpu_rich and len(rich.options) == 3
    assert "dp=512" in rich.options[0] and "2048" in rich.options[1] and "size to 1" in rich.options[2]
    with pytest.raises(ValueError):
        global_batch_size(mbs=0, grad_acc=1, dp=1)
