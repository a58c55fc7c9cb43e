"""The MoE views' pure parts (tier 1): the records shaped per layer, the cell's MoE line, the load and traffic
heatmaps, the mesh drawn with its expert groups, and the config picker's ep control."""
from __future__ import annotations

import pytest

import colab_kit as ck
from colab_kit.notebook.magics.training import format_moe
from colab_kit.notebook.widgets import ConfigPicker
from colab_kit.observe.moe import busiest, loads_by_layer, moe_summary
from colab_kit.viz.mesh import PALETTE, cell_positions, expert_mesh_figure
from colab_kit.viz.moe import expert_load_figure, moe_traffic_figure


def _layer(n, counts, dropped=0, balance=1.0, z=2.0, sent=None):
    rec = {"layer": n, "counts": counts, "mine": counts, "dropped": dropped, "balance": balance, "z": z}
    return rec if sent is None else {**rec, "sent": sent, "received": sent}


RECORDS = [  # two steps of two MoE layers (1 and 3) of 4 experts, top-2 over 16 tokens, ep=2
    {"step": 5, "loss": 3.0, "moe": [_layer(1, [14, 6, 6, 6], 4, 1.2, 3.0, [100, 300]),
                                     _layer(3, [8, 8, 8, 8], 0, 1.0, 2.0, [200, 200])]},
    {"step": 6, "loss": 2.9, "moe": [_layer(1, [10, 8, 7, 7], 1, 1.05, 2.8, [150, 250]),
                                     _layer(3, [16, 16, 0, 0], 2, 1.5, 2.2, [0, 400])]},
]


def test_loads_are_the_records_counts_per_layer_and_step():
    assert loads_by_layer(RECORDS) == {1: {"steps": [5, 6], "counts": [[14, 6, 6, 6], [10, 8, 7, 7]],
                                           "dropped": [4, 1]},
                                       3: {"steps": [5, 6], "counts": [[8, 8, 8, 8], [16, 16, 0, 0]],
                                           "dropped": [0, 2]}}
    assert loads_by_layer([{"step": 1, "loss": 2.0}]) == {}  # a dense engine's records
    assert busiest([8, 8, 8, 8]) == 1.0 and busiest([32, 0, 0, 0]) == 4.0 and busiest([0, 0]) == 1.0


def test_the_summary_reads_first_and_last_step_and_sums_drops_and_bytes():
    s = moe_summary(RECORDS, ep_rank=0)
    assert s == {"layers": 2, "busiest_first": 1.75, "busiest_last": 2.0, "dropped": 7, "assigned": 128,
                 "balance_first": 1.1, "balance_last": 1.275, "z_first": 2.5, "z_last": 2.5,
                 "sent": (800 + 800) / 2, "sent_off": (500 + 650) / 2}
    assert moe_summary(RECORDS, ep_rank=1)["sent_off"] == (300 + 150) / 2  # what left rank 1
    no_ep = [{**r, "moe": [{k: v for k, v in m.items() if k not in ("sent", "received")} for m in r["moe"]]}
             for r in RECORDS]
    assert moe_summary(no_ep)["sent"] is None and moe_summary([{"step": 1, "loss": 2.0}]) is None


def test_the_moe_line_says_what_the_summary_holds():
    s = moe_summary(RECORDS, ep_rank=0)
    line = format_moe(s)
    assert line == ("moe (2 layers): busiest expert 1.75x -> 2.00x the mean · dropped 5.5% of 128 assignments · "
                    "balance 1.1 -> 1.275 · z 2.5 · rank 0 dispatched 800 B/step, 575 B to other ranks")
    one = format_moe({**s, "layers": 1, "dropped": 0, "sent": None, "stage_only": True})
    assert one.startswith("moe (1 layer on rank 0's stage): ") and "nothing dropped" in one
    assert "dispatched" not in one


def test_a_first_stage_without_moe_layers_says_so():
    """Under pp rank 0's records can hold no MoE layer (its stage has none): the line says where they are
    rather than print nothing; a dense engine (no "moe" in its records) still prints no MoE line."""
    from types import SimpleNamespace

    from colab_kit.notebook.magics.training import _moe
    eng = SimpleNamespace(config=ck.ParallelConfig(dp=2, pp=2, ep=2))
    assert _moe(eng, [{"step": 1, "loss": 2.0, "moe": []}]) == {"elsewhere": 2}
    assert format_moe({"elsewhere": 2}).startswith("moe: no MoE layer on rank 0's stage (pp=2)")
    assert _moe(SimpleNamespace(config=ck.ParallelConfig(dp=2)), [{"step": 1, "loss": 2.0}]) is None


def test_the_load_heatmap_carries_the_recorded_counts():
    loads = loads_by_layer(RECORDS)
    fig = expert_load_figure(loads)
    (hm,) = fig.data
    assert list(hm.x) == [5, 6] and list(hm.y) == [f"layer {n} · expert {e}" for n in (1, 3) for e in range(4)]
    assert [list(r) for r in hm.customdata] == [[14, 10], [6, 8], [6, 7], [6, 7], [8, 16], [8, 16], [8, 0], [8, 0]]
    assert [list(r) for r in hm.z][0] == [1.75, 1.25] and [list(r) for r in hm.z][4] == [1.0, 2.0]
    assert "recorded" in fig.layout.title.text and "2 MoE layers" in fig.layout.title.text and hm.zmid == 1.0
    one = expert_load_figure(loads, layer=3).data[0]
    assert list(one.y) == [f"layer 3 · expert {e}" for e in range(4)] and list(one.customdata[2]) == [8, 0]
    with pytest.raises(ck.ConfigError, match="layer=2 has no MoE records: the recorded MoE layers are 1, 3"):
        expert_load_figure(loads, layer=2)
    with pytest.raises(ck.ConfigError, match="no MoE records to draw"):
        expert_load_figure({})
    with pytest.raises(ck.ConfigError, match="different numbers of experts"):
        expert_load_figure({0: {"steps": [1, 2], "counts": [[1, 2], [1, 2, 3]], "dropped": [0, 0]}})


def test_the_traffic_heatmap_is_the_matrix_given():
    matrix = [[2816, 1792], [1920, 0]]
    fig = moe_traffic_figure(matrix, step=3, layer=1)
    (hm,) = fig.data
    assert [list(r) for r in hm.z] == matrix and list(hm.y) == ["from rank 0", "from rank 1"]
    assert [list(r) for r in hm.text] == [["2.8 KiB", "1.8 KiB"], ["1.9 KiB", ""]]
    assert fig.layout.title.text == "Dispatch bytes, rank to rank (step 3, layer 1; recorded)"
    with pytest.raises(ck.ConfigError, match="must be square"):
        moe_traffic_figure([[1, 2]])
    with pytest.raises(ck.ConfigError, match="recorded with expert parallelism"):
        moe_traffic_figure([[0, 0], [0, 0]])


@pytest.mark.parametrize("cfg", [ck.ParallelConfig(dp=4, ep=2), ck.ParallelConfig(dp=2, tp=2, ep=2),
                                 ck.ParallelConfig(dp=2, sp=2, pp=2, ep=4)], ids=lambda c: c.describe())
def test_the_expert_mesh_draws_the_layout_groups_side_by_side(cfg):
    lay = ck.MeshLayout(cfg)
    dense = "tp" if cfg.tp > 1 else "dp"
    fig = expert_mesh_figure(cfg, dense=dense)
    want = [(axis, g) for axis in (dense, "ep", "edp") for g in lay.groups(axis)]
    assert [(t.name.split()[0], list(t.customdata)) for t in fig.data] == want
    pos = cell_positions(lay)
    panels = {}
    for t in fig.data:  # each panel is the mesh drawing, shifted right
        axis = t.name.split()[0]
        i = int(t.name.split()[2].rstrip(":"))
        assert t.marker.color == PALETTE[i % len(PALETTE)]
        for r, x, y in zip(t.customdata, t.x, t.y):
            panels.setdefault(axis, set()).add(round(x - pos[r][0], 6))
            assert y == pos[r][1]
    assert all(len(v) == 1 for v in panels.values()) and len({v.pop() for v in panels.values()}) == 3
    assert len(fig.layout.shapes) == 3 * cfg.world_size and "expert groups" in fig.layout.title.text
    with pytest.raises(ck.ConfigError, match="does not split the experts"):
        expert_mesh_figure(ck.ParallelConfig(dp=4))


def test_the_picker_has_an_ep_control_checked_by_parallel_config():
    p = ConfigPicker(world_size=4)
    assert p.ep_choices() == [1, 2, 4]
    assert p.set(ep=3).startswith("not valid: ep=3 splits the experts over ranks that already split the batch "
                                  "(dp x sp = 4 x 1 = 4), so it must divide dp x sp: try ep=1, 2 or 4")
    assert p.set(ep=2) == "ok: dp=4 = 4 ranks, ep=2 fits the 4 ranks"
    assert [t.name.split()[0] for t in p.figure().data] == ["dp", "ep", "ep", "edp", "edp"]
    assert "ep groups [0, 1] [2, 3]" in repr(p) and "edp groups [0, 2] [1, 3]" in repr(p)
    assert p.set(dp=2, tp=2).startswith("ok: dp=2 x tp=2 (1d) = 4 ranks, ep=2") and p.ep_choices() == [1, 2]
    assert p.set(zero=3).startswith("ok: dp=2 x tp=2 (1d) = 4 ranks, ep=2, zero=3")  # ZeRO-3 with ep runs
    assert p.set(tp=1, pp=2, zero=3).startswith("valid, not runnable yet: ") and "ZeRO stage 3" in p.status()
    p.set(tp=2, pp=1, zero=0)
    p.widget()
    ui = p._ui
    assert "ep" in ui and "1, 2" in ui["ep_hint"].value
    ui["dp"].value = 4  # typed: dp x sp = 4 now, so ep=2 fits again... with tp=2 that needs 8 ranks
    assert "not valid" in ui["status"].value and "1, 2, 4" in ui["ep_hint"].value
    ui["tp"].value, ui["ep"].value = 1, 4
    assert ui["status"].value.startswith("<span style='color:green'>ok: dp=4 = 4 ranks, ep=4")
    assert [list(t.customdata) for t in ui["fig"].data if t.name.startswith("ep ")] == [[0, 1, 2, 3]]
