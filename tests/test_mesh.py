"""The process mesh: pure layout (coordinates, groups, table, picture, errors) and, on
real ranks, its process groups, their caching and their agreement with DeviceMesh."""

import pickle

import pytest
import torch
import torch.distributed as dist

from ultrascale.parallel.mesh import AXES, Mesh, init_mesh
from ultrascale.runtime import RankError, shared_cluster
from ultrascale.viz.mesh import draw_mesh

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

SHAPES = [
    dict(tp=4),
    dict(dp=2, tp=3),  # 6 = 2 x 3
    dict(dp=2, pp=2, tp=2),  # 8 = 2 x 2 x 2
    dict(dp=2, pp=1, cp=1, tp=2),  # axes of size 1
    dict(dp=2, pp=2, cp=2, tp=2),  # four axes
    dict(dp=2, pp=1, ep=2, cp=1, tp=3),  # all five, ep included
    dict(pp=3, ep=2),
]


# ---------------------------------------------------------------- pure layout
@pytest.mark.parametrize("sizes", SHAPES, ids=str)
def test_coordinates_round_trip_and_tp_is_innermost(sizes):
    mesh = Mesh(**sizes)
    assert mesh.world_size == torch.tensor(list(sizes.values())).prod().item()
    coords = [mesh.coordinate(r) for r in range(mesh.world_size)]
    assert len({tuple(c.values()) for c in coords}) == mesh.world_size
    for rank, c in enumerate(coords):
        assert list(c) == [a for a in AXES if a in sizes]
        assert mesh.rank_of(**c) == rank
    inner = mesh.axes[-1]  # the innermost axis varies fastest: neighbours share a group
    assert [c[inner] for c in coords] == [r % sizes[inner] for r in range(mesh.world_size)]


@pytest.mark.parametrize("sizes", SHAPES, ids=str)
def test_group_ranks_partition_the_ranks_along_one_axis(sizes):
    mesh = Mesh(**sizes)
    for axis in mesh.axes:
        groups = mesh.group_ranks(axis)
        assert sorted(r for g in groups for r in g) == list(range(mesh.world_size))
        assert len(groups) == mesh.world_size // sizes[axis]
        for group in groups:
            coords = [mesh.coordinate(r) for r in group]
            assert [c[axis] for c in coords] == list(range(sizes[axis]))
            others = {tuple(v for a, v in c.items() if a != axis) for c in coords}
            assert len(others) == 1  # the members differ only along `axis`


def test_known_layouts():
    m6 = Mesh(dp=2, tp=3)
    assert m6.group_ranks("tp") == [[0, 1, 2], [3, 4, 5]]
    assert m6.group_ranks("dp") == [[0, 3], [1, 4], [2, 5]]
    assert m6.coordinate(4) == {"dp": 1, "tp": 1}
    m8 = Mesh(tp=2, pp=2, dp=2)  # keyword order does not matter: canonical order wins
    assert m8.axes == ("dp", "pp", "tp")
    assert m8.group_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m8.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m8.group_ranks(("pp", "dp")) == m8.group_ranks(("dp", "pp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert m8.rank_of(dp=1, pp=0, tp=1) == 5
    full = Mesh(tp=2, cp=2, ep=2, pp=2, dp=2)
    assert full.axes == AXES and full.world_size == 32


def test_size_one_and_absent_axes():
    mesh = Mesh.from_sizes({"dp": 2, "pp": 1, "cp": 1, "tp": 2})
    assert mesh.group_ranks("pp") == [[0], [1], [2], [3]]
    assert mesh.coordinate(3) == {"dp": 1, "pp": 0, "cp": 0, "tp": 1}
    assert mesh.rank_of(dp=1, tp=1) == 3  # size-1 axes may be left out
    assert mesh.size("ep") == 1 and mesh.size("tp") == 2 and mesh.size(("dp", "tp")) == 4
    with pytest.raises(ValueError, match="'ep' is not an axis"):
        mesh.group_ranks("ep")


def test_ep_is_an_axis_of_the_product_between_pp_and_cp():
    mesh = Mesh(dp=2, ep=2, tp=2)
    assert mesh.world_size == 8 and mesh.axes == ("dp", "ep", "tp")
    assert mesh.group_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # dense layers are replicated along ep: their gradients are averaged over dp x ep
    assert mesh.group_ranks(("dp", "ep")) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_world_size_error_says_what_to_change():
    with pytest.raises(ValueError) as err:
        Mesh(dp=2, tp=3).check_world_size(4)
    assert str(err.value) == ("dp=2 x tp=3 = 6 ranks, but the cluster has 4: choose sizes whose product is 4")
    Mesh(dp=2, tp=2).check_world_size(4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown axis 'mp'"):
        Mesh(mp=2)
    with pytest.raises(ValueError, match="positive integer"):
        Mesh(tp=0)
    mesh = Mesh(dp=2, tp=2)
    with pytest.raises(ValueError, match="needs a coordinate for 'tp'"):
        mesh.rank_of(dp=1)
    with pytest.raises(ValueError, match="tp=2 is outside"):
        mesh.rank_of(dp=0, tp=2)
    with pytest.raises(ValueError, match="not in this mesh"):
        mesh.coordinate(4)
    with pytest.raises(RuntimeError, match="init_mesh"):
        mesh.group("tp")


def test_table_str_and_pickle():
    mesh = Mesh(dp=2, tp=2)
    lines = mesh.table().splitlines()
    assert lines[0].split() == ["rank", "dp", "tp"]
    assert [line.split() for line in lines[1:]] == [["0", "0", "0"], ["1", "0", "1"], ["2", "1", "0"], ["3", "1", "1"]]
    assert str(mesh).startswith("Mesh(dp=2, tp=2): 4 ranks\n")
    assert pickle.loads(pickle.dumps(mesh)).sizes == mesh.sizes


def test_draw_mesh_colours_ranks_by_group():
    mesh = Mesh(dp=2, pp=2, tp=2)
    fig = draw_mesh(mesh, color_by="dp")
    ax = fig.axes[0]
    assert len(ax.patches) == len(ax.texts) == 8
    assert ax.texts[5].get_text() == "rank 5\ndp1 pp0 tp1"
    colour = [tuple(p.get_facecolor()) for p in ax.patches]
    for group in mesh.group_ranks("dp"):
        assert len({colour[r] for r in group}) == 1
    assert len(set(colour)) == 4


# ---------------------------------------------------------------- on the ranks
def reduce_along(ctx, sizes, joint):
    """Sum 2**rank over each group: the bits of the sum say exactly who took part."""
    mesh = init_mesh(ctx, joint=joint, **sizes)
    out = {}
    for axes in [(a,) for a in mesh.axes] + [tuple(j) for j in joint]:
        x = torch.tensor([2.0**ctx.rank], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(x, group=mesh.group(axes))
        out[axes] = (int(x.item()), mesh.rank_in(axes), dist.get_process_group_ranks(mesh.group(axes)))
    return out


def count_new_groups(ctx, sizes):
    """Build (or find) the mesh, counting ctx.new_group and dist.new_group calls."""
    calls = {"ctx": 0, "dist": 0}
    ctx_new_group, dist_new_group = ctx.new_group, dist.new_group

    def counting_ctx(ranks):
        calls["ctx"] += 1
        return ctx_new_group(ranks)

    def counting_dist(*args, **kwargs):
        calls["dist"] += 1
        return dist_new_group(*args, **kwargs)

    ctx.new_group, dist.new_group = counting_ctx, counting_dist
    try:
        mesh = init_mesh(ctx, **sizes)
    finally:
        del ctx.new_group  # back to the method
        dist.new_group = dist_new_group
    return calls, id(mesh), [id(mesh.group(a)) for a in mesh.axes]


def device_mesh_agrees(ctx, sizes):
    mesh = init_mesh(ctx, **sizes)
    dm = mesh.to_device_mesh()
    assert mesh.to_device_mesh() is dm  # kept, not rebuilt
    return {
        "names": dm.mesh_dim_names,
        "grid": (dm.mesh.tolist(), mesh.grid().tolist()),
        "coordinate": (list(dm.get_coordinate()), list(mesh.coordinate(ctx.rank).values())),
        "groups": {
            a: (dist.get_process_group_ranks(dm[a].get_group()), dist.get_process_group_ranks(mesh.group(a)))
            for a in mesh.axes
        },
    }


def wrong_sizes(ctx):
    init_mesh(ctx, dp=2, tp=3)


WORLDS = {2: (dict(dp=1, tp=2), []), 3: (dict(pp=1, tp=3), []), 4: (dict(dp=2, tp=2), [("dp", "tp")])}


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda w: f"world{w}")
def world(request):
    return shared_cluster(request.param), *WORLDS[request.param]


def test_all_reduce_over_a_group_sums_exactly_its_ranks(world):
    cluster, sizes, joint = world
    mesh = Mesh(**sizes)
    for rank, out in enumerate(cluster.run(reduce_along, sizes, joint)):
        for axes, (total, rank_in, members) in out.items():
            expected = next(g for g in mesh.group_ranks(axes) if rank in g)
            assert members == expected
            assert total == sum(2**r for r in expected)
            assert rank_in == expected.index(rank)


def test_device_mesh_has_the_same_layout_and_groups(world):
    cluster, sizes, _ = world
    for out in cluster.run(device_mesh_agrees, sizes):
        assert out["names"] == tuple(sizes)
        assert out["grid"][0] == out["grid"][1]
        assert out["coordinate"][0] == out["coordinate"][1]
        for axis, (theirs, ours) in out["groups"].items():
            assert theirs == ours, axis


def test_groups_are_built_once_per_rank_and_reused():
    cluster = shared_cluster(4)
    sizes = dict(dp=2, pp=1, tp=2)  # named pp: a cache key no other test uses
    first = cluster.run(count_new_groups, sizes)
    second = cluster.run(count_new_groups, sizes)
    mesh = Mesh(**sizes)
    n_groups = sum(len(mesh.group_ranks(a)) for a in mesh.axes)  # every group, on every rank
    for (calls1, mesh1, groups1), (calls2, mesh2, groups2) in zip(first, second):
        assert calls1["ctx"] == n_groups and calls1["dist"] <= n_groups
        assert calls2 == {"ctx": 0, "dist": 0}
        assert (mesh1, groups1) == (mesh2, groups2)


def test_wrong_sizes_fail_on_the_ranks_with_the_same_message():
    cluster = shared_cluster(4)
    with pytest.raises(RankError, match="choose sizes whose product is 4"):
        cluster.run(wrong_sizes)
    assert cluster.run(lambda ctx: ctx.rank) == [0, 1, 2, 3]  # still usable
