"""5D composition (parallel.compose): every factorisation of 4 ranks trains the course GPT to
the same loss curve and weights as one process; the rank-to-group maps; the errors.

Why float64 and ``parity.TOLERANCES``: the ranks sum gradients (and, under CP, attention's
partial results) in another order than one process. That is exact in real arithmetic and
~1e-16 apart in float64, so the float64 tolerance can only be met by the right composition;
a gradient averaged over the wrong group (say dp but not cp), a stage left out or a shard
never gathered is off by far more.
"""

import pytest
import torch

from ultrascale.data import Batches
from ultrascale.model import GPT, GPTConfig
from ultrascale.parallel.compose import ParallelConfig, build_mesh, data_index, mean_loss
from ultrascale.parallel.mesh import Mesh
from ultrascale.parity import perturbed
from ultrascale.parity.composition import assert_composition_matches, train_composed, train_one_process
from ultrascale.runtime import RankError, shared_cluster

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

CONFIG = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=4, seq_len=16)
DATA = Batches(CONFIG, mbs=2, seed=0)
STEPS = 2

FACTORISATIONS = [
    ParallelConfig(dp=2, tp=2),
    ParallelConfig(pp=2, tp=2, microbatches=2),
    ParallelConfig(dp=2, pp=2, microbatches=2),
    ParallelConfig(cp=2, tp=2),
    ParallelConfig(dp=2, tp=2, sp=True),
    ParallelConfig(dp=2, cp=2, zero=1, optimizer="adam"),
    ParallelConfig(dp=4, zero=2, microbatches=2),
    ParallelConfig(pp=2, cp=2, microbatches=2, schedule="afab"),
    # HSDP: each parameter sharded over 2 dp ranks, replicated over the 2 blocks (issue 57)
    ParallelConfig(dp=4, dp_shard=2, microbatches=2, optimizer="adam"),
]


def fresh_model():
    torch.manual_seed(0)
    return perturbed(GPT(CONFIG).double())  # biases and norms away from 0 and 1


def composed(ctx, config):
    return train_composed(ctx, fresh_model().to(ctx.device), config, DATA, STEPS)  # its batches follow


MOE = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=4, seq_len=16, experts=4, top_k=2)
MOE_DATA = Batches(MOE, mbs=2, seed=0)


def moe_model():
    torch.manual_seed(0)
    return perturbed(GPT(MOE).double())


def composed_moe(ctx, config):
    return train_composed(ctx, moe_model().to(ctx.device), config, MOE_DATA, STEPS)


@pytest.mark.parametrize(
    "config",
    [ParallelConfig(dp=2, ep=2), ParallelConfig(ep=2, pp=2, microbatches=2), ParallelConfig(ep=2, cp=2)],
    ids=str,
)
def test_expert_parallelism_composes(config):
    # experts summed over their replicas (dp x cp) and divided by every data rank; dense over (dp, ep, cp)
    per_rank = shared_cluster(4).run(composed_moe, config)
    assert_composition_matches(per_rank, train_one_process(moe_model(), config, MOE_DATA, STEPS), config)


@pytest.mark.parametrize("config", FACTORISATIONS, ids=str)
def test_every_factorisation_of_four_ranks_trains_as_one_process(config):
    per_rank = shared_cluster(4).run(composed, config)
    reference = train_one_process(fresh_model(), config, DATA, STEPS)
    merged = assert_composition_matches(per_rank, reference, config)
    assert len(merged["losses"]) == STEPS and set(merged["weights"]) == set(reference["weights"])


def test_a_wrong_composition_fails_the_check():
    # dp2 x cp2 trained as if the batch were dp4 x ... : the reference of another data split.
    config = ParallelConfig(dp=2, cp=2)
    per_rank = shared_cluster(4).run(composed, config)
    other = train_one_process(fresh_model(), ParallelConfig(dp=4), DATA, STEPS)
    with pytest.raises(AssertionError):
        assert_composition_matches(per_rank, other, config)


def test_rank_to_group_maps_and_data_indices():
    mesh = Mesh(dp=2, pp=2, tp=2)
    assert mesh.group_map() == {
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    }
    assert mesh.groups_table().splitlines()[2] == "tp  [0 1] [2 3] [4 5] [6 7]"
    assert [data_index(mesh, r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    moe = Mesh(dp=2, ep=2)
    assert [data_index(moe, r) for r in range(4)] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    # the loss is read on the last stage, once per tp group
    assert mean_loss([[None], [None], [3.0], [3.0]], Mesh(pp=2, tp=2)) == [3.0]
    assert mean_loss([[1.0], [9.0], [3.0], [9.0]], Mesh(dp=2, tp=2)) == [2.0]
    # HSDP's cut of the data ranks (with cp: they hold the same weights): blocks of consecutive
    # dp coordinates shard, the same place in every block replicates
    assert Mesh(dp=4, tp=2).split_ranks("dp", 2) == ([[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]])
    assert Mesh(dp=2, cp=2).split_ranks(("dp", "cp"), 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])


def test_config_errors():
    with pytest.raises(ValueError, match="sequence parallelism splits the sequence over the tp ranks"):
        ParallelConfig(dp=2, sp=True)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        ParallelConfig(tp=0)
    assert str(ParallelConfig(dp=2, pp=2, tp=2)) == "dp2 x pp2 x tp2"
    assert (
        str(ParallelConfig(dp=4, dp_shard=2)) == "dp4 +hsdp2x2" and ParallelConfig(dp=4, dp_shard=2).dp_replicate == 2
    )
    assert str(ParallelConfig(dp=4, dp_shard=4)) == "dp4 +fsdp"
    with pytest.raises(ValueError, match="dp_shard=3 must divide dp=4"):
        ParallelConfig(dp=4, dp_shard=3)
    with pytest.raises(ValueError, match="both shard the data axis"):
        ParallelConfig(dp=4, dp_shard=2, zero=1)
    with pytest.raises(ValueError, match="pipeline or expert parallelism"):
        ParallelConfig(dp=2, pp=2, dp_shard=2)
    with pytest.raises(ValueError, match="equal blocks"):
        Mesh(dp=4).split_ranks("dp", 3)


def test_a_mesh_that_does_not_cover_the_world_is_refused():
    def wrong(ctx):
        build_mesh(ctx, ParallelConfig(dp=2, pp=2, tp=2))

    with pytest.raises(RankError, match="= 8 ranks, but the cluster has 4"):
        shared_cluster(4).run(wrong)


def test_ep_must_divide_the_experts():
    from dataclasses import dataclass

    from ultrascale.parallel.compose import _check_experts

    @dataclass(frozen=True)
    class MoE(GPTConfig):
        experts: int = 6
        top_k: int = 2

    class Model:
        config = MoE()

    with pytest.raises(ValueError, match="ep=4 does not divide the 6 experts"):
        _check_experts(Model(), 4)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        _check_experts(GPT(CONFIG), 2)
    _check_experts(Model(), 3)


def held(ctx, config):
    from ultrascale.parallel.compose import apply_parallelisms

    par = apply_parallelisms(GPT(CONFIG).to(ctx.device), build_mesh(ctx, config), config)
    return sum(p.numel() for p in dict.fromkeys(par.module.parameters()))


@pytest.mark.parametrize(
    "config",
    [ParallelConfig(pp=2, tp=2, microbatches=2), ParallelConfig(dp=2, tp=2), ParallelConfig(pp=4, microbatches=4)],
    ids=str,
)
def test_rank_parameters_is_what_each_rank_holds(config):
    from ultrascale.model import count_params
    from ultrascale.parallel.compose import rank_parameters

    counts = shared_cluster(4).run(held, config)
    mesh = config.layout()
    for rank, count in enumerate(counts):
        stage = mesh.coordinate(rank).get("pp", 0)
        assert count == rank_parameters(CONFIG, tp=config.tp, pp=config.pp, stage=stage)
    assert rank_parameters(CONFIG) == count_params(CONFIG)
