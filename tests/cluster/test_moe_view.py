"""MoE in the notebook on the real session cluster (tier 3): the line after a %%colossal cell that trained an
MoE GPT, %colossal moe and MoEView, each checked against the records read from the ranks directly."""
from __future__ import annotations

import pytest

import colab_kit as ck
from colab_kit.expert.records import traffic
from colab_kit.notebook.magics.training import format_moe
from colab_kit.notebook.widgets import MoEView
from colab_kit.notebook.widgets.moe_view import _rank_moe
from colab_kit.observe.moe import loads_by_layer, moe_summary

TRAIN = ("%%colossal\nimport torch, colab_kit as ck\nfrom colab_kit.models import GPT, GPTConfig\n"
         "from colab_kit.datasets import SyntheticTokens\n"
         "model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4, top_k=2,\n"
         "                      d_expert=32, capacity_factor=1.0, aux_loss=0.01))\n"
         "moe_engine = ck.boost(model, lambda ps: torch.optim.AdamW(ps, lr=3e-3), config, mesh=mesh)\n"
         "for s in range(3):\n    moe_engine.train_step(SyntheticTokens(64, 16).batch(s, 8))")


@pytest.fixture
def shared(ip, cluster):
    s = ck.magics.state(ip)
    s.cluster, s.config, s.last, s.recorded = cluster, None, None, []
    cluster._shared = True
    yield cluster
    s.cluster, s.config = None, None


def _records(cluster, var="moe_engine"):
    return cluster.run(lambda: [dict(r) for r in ck.notebook.cluster.remote.namespace()[var].records],
                       progress=None)


def test_a_cell_that_trained_experts_says_their_load_drops_losses_and_bytes(ip, run, shared):
    error, out, _ = run("%colossal config dp=4 ep=4")
    assert error is None, out
    error, out, _ = run(TRAIN)
    assert error is None, out
    lines = out.splitlines()
    i = next(k for k, t in enumerate(lines) if t.startswith("moe_engine: steps 1-3"))
    recs = _records(shared)
    want = format_moe({**moe_summary(recs[0], ep_rank=0), "stage_only": False})
    assert lines[i + 1] == " " * 8 + want, (lines[i + 1], want)  # rank 0's records, nothing else
    assert "dropped " in want and "% of " in want and "rank 0 dispatched" in want  # capacity 1.0 drops; ep sends
    sent = sum(sum(layer["sent"]) for r in recs[0] for layer in r["moe"]) / 3
    assert f"dispatched {sent / 1024:.1f} KiB/step" in want

    # %colossal moe in a terminal: the text, and the load figure as the result
    error, out, _ = run("fig = %colossal moe --var moe_engine")
    assert error is None, out
    assert out.startswith("MoEView('moe_engine' on 4 ranks, steps 1-3; recorded)")
    last = recs[0][-1]["moe"]
    assert f"  layer 0  experts 4  step 3: loads {' '.join(map(str, last[0]['counts']))}" in out
    layout = ck.MeshLayout(ck.ParallelConfig(dp=4, ep=4))
    matrix = traffic({r: recs[r][-1]["moe"] for r in range(4)}, layout)
    assert f"    0   {''.join(f'{b:>9,}' for b in matrix[0])}"[4:] in out
    fig = ip.user_ns["fig"]
    assert "recorded" in fig.layout.title.text and [list(c) for c in fig.data[0].customdata][0] == [
        c[0] for c in loads_by_layer(recs[0])[0]["counts"]]
    view = MoEView(shared, "moe_engine")
    assert view.loads == loads_by_layer(recs[0]) and view.step == 3 and view.traffic() == matrix
    assert [sum(row) for row in matrix] == [sum(sum(layer["sent"]) for layer in recs[r][-1]["moe"]) for r in range(4)]
    assert [list(r) for r in view.traffic_figure().data[0].z] == matrix
    one = view.set_layer(1)
    assert one.traffic() == traffic({r: recs[r][-1]["moe"] for r in range(4)}, layout, layer=1)
    assert [list(c) for c in one.load_figure().data[0].customdata] == [
        [c[e] for c in loads_by_layer(recs[0])[1]["counts"]] for e in range(4)]

    _bad(run, "%colossal moe --var no_such_engine", "have no engine in a variable 'no_such_engine'")
    _bad(run, "%colossal moe --var moe_engine --layer 7", "layer=7 has no MoE records: the recorded MoE layers are 0, 1")
    run("%%colossal\nmoe_engine.close()")


def test_the_view_refreshes_after_each_colossal_cell_and_names_a_dense_engine(ip, run, shared):
    error, out, _ = run("%colossal config dp=2 tp=2 ep=2")
    assert error is None, out
    error, out, _ = run(TRAIN)
    assert error is None, out
    assert "moe (2 layers): busiest expert" in out
    view = MoEView(shared, "moe_engine").watch(ip)
    try:
        assert view.step == 3 and view.config.tp == 2
        view.widget()  # headless: the widgets exist and are redrawn by the refresh below
        ui = view._ui
        assert ui["layer"].options == (("all layers", None), ("layer 0", 0), ("layer 1", 1))
        error, out, _ = run("%%colossal\nmoe_engine.train_step(SyntheticTokens(64, 16).batch(3, 8))")
        assert error is None, out
        recs = _records(shared)
        assert view.step == 4 and view.refreshes == 2 and view.loads == loads_by_layer(recs[0])
        # that refresh read step 4 alone: each rank's engine was read before (by its token), the rest was held
        again = view.cluster.run(_rank_moe, "moe_engine", {h["engine"]: 3 for h in view._held}, progress=None)
        assert [[r["step"] for r in g["records"]] for g in again] == [[4]] * 4 and {g["since"] for g in again} == {3}
        assert [[r["step"] for r in h["records"]] for h in view._held] == [[1, 2, 3, 4]] * 4
        assert view.cluster.run(_rank_moe, "moe_engine", {"an engine gone": 3}, progress=None)[0]["since"] is None
        layout = ck.MeshLayout(ck.ParallelConfig(dp=2, tp=2, ep=2))
        assert view.traffic() == traffic({r: recs[r][-1]["moe"] for r in range(4)}, layout)
        assert all(view.traffic()[r][r ^ 1] == 0 for r in range(4))  # tp partners are in different ep groups
        assert [list(r) for r in ui["traffic"].data[0].z] == view.traffic() and "last step 4" in ui["status"].value
        assert [c[-1] for c in ui["load"].data[0].customdata] == recs[0][-1]["moe"][0]["counts"] + \
            recs[0][-1]["moe"][1]["counts"]
        ui["layer"].value = 1  # picked in the widget: the traffic of layer 1 alone
        assert view.layer == 1 and [list(r) for r in ui["traffic"].data[0].z] == traffic(
            {r: recs[r][-1]["moe"] for r in range(4)}, layout, layer=1)
        run("x = 1")  # not a %%colossal cell: no refresh
        assert view.refreshes == 2
        assert view.click_refresh() is None and view.refreshes == 3 and not ui["refresh"].disabled  # the button
        view._source = object()  # no cluster there: the button shows why, in the widget
        view.click_refresh()
        assert "NoMoE: no cluster to read" in view.error and "no cluster to read" in str(ui["errors"].outputs)
        view._source = shared
    finally:
        view.unwatch()
    run("%%colossal\nmoe_engine.close()")
    error, out, _ = run("%colossal config dp=4")
    assert error is None, out
    error, out, _ = run("%%colossal\n"
                        "dense = ck.boost(GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, "
                        "n_layers=1)), lambda ps: torch.optim.SGD(ps, lr=0.1), config, mesh=mesh)\n"
                        "dense.train_step(SyntheticTokens(64, 16).batch(0, 8))")
    assert error is None, out
    assert "dense: step 1" in out and "moe (" not in out  # a dense engine has no MoE line
    _bad(run, "%colossal moe --var dense", "'dense' has no MoE records: its model has no MoE layer")
    run("%%colossal\ndense.close()")


def test_under_pp_the_line_says_rank_0s_stage_and_the_view_reads_each_stage(run, shared):
    error, out, _ = run("%colossal config pp=2 dp=2 ep=2")
    assert error is None, out
    error, out, _ = run(TRAIN)
    assert error is None, out
    line = next(t for t in out.splitlines() if t.lstrip().startswith("moe ("))
    assert line.startswith("        moe (1 layer on rank 0's stage): busiest expert "), line
    recs = _records(shared)
    assert [[m["layer"] for m in r["moe"]] for r in (recs[0][-1], recs[2][-1])] == [[0], [1]]  # one per stage
    view = MoEView(shared, "moe_engine")
    assert view.loads == {**loads_by_layer(recs[0]), **loads_by_layer(recs[2])} and list(view.loads) == [0, 1]
    layout = ck.MeshLayout(ck.ParallelConfig(pp=2, dp=2, ep=2))
    assert view.traffic() == traffic({r: recs[r][-1]["moe"] for r in range(4)}, layout)
    assert view.traffic()[0][2] == view.traffic()[2][0] == 0  # stages never exchange tokens
    run("%%colossal\nmoe_engine.close()")


def test_the_mesh_magic_draws_the_expert_groups_beside_the_dense_ones(ip, run):
    error, out, _ = run("fig = %colossal mesh --axis experts dp=4 ep=2")
    assert error is None, out
    names = [t.name for t in ip.user_ns["fig"].data]
    assert names == ["dp group 0: ranks 0, 1, 2, 3", "ep group 0: ranks 0, 1", "ep group 1: ranks 2, 3",
                     "edp group 0: ranks 0, 2", "edp group 1: ranks 1, 3"]
    _bad(run, "%colossal mesh --axis experts dp=4", "does not split the experts (ep=1)")
    _bad(run, "%colossal mesh --axis ep dp=4", "unknown axis 'ep'")


def _bad(run, src, needle):
    error, out, err = run(src)
    assert type(error).__name__ == "UsageError", (src, error, out, err)
    assert needle in str(error), str(error)
