"""Tier 1: MeshLayout arithmetic checked by hand, and ProcessMesh's real groups on the fake backend.

The expected coordinates and groups below are written out literally (worked out on paper from
``rank = ((pp_i*dp + dp_i)*sp + sp_i)*tp + tp_i`` and the sub-axis table in mesh.py), not
recomputed with the library's own grid, so a change of layout shows up here.
"""
from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

import colab_kit as ck
from colab_kit.config import ConfigError, ParallelConfig
from colab_kit.mesh import MeshLayout, ProcessMesh, tp_sub_axes

P = ParallelConfig


# --------------------------------------------------------------------------- dp=2, pp=2, tp=2 by hand
DP2_PP2_TP2_COORDS = [  # rank: (pp, dp, sp, tp)
    (0, 0, 0, 0),
    (0, 0, 0, 1),
    (0, 1, 0, 0),
    (0, 1, 0, 1),
    (1, 0, 0, 0),
    (1, 0, 0, 1),
    (1, 1, 0, 0),
    (1, 1, 0, 1),
]
DP2_PP2_TP2_GROUPS = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "sp": [[0], [1], [2], [3], [4], [5], [6], [7]],
}


def test_dp2_pp2_tp2_coordinates_by_hand():
    lay = MeshLayout(P(dp=2, pp=2, tp=2))
    assert lay.world_size == 8
    assert lay.axes == ("pp", "dp", "sp", "tp")
    for rank, (pp, dp, sp, tp) in enumerate(DP2_PP2_TP2_COORDS):
        assert lay.coords(rank) == {"pp": pp, "dp": dp, "sp": sp, "tp": tp}
        assert list(lay.coords(rank)) == ["pp", "dp", "sp", "tp"]
        assert lay.rank_of(pp=pp, dp=dp, sp=sp, tp=tp) == rank
        assert lay.sub_coords(rank) == {}
        assert lay.all_coords(rank) == lay.coords(rank)


def test_dp2_pp2_tp2_groups_by_hand():
    lay = MeshLayout(P(dp=2, pp=2, tp=2))
    for axis, groups in DP2_PP2_TP2_GROUPS.items():
        assert lay.groups(axis) == groups, axis
        assert lay.size(axis) == len(groups[0])
    # the worked example in the module docstring: what rank 5 sees
    assert lay.group_of(5, "tp") == [4, 5]
    assert lay.group_of(5, "dp") == [5, 7]
    assert lay.group_of(5, "pp") == [1, 5]
    assert lay.group_of(5, "sp") == [5]


def test_rank_of_defaults_missing_axes_to_zero():
    lay = MeshLayout(P(dp=2, pp=2, tp=2))
    assert lay.rank_of() == 0
    assert lay.rank_of(pp=1) == 4
    assert lay.rank_of(dp=1, tp=1) == 3


def test_dp2_sp2_tp2_by_hand():
    lay = MeshLayout(P(dp=2, sp=2, tp=2))
    assert [tuple(lay.coords(r).values()) for r in range(8)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1),
        (0, 1, 0, 0), (0, 1, 0, 1), (0, 1, 1, 0), (0, 1, 1, 1),
    ]
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("sp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("pp") == [[r] for r in range(8)]


def test_pp3_dp2_by_hand():
    lay = MeshLayout(P(pp=3, dp=2))
    assert lay.groups("pp") == [[0, 2, 4], [1, 3, 5]]
    assert lay.groups("dp") == [[0, 1], [2, 3], [4, 5]]
    assert lay.coords(5) == {"pp": 2, "dp": 1, "sp": 0, "tp": 0}


def test_table_has_one_row_per_rank():
    lay = MeshLayout(P(dp=2, tp=4, tp_mode="2d"))
    rows = lay.table()
    assert [r["rank"] for r in rows] == list(range(8))
    assert rows[7] == {"rank": 7, "pp": 0, "dp": 1, "sp": 0, "tp": 3, "tp_row": 1, "tp_col": 1}


# --------------------------------------------------------------------------- rank formula over a grid
SHAPES = list(itertools.product([1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 3]))  # (pp, dp, sp, tp)


@pytest.mark.parametrize("pp, dp, sp, tp", SHAPES)
def test_rank_formula_and_groups_over_a_grid(pp, dp, sp, tp):
    lay = MeshLayout(P(pp=pp, dp=dp, sp=sp, tp=tp))
    sizes = {"pp": pp, "dp": dp, "sp": sp, "tp": tp}
    world = pp * dp * sp * tp
    coords = {}
    for rank in range(world):
        c = lay.coords(rank)
        assert ((c["pp"] * dp + c["dp"]) * sp + c["sp"]) * tp + c["tp"] == rank
        assert all(0 <= c[a] < sizes[a] for a in sizes)
        assert lay.rank_of(**c) == rank
        coords[rank] = c
    assert len({tuple(c.values()) for c in coords.values()}) == world  # a bijection
    for axis in sizes:
        # brute force: the ranks that agree with r on every other axis, ordered by the axis coordinate
        others = [a for a in sizes if a != axis]
        expected = {}
        for r, c in coords.items():
            key = tuple(c[a] for a in others)
            expected.setdefault(key, []).append(r)
        want = sorted((sorted(g, key=lambda r: coords[r][axis]) for g in expected.values()), key=lambda g: g[0])
        got = lay.groups(axis)
        assert sorted(got, key=lambda g: g[0]) == want
        assert len(got) == world // sizes[axis]
        for g in got:
            assert [coords[r][axis] for r in g] == list(range(sizes[axis]))
        for r in range(world):
            assert lay.group_of(r, axis)[coords[r][axis]] == r


# --------------------------------------------------------------------------- tensor sub-axes by hand
def test_2d_tp4_by_hand():
    lay = MeshLayout(P(tp=4, tp_mode="2d"))
    assert lay.axes == ("pp", "dp", "sp", "tp", "tp_row", "tp_col")
    assert tp_sub_axes(lay.config) == {"tp_row": 2, "tp_col": 2}
    assert [lay.sub_coords(r) for r in range(4)] == [
        {"tp_row": 0, "tp_col": 0},
        {"tp_row": 0, "tp_col": 1},
        {"tp_row": 1, "tp_col": 0},
        {"tp_row": 1, "tp_col": 1},
    ]
    assert lay.groups("tp_col") == [[0, 1], [2, 3]]   # same grid row, differing column
    assert lay.groups("tp_row") == [[0, 2], [1, 3]]   # same grid column, differing row
    assert lay.groups("tp") == [[0, 1, 2, 3]]
    assert lay.size("tp_row") == lay.size("tp_col") == 2
    assert lay.all_coords(3) == {"pp": 0, "dp": 0, "sp": 0, "tp": 3, "tp_row": 1, "tp_col": 1}


def test_2d_tp9_by_hand():
    lay = MeshLayout(P(tp=9, tp_mode="2d"))
    assert lay.groups("tp_col") == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert lay.groups("tp_row") == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert lay.sub_coords(5) == {"tp_row": 1, "tp_col": 2}
    assert lay.sub_coords(6) == {"tp_row": 2, "tp_col": 0}


def test_2d_tp4_with_dp2_by_hand():
    lay = MeshLayout(P(dp=2, tp=4, tp_mode="2d"))
    assert lay.groups("tp_col") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("tp_row") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.sub_coords(6) == {"tp_row": 1, "tp_col": 0}
    assert lay.coords(6) == {"pp": 0, "dp": 1, "sp": 0, "tp": 2}


def test_2_5d_tp8_depth2_by_hand():
    lay = MeshLayout(P(tp=8, tp_mode="2.5d", tp_depth=2))
    assert lay.axes == ("pp", "dp", "sp", "tp", "tp_dep", "tp_row", "tp_col")
    assert tp_sub_axes(lay.config) == {"tp_dep": 2, "tp_row": 2, "tp_col": 2}
    assert [tuple(lay.sub_coords(r).values()) for r in range(8)] == [  # (dep, row, col)
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
        (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]
    assert list(lay.sub_coords(0)) == ["tp_dep", "tp_row", "tp_col"]
    assert lay.groups("tp_dep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("tp_row") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("tp_col") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_2_5d_tp18_depth2_by_hand():
    lay = MeshLayout(P(tp=18, tp_mode="2.5d", tp_depth=2))  # q = 3: two 3x3 layers
    assert lay.groups("tp_dep")[:3] == [[0, 9], [1, 10], [2, 11]]
    assert lay.groups("tp_row")[:4] == [[0, 3, 6], [1, 4, 7], [2, 5, 8], [9, 12, 15]]
    assert lay.groups("tp_col")[3:] == [[9, 10, 11], [12, 13, 14], [15, 16, 17]]
    assert lay.sub_coords(14) == {"tp_dep": 1, "tp_row": 1, "tp_col": 2}


def test_3d_tp8_by_hand():
    lay = MeshLayout(P(tp=8, tp_mode="3d"))
    assert lay.axes == ("pp", "dp", "sp", "tp", "tp_in", "tp_wt", "tp_out")
    assert [tuple(lay.sub_coords(r).values()) for r in range(8)] == [  # (in, wt, out)
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
        (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]
    assert lay.groups("tp_in") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("tp_wt") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("tp_out") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_3d_tp8_with_dp2_by_hand():
    lay = MeshLayout(P(dp=2, tp=8, tp_mode="3d"))
    assert lay.world_size == 16
    assert lay.groups("tp_in") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert lay.groups("tp_wt") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.groups("tp_out") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lay.groups("tp") == [list(range(8)), list(range(8, 16))]
    assert lay.groups("dp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert lay.all_coords(13) == {"pp": 0, "dp": 1, "sp": 0, "tp": 5, "tp_in": 1, "tp_wt": 0, "tp_out": 1}


def test_3d_tp27_by_hand():
    lay = MeshLayout(P(tp=27, tp_mode="3d"))
    assert lay.sub_coords(14) == {"tp_in": 1, "tp_wt": 1, "tp_out": 2}  # 14 = 9*1 + 3*1 + 2
    assert lay.group_of(14, "tp_in") == [5, 14, 23]
    assert lay.group_of(14, "tp_wt") == [11, 14, 17]
    assert lay.group_of(14, "tp_out") == [12, 13, 14]


SUB_CONFIGS = [
    dict(tp=4, tp_mode="2d"), dict(tp=9, tp_mode="2d", dp=2), dict(tp=4, tp_mode="2d", pp=2, sp=2),
    dict(tp=8, tp_mode="2.5d", tp_depth=2), dict(tp=12, tp_mode="2.5d", tp_depth=3, dp=2),
    dict(tp=18, tp_mode="2.5d", tp_depth=2), dict(tp=8, tp_mode="3d", pp=2), dict(tp=27, tp_mode="3d"),
]


@pytest.mark.parametrize("kwargs", SUB_CONFIGS)
def test_sub_axis_formula_over_configs(kwargs):
    cfg = P(**kwargs)
    lay = MeshLayout(cfg)
    q, d = cfg.tp_q, cfg.tp_depth
    for rank in range(cfg.world_size):
        s, tp_i = lay.sub_coords(rank), lay.coords(rank)["tp"]
        if cfg.tp_mode == "2d":
            assert s["tp_row"] * q + s["tp_col"] == tp_i
        elif cfg.tp_mode == "2.5d":
            assert (s["tp_dep"] * q + s["tp_row"]) * q + s["tp_col"] == tp_i
            assert s["tp_dep"] < d
        else:
            assert (s["tp_in"] * q + s["tp_wt"]) * q + s["tp_out"] == tp_i
        for sub in s:  # a sub-axis group stays inside the rank's tp group
            assert set(lay.group_of(rank, sub)) <= set(lay.group_of(rank, "tp"))
            assert [lay.sub_coords(r)[sub] for r in lay.group_of(rank, sub)] == list(range(lay.size(sub)))


# --------------------------------------------------------------------------- errors
def test_unknown_axis():
    lay = MeshLayout(P(tp=4))
    with pytest.raises(ValueError) as info:
        lay.groups("tp_row")
    assert str(info.value) == "unknown axis 'tp_row' for tp_mode='1d': this mesh has axes pp, dp, sp, tp"
    with pytest.raises(ValueError, match="unknown axis 'tp_in' for tp_mode='2d'"):
        MeshLayout(P(tp=4, tp_mode="2d")).groups("tp_in")
    with pytest.raises(ValueError, match="unknown axis 'data'"):
        lay.size("data")
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        lay.group_of(0, "xp")


@pytest.mark.parametrize("rank", [-1, 8, 100])
def test_rank_out_of_range(rank):
    lay = MeshLayout(P(dp=2, tp=4))
    for call in (lay.coords, lay.sub_coords, lay.all_coords):
        with pytest.raises(ValueError) as info:
            call(rank)
        assert str(info.value) == f"rank {rank} is outside this mesh of 8 ranks (0..7)"


def test_rank_of_refuses_bad_coordinates():
    lay = MeshLayout(P(dp=2, tp=4, tp_mode="2d"))
    with pytest.raises(ValueError, match="tp=4 is outside the tp axis of size 4"):
        lay.rank_of(tp=4)
    with pytest.raises(ValueError, match="dp=-1 is outside the dp axis of size 2"):
        lay.rank_of(dp=-1)  # would silently wrap to the last dp index otherwise
    with pytest.raises(ValueError, match="unknown axis 'tp_row'"):
        lay.rank_of(tp_row=1)  # sub-axes are not silently ignored


def test_repr():
    assert repr(MeshLayout(P(dp=2, tp=4, tp_mode="2d"))) == \
        "MeshLayout(dp=2 x tp=4 (2d) = 8 ranks, axes=('pp', 'dp', 'sp', 'tp', 'tp_row', 'tp_col'))"


# --------------------------------------------------------------------------- ProcessMesh on the fake backend
@pytest.fixture
def fake_world():
    """``fake_world(rank, world_size)`` initialises a fake process group in this process."""
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank, world_size):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


PROCESS_MESH_CONFIGS = [
    dict(dp=2, pp=2, tp=2),
    dict(dp=2, sp=2, tp=2),
    dict(dp=2, tp=4, tp_mode="2d"),
    dict(tp=8, tp_mode="2.5d", tp_depth=2),
    dict(pp=2, tp=4, tp_mode="2d"),
    dict(dp=2, tp=8, tp_mode="3d"),
    dict(tp=9, tp_mode="2d"),
    dict(dp=3),
    dict(dp=2, sp=2, pp=2),
    dict(sp=4),
    dict(dp=4, sp=2, ep=2),
]


@pytest.mark.parametrize("kwargs", PROCESS_MESH_CONFIGS, ids=lambda k: P(**k).describe())
def test_process_mesh_groups_match_layout(fake_world, kwargs):
    cfg = P(**kwargs)
    lay = MeshLayout(cfg)
    for rank in range(cfg.world_size):
        fake_world(rank, cfg.world_size)
        mesh = ProcessMesh(cfg)
        assert mesh.global_rank == rank
        assert mesh.device.type == "cpu"
        assert mesh.coords() == lay.all_coords(rank)
        assert mesh.log.records == []
        for axis in lay.axes + ("dp_sp",):  # dp_sp: the dp x sp block flattened (dp's or sp's groups where one is 1)
            ranks = dist.get_process_group_ranks(mesh.group(axis))
            assert ranks == lay.group_of(rank, axis), (rank, axis)
            assert mesh.ranks(axis) == ranks
            assert mesh.size(axis) == len(ranks) == lay.size(axis)
            assert mesh.rank(axis) == ranks.index(rank) == dist.get_rank(mesh.group(axis))
        dist.destroy_process_group()


def test_process_mesh_sub_axes_by_hand(fake_world):
    cfg = P(dp=2, tp=8, tp_mode="2.5d", tp_depth=2)
    fake_world(13, 16)  # tp block 8..15, tp_i = 5 = (dep 1, row 0, col 1)
    mesh = ProcessMesh(cfg)
    assert {a: dist.get_process_group_ranks(mesh.group(a)) for a in mesh.layout.axes} == {
        "pp": [13], "dp": [5, 13], "sp": [13], "tp": list(range(8, 16)),
        "tp_dep": [9, 13], "tp_row": [13, 15], "tp_col": [12, 13],
    }
    assert {a: mesh.rank(a) for a in ("dp", "tp", "tp_dep", "tp_row", "tp_col")} == \
        {"dp": 1, "tp": 5, "tp_dep": 1, "tp_row": 0, "tp_col": 1}


def test_two_meshes_in_one_process(fake_world):
    fake_world(3, 4)
    a = ProcessMesh(P(dp=4))
    b = ProcessMesh(P(tp=4, tp_mode="2d"))
    assert dist.get_process_group_ranks(a.group("dp")) == [0, 1, 2, 3]
    assert dist.get_process_group_ranks(a.group("tp")) == [3]
    assert dist.get_process_group_ranks(b.group("tp_row")) == [1, 3]
    assert dist.get_process_group_ranks(b.group("tp_col")) == [2, 3]
    assert a.log is not b.log
    assert "rank 3" in repr(b) and "tp=4 (2d)" in repr(b)


def test_process_mesh_errors(fake_world):
    if dist.is_initialized():
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialised"):
        ProcessMesh(P())
    fake_world(0, 4)
    with pytest.raises(ConfigError, match="needs dp\\*pp\\*sp\\*tp = 2\\*1\\*1\\*1 = 2 ranks, but there are 4: try dp=4"):
        ProcessMesh(P(dp=2))
    mesh = ProcessMesh(P(dp=4))
    with pytest.raises(ValueError, match="unknown axis 'tp_row'"):
        mesh.group("tp_row")
    with pytest.raises(ValueError, match="unknown axis 'tp_row'"):
        mesh.rank("tp_row")


def test_exported_names():
    assert ck.MeshLayout is MeshLayout and ck.ProcessMesh is ProcessMesh


def test_dp_sp_flattens_the_dp_x_sp_block_by_hand():
    lay = MeshLayout(P(dp=2, sp=2, tp=2))
    assert lay.groups("dp_sp") == [[0, 2, 4, 6], [1, 3, 5, 7]] and lay.size("dp_sp") == 4
    assert MeshLayout(P(dp=2, pp=2)).groups("dp_sp") == MeshLayout(P(dp=2, pp=2)).groups("dp")
    assert MeshLayout(P(sp=2, tp=2)).groups("dp_sp") == MeshLayout(P(sp=2, tp=2)).groups("sp")
