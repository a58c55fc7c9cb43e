"""mesh_figure: one square per rank, placed by coordinates, coloured by MeshLayout groups (tier 1)."""
from __future__ import annotations

import pytest

import colab_kit as ck
from colab_kit.viz.mesh import PALETTE, cell_positions, mesh_figure

CONFIGS = [
    ck.ParallelConfig(dp=4),
    ck.ParallelConfig(dp=2, tp=2),
    ck.ParallelConfig(pp=2, dp=2, tp=2),
    ck.ParallelConfig(pp=2, sp=2, tp=2),
    ck.ParallelConfig(dp=2, tp=4, tp_mode="2d"),
    ck.ParallelConfig(tp=8, tp_mode="2.5d", tp_depth=2),
    ck.ParallelConfig(dp=2, tp=8, tp_mode="3d"),
    ck.ParallelConfig(pp=2, dp=3, sp=2, tp=4, tp_mode="2d"),
]


def _axes(cfg):
    return ck.MeshLayout(cfg).axes


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.describe())
def test_every_axis_colours_the_layout_groups(cfg):
    layout = ck.MeshLayout(cfg)
    pos = cell_positions(layout)
    assert len(set(pos.values())) == cfg.world_size  # no two ranks share a square
    for axis in _axes(cfg):
        fig = mesh_figure(cfg, axis=axis)
        groups = layout.groups(axis)
        assert [list(t.customdata) for t in fig.data] == groups
        colour_of = {}
        for i, (trace, group) in enumerate(zip(fig.data, groups)):
            assert trace.marker.color == PALETTE[i % len(PALETTE)]
            assert trace.name == f"{axis} group {i}: ranks {', '.join(map(str, group))}"
            for r, x, y, text, hover in zip(group, trace.x, trace.y, trace.text, trace.hovertext):
                colour_of[r] = trace.marker.color
                assert (x, y) == pos[r]
                assert text.startswith(f"<b>{r}</b>")
                coords = layout.all_coords(r)
                assert hover == f"rank {r}<br>" + ", ".join(f"{a} {v}" for a, v in coords.items())
        assert sorted(colour_of) == list(range(cfg.world_size))
        shapes = {s.name: s for s in fig.layout.shapes}
        for r in range(cfg.world_size):  # the square is filled with its group's colour, centred on it
            s = shapes[f"rank {r}"]
            assert s.fillcolor == colour_of[r]
            assert ((s.x0 + s.x1) / 2, (s.y0 + s.y1) / 2) == pytest.approx(pos[r])
        if len(groups) <= len(PALETTE):
            assert len({t.marker.color for t in fig.data}) == len(groups)


def test_placement_follows_the_coordinates():
    cfg = ck.ParallelConfig(pp=2, dp=2, tp=4, tp_mode="2d")
    pos = cell_positions(ck.MeshLayout(cfg))
    lay = ck.MeshLayout(cfg)
    for r in range(cfg.world_size):
        c = lay.all_coords(r)
        for s in range(cfg.world_size):
            d = lay.all_coords(s)
            if c["pp"] < d["pp"]:
                assert pos[r][0] < pos[s][0]  # pipeline stages left to right
            if c["dp"] < d["dp"]:
                assert pos[r][1] < pos[s][1]  # replicas top to bottom
            if (c["pp"], c["dp"]) == (d["pp"], d["dp"]):  # one tensor block: a 2 x 2 grid
                assert (pos[s][0] - pos[r][0], pos[s][1] - pos[r][1]) == (d["tp_col"] - c["tp_col"],
                                                                          d["tp_row"] - c["tp_row"])
    # 2.5d: depth layers side by side, each a q x q grid
    lay = ck.MeshLayout(ck.ParallelConfig(tp=8, tp_mode="2.5d", tp_depth=2))
    pos = cell_positions(lay)
    assert pos[0] == (0, 0) and pos[3] == (1, 1) and pos[4][0] > pos[1][0] and pos[4][1] == 0


def test_title_and_block_labels():
    fig = mesh_figure(ck.ParallelConfig(pp=2, dp=2, tp=2), axis="dp")
    assert fig.layout.title.text.startswith("dp=2 x pp=2 x tp=2 (1d) = 8 ranks: coloured by dp group (4 groups of 2)")
    labels = sorted(a.text for a in fig.layout.annotations)
    assert labels == ["dp 0", "dp 1", "pp stage 0", "pp stage 1"]
    assert mesh_figure(ck.MeshLayout(ck.ParallelConfig(tp=2))).layout.annotations == ()


def test_unknown_axis_names_the_axes_of_the_mesh():
    with pytest.raises(ValueError, match="unknown axis 'tp_row' for tp_mode='1d': this mesh has axes pp, dp, sp, tp"):
        mesh_figure(ck.ParallelConfig(dp=2), axis="tp_row")


def test_a_mesh_too_large_to_draw_is_refused_naming_a_smaller_one_with_the_same_groups():
    """4,096 ranks took the browser 44 s to draw, one unreadable square each: refused, naming the same degrees
    with dp and pp of 2 (each replica and stage repeats the same groups); 1,024 still draw."""
    import colab_kit as ck
    from colab_kit.viz.mesh import MAX_DRAWN, mesh_figure

    with pytest.raises(ValueError, match=r"dp=64 x pp=8 x tp=8 \(1d\) = 4096 ranks: more ranks than the 1024 a mesh "
                                         r"figure draws .*: draw dp=2 x pp=2 x tp=8 \(1d\) = 32 ranks instead"):
        mesh_figure(ck.ParallelConfig(dp=64, pp=8, tp=8))
    assert MAX_DRAWN == 1024 and len(mesh_figure(ck.ParallelConfig(dp=128, tp=8)).layout.shapes) == 1024
