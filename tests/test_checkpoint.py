"""Checkpoints with DCP (ultrascale.checkpoint): saved at one layout, loaded at another, and
training goes on as if nothing had happened; a rank killed mid-step or mid-save loses no step.

Every run is float64 and compared, key by key, with one process that trained on the whole
global batch: the reference's own checkpoint against the resumed run's, both read back whole
with DCP's ``dcp_to_torch_save`` (every parameter, Adam's two moments and step counts).
Tolerance 1e-10: the layouts sum the same per-sample gradients in different orders (a
reduce-scatter over 4 or 3 ranks, the tp ranks' partial products), so float64 rounding
differs in the last bits (measured: below 1e-13 after 4 Adam steps); Adam divides by
sqrt(v) + 1e-8, which can scale a last-bit difference of a tiny gradient up to about the
step size lr = 1e-3 times the relative difference, far below 1e-10. A reshard that dropped
or misplaced a piece is off by the size of a weight (about 1e-2), and a resume at the wrong
sample or without Adam's step count by about lr.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ultrascale.checkpoint import (
    PARTIAL,
    SampleLoader,
    checkpoint_steps,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_checkpoint_async,
)
from ultrascale.checkpoint.failures import daly_interval, simulate_run, young_interval
from ultrascale.checkpoint.pieces import flat_boxes
from ultrascale.model import GPT, GPTConfig
from ultrascale.parallel import NaiveDataParallel, ZeRO
from ultrascale.parallel.compose import ParallelConfig, apply_parallelisms, build_mesh, data_index
from ultrascale.parallel.pipeline_parallel import apply_pp
from ultrascale.parallel.tensor_parallel import apply_tp
from ultrascale.parity import device_mesh_1d, fsdp2
from ultrascale.runtime import Cluster, RankError, shared_cluster
from ultrascale.train import run_steps

# a technique test: run under a GPU node's rules in make test, on the node's GPUs in make test-gpu
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

CFG = GPTConfig(vocab_size=64, hidden=32, layers=2, heads=2, seq_len=16)  # a block: 12,704, not a multiple of 3
MOE = GPTConfig(vocab_size=64, hidden=32, layers=2, heads=2, seq_len=16, experts=4, top_k=2)  # 4 experts a block
# compositions (parallel.compose) on 4 ranks: ZeRO-1 over TP's shards; experts and pipeline stages under ZeRO-1
TP_ZERO1 = ParallelConfig(dp=2, tp=2, zero=1, optimizer="adam")
EP_PP_ZERO1 = ParallelConfig(ep=2, pp=2, zero=1, optimizer="adam", microbatches=2)  # ep borrows the data ranks
TP_PP = ParallelConfig(tp=2, pp=2, optimizer="adam", microbatches=2)  # a torch optimizer on TP shards of stages
GLOBAL_BATCH = 12  # samples per step: splits over 1, 2, 3 and 4 data-parallel ranks
TOL = 1e-10


def fresh_model(device=None, cfg=CFG):
    torch.manual_seed(0)
    return GPT(cfg).double().to(device)


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


# --------------------------------------------------------------------------- on the ranks
def build(ctx, layout: str, stage: int = 1, cfg=CFG):
    """(model, optimizer, its forward, its after-backward hook, the loader) for one layout."""
    model = fresh_model(ctx.device, cfg)
    if layout == "zero":
        opt = ZeRO(model, stage=stage, optimizer_cls=torch.optim.Adam, lr=1e-3)
        return model, opt, None, None, SampleLoader(cfg, GLOBAL_BATCH, 0, ctx.rank, ctx.world_size, ctx.device)
    if isinstance(layout, ParallelConfig):  # parallel.compose: TP, EP, PP, then ZeRO over each one's data ranks
        mesh = build_mesh(ctx, layout)
        par = apply_parallelisms(model, mesh, layout)
        return (
            par.module,
            par.optimizer,
            None,
            None,
            SampleLoader(cfg, GLOBAL_BATCH, 0, *data_index(mesh, ctx.rank), ctx.device),
        )
    if layout == "fsdp2":  # PyTorch's own: fully_shard each block, then the root (ZeRO-3's units)
        model = fsdp2(model, device_mesh_1d(ctx))
        return (
            model,
            adam(model.parameters()),
            None,
            None,
            SampleLoader(CFG, GLOBAL_BATCH, 0, ctx.rank, ctx.world_size, ctx.device),
        )
    if layout == "tp":  # every rank one tp shard of one replica: all read the whole batch
        apply_tp(model)
        return model, adam(model.parameters()), None, None, SampleLoader(CFG, GLOBAL_BATCH, device=ctx.device)
    if layout == "pp":  # 2 stages, 1F1B over 2 micro-batches of the whole batch
        pipe = apply_pp(model, schedule="1f1b", microbatches=2)
        return pipe, adam(pipe.parameters()), None, None, SampleLoader(CFG, GLOBAL_BATCH, device=ctx.device)
    dp = NaiveDataParallel(model)
    return (
        model,
        adam(model.parameters()),
        dp,
        dp.finish_gradient_synchronization,
        SampleLoader(CFG, GLOBAL_BATCH, 0, ctx.rank, ctx.world_size, ctx.device),
    )


def train_and_save(
    ctx, root, layout, stage, steps, resume_from=None, save_every=None, kill=None, in_background=False, cfg=CFG
):
    """Resume from the newest checkpoint under ``resume_from`` (if any), train ``steps`` more,
    saving under ``root`` every ``save_every`` steps and at the end. ``kill``: (rank, step,
    "step" or "save"): that rank SIGKILLs itself in the middle of that step, or of its save.
    ``in_background``: each save is written while the next step trains (``save_checkpoint_async``)."""
    model, opt, module, after, loader = build(ctx, layout, stage, cfg)
    done, resumed = 0, None
    path = latest_checkpoint(resume_from) if resume_from else None
    if path is not None:
        done = load_checkpoint(path, model, opt, loader=loader)["step"]
        resumed = {
            "step": done,
            "next_sample": loader.next_sample,
            "first_row": loader.sample(loader.next_sample + loader.rank * (GLOBAL_BATCH // loader.world_size)),
        }

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    pending = None
    for step in range(done + 1, done + steps + 1):
        if kill and kill[1:] == (step, "step") and ctx.rank == kill[0]:
            batch = loader.next_batch()
            batch.loss(model if module is None else module)  # a forward, then the process is gone
            die()
        if layout == "pp" or getattr(layout, "pp", 1) > 1:  # the pipeline splits the batch into micro-batches
            model.step(loader.next_batch())
            opt.step()
            opt.zero_grad()
        else:
            run_steps(model, loader, 1, opt, module=module, after_backward=after)
        if pending is not None:  # the previous step's save, written while this step trained
            pending = pending.wait()
        if step == done + steps or (save_every and step % save_every == 0):
            killing = kill and kill[1:] == (step, "save") and ctx.rank == kill[0]
            if in_background:
                pending = save_checkpoint_async(root, step, model, opt, loader=loader)
            else:
                save_checkpoint(root, step, model, opt, loader=loader, before_commit=die if killing else None)
    if pending is not None:
        pending.wait()
    return resumed


# --------------------------------------------------------------------------- the reference
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(steps, cfg)``: one process, the whole global batch each step, its checkpoint
    after ``steps`` steps read whole (made once per model and number of steps for the whole file)."""
    folder, made = tmp_path_factory.mktemp("reference"), {}

    def checkpoint(steps: int, cfg=CFG) -> dict:
        if (steps, cfg) not in made:
            model = fresh_model(cfg=cfg)
            opt, loader = adam(model.parameters()), SampleLoader(cfg, GLOBAL_BATCH)
            run_steps(model, loader, steps, opt)
            made[steps, cfg] = read_whole(
                save_checkpoint(folder / f"{len(made)}", steps, model, opt, loader=loader), folder
            )
        return made[steps, cfg]

    return checkpoint


def read_whole(path, tmp_path) -> dict:
    out = tmp_path / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def assert_same_training_state(got: dict, want: dict, what: str) -> None:
    """Every weight and optimizer state of ``want`` in ``got``, equal to TOL; the same step and data position."""
    tensors = [k for k in want if k.startswith(("model.", "optim."))]
    assert tensors and sum(k.endswith("exp_avg_sq") for k in tensors) == sum(k.startswith("model.") for k in tensors)
    missing = [k for k in tensors if k not in got]
    assert not missing, f"{what}: the checkpoint lacks {missing}"
    for key in tensors:
        diff = (got[key].double() - want[key].double()).abs().max().item()
        assert diff <= TOL, f"{what}: {key} differs from the uninterrupted run's by {diff:.3g}"
    for key in ("meta.step", "meta.next_sample"):
        assert got[key] == want[key], f"{what}: {key} is {got[key]}, the uninterrupted run's {want[key]}"


# --------------------------------------------------------------------------- the tests
def test_a_flat_run_of_a_tensor_is_cut_into_boxes_that_hold_exactly_it():
    for shape in [(7,), (3, 5), (2, 3, 4), (1, 6), (4, 1)]:
        n = torch.Size(shape).numel()
        index = torch.arange(n).view(shape)
        for start in range(n + 1):
            for stop in range(start, n + 1):
                boxes = flat_boxes(shape, start, stop)
                held = [index[tuple(slice(o, o + s) for o, s in zip(off, sizes))].reshape(-1) for off, sizes in boxes]
                got = torch.cat(held).tolist() if held else []
                assert got == list(range(start, stop)), (shape, start, stop, boxes)
                assert len(boxes) <= 2 * len(shape) - 1  # a partial row, whole rows, a partial row, per level


def test_dp2_x_tp2_with_zero1_on_4_ranks_resumes_as_zero3_on_3(tmp_path, reference):
    """The issue's reshard: a composition whose ZeRO-1 flattens TP's shards (each run of a
    shard placed in its global weight) into ZeRO-3 on 3 ranks. Layout, stage, world size and
    padding all change (Ψ is not a multiple of 3)."""
    want = reference(4)
    shared_cluster(4).run(train_and_save, tmp_path / "zero1", TP_ZERO1, 1, 2)
    resumed = shared_cluster(3).run(train_and_save, tmp_path / "zero3", "zero", 3, 2, tmp_path / "zero1")
    # the loader resumes at the sample the 4 ranks would have read next: rank r's first row is
    # sample 24 + 4 r (12 samples a step over 3 ranks), as an uninterrupted 3-rank loader's
    for rank, r in enumerate(resumed):
        assert (r["step"], r["next_sample"]) == (2, 2 * GLOBAL_BATCH)
        assert torch.equal(r["first_row"], SampleLoader(CFG, GLOBAL_BATCH).sample(24 + 4 * rank))
    # each rank saved only its runs of its tp shards: the 4 ranks' boxes make the whole model
    saved = read_whole(latest_checkpoint(tmp_path / "zero1"), tmp_path)
    assert_same_training_state(saved, reference(2), "dp 2 x tp 2 + ZeRO-1")
    got = read_whole(latest_checkpoint(tmp_path / "zero3"), tmp_path)
    assert_same_training_state(got, want, "dp 2 x tp 2 + ZeRO-1 x4 -> ZeRO-3 x3")


def test_tensor_parallel_resumes_as_plain_data_parallel_saving_in_the_background(tmp_path, reference):
    """tp 2 into dp 2; then every step's checkpoint is written while the next step trains (the
    step-3 one while step 4 changes the weights): each holds its own step's state."""
    cluster = shared_cluster(2)
    cluster.run(train_and_save, tmp_path / "tp", "tp", 0, 2)
    cluster.run(train_and_save, tmp_path / "dp", "dp", 0, 2, tmp_path / "tp", 1, None, True)
    assert checkpoint_steps(tmp_path / "dp") == [3, 4]
    for step in (3, 4):
        assert_same_training_state(
            read_whole(tmp_path / "dp" / f"step-{step:08d}", tmp_path),
            reference(step),
            f"tp 2 -> dp 2, step {step} in the background",
        )


def test_pipeline_stages_resume_as_zero2(tmp_path, reference):
    """Each of 2 pipeline stages saves its blocks under the whole model's names (the tied head
    weight as the embedding's); ZeRO-2 on the same 2 ranks reads the whole model back."""
    want = reference(4)
    cluster = shared_cluster(2)
    cluster.run(train_and_save, tmp_path / "pp", "pp", 0, 2)
    cluster.run(train_and_save, tmp_path / "zero2", "zero", 2, 2, tmp_path / "pp")
    assert_same_training_state(read_whole(latest_checkpoint(tmp_path / "zero2"), tmp_path), want, "pp 2 -> ZeRO-2 x2")


def test_tp2_x_pp2_resumes_as_plain_data_parallelism_on_2(tmp_path, reference):
    """The issue's second reshard: each of 4 ranks holds one tp shard of one pipeline stage's
    weights, named as in the whole model, and saves its box of each; 2 ranks of plain DP read
    every weight back whole."""
    shared_cluster(4).run(train_and_save, tmp_path / "tp_pp", TP_PP, 0, 2)
    shared_cluster(2).run(train_and_save, tmp_path / "dp", "dp", 0, 2, tmp_path / "tp_pp")
    assert_same_training_state(
        read_whole(latest_checkpoint(tmp_path / "dp"), tmp_path), reference(4), "tp 2 x pp 2 x4 -> dp 2"
    )


def test_experts_and_pipeline_stages_under_zero1_resume_as_zero2_on_2(tmp_path, reference):
    """A mixture-of-experts model (4 experts a block) as ep 2 x pp 2 with ZeRO-1 on 4 ranks: each
    rank holds 2 experts of one stage's blocks under their global names, and ZeRO-1 shards the
    dense and the expert parameters over their own groups (the tied embedding is one of the first
    stage's units and one of the last's). ZeRO-2 on 2 ranks reads every expert back whole."""
    shared_cluster(4).run(train_and_save, tmp_path / "ep_pp", EP_PP_ZERO1, 1, 2, cfg=MOE)
    assert_same_training_state(
        read_whole(latest_checkpoint(tmp_path / "ep_pp"), tmp_path), reference(2, MOE), "ep 2 x pp 2 + ZeRO-1"
    )
    shared_cluster(2).run(train_and_save, tmp_path / "zero2", "zero", 2, 2, tmp_path / "ep_pp", cfg=MOE)
    assert_same_training_state(
        read_whole(latest_checkpoint(tmp_path / "zero2"), tmp_path),
        reference(4, MOE),
        "ep 2 x pp 2 + ZeRO-1 x4 -> ZeRO-2 x2",
    )


@pytest.mark.parametrize("first, then", [("zero", "fsdp2"), ("fsdp2", "zero")])
def test_zero3_and_fsdp2_load_each_others_checkpoints(tmp_path, reference, first, then):
    """Our ZeRO-3's checkpoint trains on in torch's FSDP2 (fully_shard), and the other way round:
    the same keys and global shapes, so DCP reads one's flat-shard boxes into the other's DTensors."""
    want = reference(4)
    cluster = shared_cluster(3)
    cluster.run(train_and_save, tmp_path / first, first, 3, 2)
    cluster.run(train_and_save, tmp_path / then, then, 3, 2, tmp_path / first)
    assert_same_training_state(
        read_whole(latest_checkpoint(tmp_path / then), tmp_path), want, f"{first} x3 -> {then} x3"
    )


def test_a_rank_killed_mid_save_and_mid_step_loses_no_step(tmp_path, reference):
    """ZeRO-2 on 3 ranks, a checkpoint every 2 steps. Rank 2 dies inside the save of step 4
    (its files written, the checkpoint not yet renamed): step 2's is the last complete one.
    Resumed from it, rank 1 dies in the middle of step 5: step 4's is. The third run ends at 6."""
    want = reference(6)
    root = tmp_path / "run"
    with Cluster(3) as cluster:
        with pytest.raises(RankError) as info:
            cluster.run(train_and_save, root, "zero", 2, 6, root, 2, (2, 4, "save"), timeout=120)
        assert info.value.failures[2].type_name == "died"
        assert checkpoint_steps(root) == [2] and (root / f"step-00000004{PARTIAL}").is_dir()
        with pytest.raises(RankError) as info:
            cluster.run(train_and_save, root, "zero", 2, 4, root, 2, (1, 5, "step"), timeout=120)
        assert info.value.failures[1].type_name == "died"
        assert checkpoint_steps(root) == [2, 4]
        resumed = cluster.run(train_and_save, root, "zero", 2, 2, root, 2)
    assert [r["step"] for r in resumed] == [4, 4, 4]
    assert_same_training_state(read_whole(latest_checkpoint(root), tmp_path), want, "killed twice, resumed")


def test_a_partial_checkpoint_is_refused_by_name():
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(f"/nonexistent/step-00000004{PARTIAL}", None, None)


def test_the_lost_time_is_smallest_near_young_and_dalys_intervals():
    """Seeded runs with random failures. Cheap checkpoints (C = 10 s, M = 1000 s): Young's and
    Daly's intervals nearly agree and lose within 3% of the least a grid of intervals loses,
    while a quarter or four times the interval loses over 50% more. Slow checkpoints (C = 300 s,
    M = 600 s): Daly's interval (417 s) loses clearly less than Young's (600 s)."""
    c, m, work = 10.0, 1000.0, 20_000.0
    young, daly = young_interval(c, m), daly_interval(c, m)
    lost = {
        tau: simulate_run(work, tau, c, m, runs=60)
        for tau in [young / 4, young / 2, young / 1.5, daly, young, young * 1.5, young * 2, young * 4]
    }
    best = min(lost.values())
    assert lost[young] <= 1.03 * best and lost[daly] <= 1.03 * best, lost
    assert min(lost[young / 4], lost[young * 4]) > 1.5 * best, lost
    c, m = 300.0, 600.0
    young, daly = young_interval(c, m), daly_interval(c, m)
    assert daly < young - c / 2
    assert simulate_run(work, daly, c, m, runs=30) < 0.97 * simulate_run(work, young, c, m, runs=30)
