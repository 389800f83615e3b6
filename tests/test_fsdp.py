"""Per-parameter sharding (parallel/fsdp.py, FSDP2's design): a plain torch optimizer steps the
shards, and training ends with the weights of one process and of PyTorch's ``fully_shard``.

Tolerances: the parity ones (``parity.TOLERANCES``) for the dtype and optimizer. Against one
process they are needed (the ranks sum their averaged gradients in another order); against
``fully_shard`` we measured bit-identical weights (both cut rows as ``torch.chunk`` does and
reduce in the same order), but hold it only to the same justified tolerance.
"""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ultrascale.comm import CommLogger
from ultrascale.comm.logger import base_op
from ultrascale.comm.cost_model import AlphaBeta
from ultrascale.data import Batches
from ultrascale.memory import breakdown, state_bytes
from ultrascale.model import GPT, GPTConfig
from ultrascale.parallel.fsdp import apply_fsdp, fsdp_units, full_state_dict, shard_rows
from ultrascale.parallel.sharded_muon import Muon
from ultrascale.parity import assert_replicas_identical, assert_same, perturbed
from ultrascale.runtime import shared_cluster
from ultrascale.train import make_optimizer, run_steps, weights

# a technique test: run under a GPU node's rules in make test, on the node's GPUs in make test-gpu
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

STEPS = 3
# vocab 64 over 3 ranks: 22, 22, 20 rows; vocab 9 over 4 ranks: 3, 3, 3 and an empty shard
CONFIGS = {
    2: GPTConfig(vocab_size=64, hidden=32, layers=2, heads=2, seq_len=16),
    3: GPTConfig(vocab_size=64, hidden=32, layers=2, heads=2, seq_len=16),
    4: GPTConfig(vocab_size=9, hidden=32, layers=2, heads=2, seq_len=16),
}
HSDP_DIMS = ("dp_replicate", "dp_shard")


def fresh_model(world, dtype=torch.float64):
    torch.manual_seed(0)
    return perturbed(GPT(CONFIGS[world])).to(dtype)  # perturbed: no norm weight left at 1, no bias at 0


def data(world):
    return Batches(CONFIGS[world], mbs=2, seed=0)


def train_ours(ctx, opt, dtype=torch.float64, mesh_shape=None, grad_acc=1, **options):
    mesh = None if mesh_shape is None else init_device_mesh(ctx.device.type, mesh_shape, mesh_dim_names=HSDP_DIMS)
    model = apply_fsdp(fresh_model(ctx.world_size, dtype).to(ctx.device), mesh, **options)
    optimizer = make_optimizer(model.parameters(), opt)  # a plain torch optimizer on the shards
    batches = data(ctx.world_size).rank_stream(ctx.rank, ctx.world_size)
    loss = batches(0, 0).to(ctx.device).loss(model)
    held = [
        [full.untyped_storage().nbytes() for e, full in zip(unit.entries, unit.fulls) if e.sharded]
        for unit in fsdp_units(model)
    ]  # between forward and backward: root first
    loss.backward()
    released = all(unit.fulls is None for unit in fsdp_units(model))
    held_bytes = state_bytes(model)  # this rank's parameters and gradients: its shards
    grad_shapes = {n: (tuple(p.shape), tuple(p.grad.shape), p.grad.dtype) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with CommLogger() as log:
        losses = run_steps(model, batches, STEPS, optimizer, device=ctx.device, grad_acc=grad_acc)
    # Adam's moments (its step counters, one scalar per parameter, left out as breakdown does)
    held_bytes["optimizer states"] = sum(
        t.untyped_storage().nbytes() for s in optimizer.state.values() for key, t in s.items() if key != "step"
    )
    per_group = {}  # bytes by (collective, size of the group it ran on): the mesh's axes
    for e in log.events:
        row = per_group.setdefault((base_op(e.op), e.world_size), {"calls": 0, "bytes_sent": 0})
        row["calls"], row["bytes_sent"] = row["calls"] + 1, row["bytes_sent"] + e.bytes_sent
    return {
        "weights": full_state_dict(model),
        "losses": losses,
        "comm": by_collective(log),
        "grad_shapes": grad_shapes,
        "held": held,
        "released": released,
        "held_bytes": held_bytes,
        "per_group": per_group,
        "replicated": {n: p.detach().cpu() for n, p in model.named_parameters() if "norm" in n},
    }


def train_fully_shard(ctx, opt, dtype=torch.float64, mesh_shape=None, mp_policy=None):
    mesh = init_device_mesh(
        ctx.device.type, mesh_shape or (ctx.world_size,), mesh_dim_names=HSDP_DIMS if mesh_shape else None
    )
    model = fresh_model(ctx.world_size, dtype).to(ctx.device)
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in model.blocks:  # the same units as apply_fsdp's default
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    losses = run_steps(
        model,
        data(ctx.world_size).rank_stream(ctx.rank, ctx.world_size),
        STEPS,
        make_optimizer(model.parameters(), opt),
        device=ctx.device,
    )
    return {"weights": weights(model), "losses": losses, "shapes": shapes}


def by_collective(log) -> dict:
    """The logger's totals by collective: all_gather_single (torch 2.13) and
    all_gather_into_tensor (2.11) are both "all_gather"."""
    return {base_op(op): row for op, row in log.totals().items()}


def one_process(world, opt, dtype=torch.float64, grad_acc=1):
    model = fresh_model(world, dtype)
    run_steps(model, data(world).global_stream(world), STEPS, opt, grad_acc=grad_acc)
    return weights(model)


def test_shard_rows_cut_as_torch_chunk():
    for rows in range(0, 12):
        for n in range(1, 6):
            chunks = torch.arange(rows).chunk(n) if rows else ()
            lengths = [shard_rows(rows, n, r)[1] for r in range(n)]
            assert lengths == [len(c) for c in chunks] + [0] * (n - len(chunks)), (rows, n)
            starts = [shard_rows(rows, n, r)[0] for r in range(n)]
            assert starts == [sum(lengths[:r]) for r in range(n)], (rows, n)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_plain_optimizer_equals_one_process_and_fully_shard(world):
    cluster = shared_cluster(world)
    for opt in ("sgd", "adamw"):
        ours = cluster.run(train_ours, opt)
        theirs = cluster.run(train_fully_shard, opt)
        reference = one_process(world, opt)
        for rank, (mine, torch_s) in enumerate(zip(ours, theirs)):
            for name, (shape, grad_shape, grad_dtype) in mine["grad_shapes"].items():
                assert shape == torch_s["shapes"][name], (
                    f"rank {rank} {name}: shard {shape}, fully_shard's {torch_s['shapes'][name]}"
                )
                assert grad_shape == shape and grad_dtype == torch.float64, f"rank {rank} {name}: .grad {grad_shape}"
            assert_same(mine["weights"], reference, f"{world} ranks {opt} vs one process", optimizer=opt)
            assert_same(mine["weights"], torch_s["weights"], f"{world} ranks {opt} vs fully_shard", optimizer=opt)
            # between forward and backward only the root unit stays gathered; after backward, none
            assert all(held > 0 for held in mine["held"][0]), f"rank {rank}: the root unit was freed after forward"
            assert not any(sum(held) for held in mine["held"][1:]), f"rank {rank}: a block kept its whole weights"
            assert mine["released"], f"rank {rank}: gathered weights kept after backward"
        if world == 4:  # vocab 9 over 4 ranks: the last rank's embedding shard is empty
            assert ours[3]["grad_shapes"]["embed.weight"][0] == (0, 32)


def test_replicated_norms_and_accumulation():
    """Norms kept whole: their gradients are all-reduced, so every rank steps them alike;
    with two micro-batches per step the run still equals one process."""
    cluster = shared_cluster(3)
    results = cluster.run(train_ours, "sgd", grad_acc=2, replicate=("*norm*",))
    shapes = results[0]["grad_shapes"]
    assert shapes["norm.weight"][0] == (32,) and shapes["blocks.0.attn.q.weight"][0] == (11, 32)
    assert_replicas_identical([r["replicated"] for r in results], "replicated norms")
    assert_same(results[0]["weights"], one_process(3, "sgd", grad_acc=2), "replicated norms", optimizer="sgd")


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None], ids=["reduce-fp32", "reduce-bf16"])
def test_mixed_precision_matches_fully_shard(reduce_dtype):
    """bf16 gathers, fp32 masters: the same weights as fully_shard under the same policy,
    exactly half the all-gather bytes of fp32, and a loss near fp32 training's."""
    cluster = shared_cluster(3)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    fp32 = cluster.run(train_ours, "adamw", torch.float32)
    ours = cluster.run(train_ours, "adamw", torch.float32, mp_policy=policy)
    theirs = cluster.run(train_fully_shard, "adamw", torch.float32, mp_policy=policy)
    for mine, torch_s, full in zip(ours, theirs, fp32):
        assert all(w.dtype == torch.float32 for w in mine["weights"].values()), "masters must stay fp32"
        assert_same(mine["weights"], torch_s["weights"], "bf16 gathers vs fully_shard", optimizer="adamw")
        gathered = mine["comm"]["all_gather"]
        assert gathered["calls"] == full["comm"]["all_gather"]["calls"]
        assert 2 * gathered["bytes_received"] == full["comm"]["all_gather"]["bytes_received"]
        reduced = mine["comm"]["reduce_scatter"]["bytes_sent"]
        assert reduced * (2 if reduce_dtype is None else 1) == full["comm"]["reduce_scatter"]["bytes_sent"]
        # bf16 keeps 8 bits: the loss moves by a few parts in a thousand, not more
        assert_same(
            torch.tensor(mine["losses"]),
            torch.tensor(full["losses"]),
            "bf16 loss vs fp32",
            tol=dict(rtol=1e-2, atol=0.0),
        )


def test_hybrid_sharding_matches_fully_shard_on_2d_mesh():
    """HSDP on 4 ranks, (replicate 2) x (shard 2): weights of one process and of fully_shard's
    HSDP; a rank holds its shard of every parameter, gradient and Adam moment, as
    memory.breakdown(dp=4, dp_shard=2) says; the bytes on each axis are the cost model's ring
    volumes of the padded buffers: all-gathers and reduce-scatters over the shard axis, one
    all-reduce of the gradient shards per unit and step over the replicate axis."""
    cluster = shared_cluster(4)
    ours = cluster.run(train_ours, "adamw", mesh_shape=(2, 2))
    theirs = cluster.run(train_fully_shard, "adamw", mesh_shape=(2, 2))
    reference = one_process(4, "adamw")
    units = 1 + CONFIGS[4].layers  # each block, and the rest
    for mine, torch_s in zip(ours, theirs):
        assert_same(mine["weights"], reference, "HSDP vs one process", optimizer="adamw")
        assert_same(mine["weights"], torch_s["weights"], "HSDP vs fully_shard", optimizer="adamw")
        assert mine["grad_shapes"]["blocks.0.mlp.fc.weight"][0] == (64, 32)  # 128 rows over 2 shards
        assert mine["comm"]["reduce_scatter"]["calls"] == units * STEPS
        assert mine["comm"]["all_reduce"]["calls"] == units * STEPS
    check_hsdp_memory(ours, reference, replicas=2, shards=2)
    check_hsdp_bytes(ours, reference, replicas=2, shards=2)


def check_hsdp_memory(results, reference, replicas, shards):
    """Parameters, gradients and Adam's moments against breakdown's HSDP count (float64: twice
    its fp32 bytes). The vocabulary (9 rows) does not split evenly, so a rank is within one row
    of each parameter of the formula, and the shards of one replica add up to it exactly; but
    for the gradients: their shards are views of the unit's reduce-scatter output, which keeps
    the padding rows too (here one row of the embedding's)."""
    config = CONFIGS[replicas * shards]
    formula = breakdown(
        config, dp=replicas * shards, dp_shard=shards, zero_stage=3, mixed_precision=False, optimizer_bytes=8
    )
    row = sum(w[0].numel() for w in reference.values()) * 8  # one row of every parameter
    padding = sum((-(-w.shape[0] // shards) * shards - w.shape[0]) * w[0].numel() for w in reference.values()) * 8
    one_row = {"parameters": row, "gradients": row, "optimizer states": 2 * row}  # Adam: two moments
    for key, one_row_bytes in one_row.items():
        expected = 2 * formula[key]  # float64
        for rank, r in enumerate(results):
            assert abs(r["held_bytes"][key] - expected) <= one_row_bytes, (rank, key, r["held_bytes"][key], expected)
        for replica in range(replicas):  # ranks replica * shards + s: one replica's shards
            block = results[replica * shards : (replica + 1) * shards]
            extra = padding if key == "gradients" else 0
            assert sum(r["held_bytes"][key] for r in block) == shards * expected + extra, (replica, key)


def check_hsdp_bytes(results, reference, replicas, shards):
    """Each axis' bytes per rank and step, as the cost model prices them (alpha 0, beta 1 byte
    per second: a time in seconds is a volume in bytes): a unit's padded float64 buffer K, the
    ring phase (S-1)/S K for each gather and reduce-scatter over the shard axis, the all-reduce
    2 (R-1)/R K/S of the gradient shards over the replicate axis."""
    ring = AlphaBeta(alpha=0.0, beta=1.0)
    unit_bytes = {}  # padded rows x row size x 8 bytes, by unit (root: what no block holds)
    for name, w in reference.items():
        unit = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        unit_bytes[unit] = unit_bytes.get(unit, 0) + -(-w.shape[0] // shards) * shards * w[0].numel() * 8
    blocks = sum(k for u, k in unit_bytes.items() if u != "root")
    gathered = sum(unit_bytes.values()) + blocks  # forward gathers every unit, backward all but the root
    expected = {
        ("all_gather", shards): ring.ring_phase_time(gathered, shards),
        ("reduce_scatter", shards): ring.ring_phase_time(sum(unit_bytes.values()), shards),
        ("all_reduce", replicas): sum(ring.ring_all_reduce_time(k / shards, replicas) for k in unit_bytes.values()),
    }
    for rank, r in enumerate(results):
        assert set(r["per_group"]) == set(expected), (rank, r["per_group"])
        for key, per_step in expected.items():
            assert r["per_group"][key]["bytes_sent"] == STEPS * per_step, (rank, key, r["per_group"][key])


def test_recomputation_refused():
    model = GPT(CONFIGS[2]).set_recompute("full")
    with pytest.raises(ValueError, match="recomputation"):
        apply_fsdp(model)


# --------------------------------------------------------------------------- Muon
class Optimizers:
    """Muon for the blocks' matrices, AdamW for the rest (embeddings, norms): stepped together."""

    def __init__(self, model, **muon):
        matrices = [
            p
            for n, p in model.named_parameters()
            if n.startswith("blocks.") and n.endswith(".weight") and "norm" not in n
        ]
        rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
        self.all = [Muon(matrices, lr=0.02, ns_dtype=torch.float64, **muon), torch.optim.AdamW(rest, lr=1e-3)]
        self.logs = []  # each step's collectives: what the optimizers add to forward's and backward's

    def step(self):
        with CommLogger() as log:
            for opt in self.all:
                opt.step()
        self.logs.append(by_collective(log))

    def zero_grad(self):
        for opt in self.all:
            opt.zero_grad()


def muon_matrix_shapes(world):
    return [
        tuple(p.shape)
        for n, p in fresh_model(world).named_parameters()
        if n.startswith("blocks.") and n.endswith(".weight") and "norm" not in n
    ]


def train_sharded_muon(ctx, mode):
    model = apply_fsdp(fresh_model(ctx.world_size).to(ctx.device))
    optimizers = Optimizers(model, fsdp=model.fsdp, mode=mode)
    with CommLogger() as log:
        run_steps(
            model, data(ctx.world_size).rank_stream(ctx.rank, ctx.world_size), STEPS, optimizers, device=ctx.device
        )
    steps = {}  # the optimizers' collectives over all steps, by collective
    for totals in optimizers.logs:
        for op, row in totals.items():
            summed = steps.setdefault(op, {"calls": 0, "bytes_sent": 0, "bytes_received": 0})
            for key in summed:
                summed[key] += row[key]
    return {"weights": full_state_dict(model), "comm": by_collective(log), "steps": steps}


def test_muon_equals_torch_muon():
    """Our Muon on whole matrices (wide, tall, square; with and without Nesterov) against
    torch.optim.Muon on the same gradients: the same operations, so the same numbers."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (4, 9), (6, 6)]
    for nesterov in (True, False):
        ours = [torch.randn(s, generator=generator).requires_grad_() for s in shapes]
        theirs = [p.detach().clone().requires_grad_() for p in ours]
        opts = [Muon(ours, lr=0.02, nesterov=nesterov), torch.optim.Muon(theirs, lr=0.02, nesterov=nesterov)]
        for _ in range(STEPS):
            for mine, torch_p in zip(ours, theirs):
                mine.grad = torch.randn(mine.shape, generator=generator)
                torch_p.grad = mine.grad.clone()
            for opt in opts:
                opt.step()
        for mine, torch_p in zip(ours, theirs):
            assert_same(mine.detach(), torch_p.detach(), f"Muon nesterov={nesterov}", optimizer="adam")
    with pytest.raises(ValueError, match="matrices"):
        Muon([torch.zeros(3, requires_grad=True)])


@pytest.mark.parametrize("mode, world", [("gather", 3), ("owners", 3), ("owners", 4)])
def test_sharded_muon_equals_one_process(mode, world):
    """Muon on row shards (3 ranks: uneven rows, padded; 4: even, so the owner scatters views of
    the tall matrices' transposed result) equals Muon on whole matrices in one process.
    The traffic Muon adds: "gather" all-gathers every matrix to every rank ((N-1)/N of the
    padded matrices received per rank and step); "owners" moves those same bytes only once in
    all, into the owners, and once back out. AdamW's step on its shards adds nothing (the
    optimizers' steps are logged apart from forward and backward)."""
    results = shared_cluster(world).run(train_sharded_muon, mode)
    model = fresh_model(world)
    run_steps(model, data(world).global_stream(world), STEPS, Optimizers(model))
    reference = weights(model)
    for r in results:
        assert_same(r["weights"], reference, f"sharded Muon ({mode})", optimizer="adam")
    padded = sum(-(-rows // world) * world * cols for rows, cols in muon_matrix_shapes(world)) * 8
    muon_bytes = STEPS * padded * (world - 1) // world
    fsdp_gathers = STEPS * (2 * (1 + CONFIGS[world].layers) - 1)  # forward per unit, backward but the root
    for r in results:  # outside the optimizers' steps: forward's and backward's gathers only
        assert r["comm"]["all_gather"]["calls"] - r["steps"].get("all_gather", {}).get("calls", 0) == fsdp_gathers
    if mode == "gather":
        for r in results:
            assert set(r["steps"]) == {"all_gather"}
            assert r["steps"]["all_gather"]["calls"] == STEPS * len(muon_matrix_shapes(world))
            assert r["steps"]["all_gather"]["bytes_received"] == muon_bytes
    else:
        assert all(set(r["steps"]) == {"gather", "scatter"} for r in results)
        assert sum(r["steps"]["gather"]["bytes_received"] for r in results) == muon_bytes
        assert sum(r["steps"]["scatter"]["bytes_sent"] for r in results) == muon_bytes
