"""ConfigPicker: the logic without a browser, the widgets headless, Apply against a real cluster."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

import colab_kit as ck
from colab_kit.notebook.widgets import ConfigPicker
from colab_kit.notebook.cluster import ClusterError
from colab_kit.engine.core import unsupported
from colab_kit.notebook.widgets import display
from colab_kit.notebook.widgets.config_picker import FIELDS


def test_status_follows_every_change():
    p = ConfigPicker(world_size=4)
    assert p.status() == "ok: dp=4 = 4 ranks fits the 4 ranks" and p.config == ck.ParallelConfig(dp=4)
    assert p.set(dp=2, tp=2) == "ok: dp=2 x tp=2 (1d) = 4 ranks fits the 4 ranks"
    assert p.set(tp_mode="2d") == ("not valid: tp=2 with tp_mode='2d' needs tp to be a square (q*q): try 1 or 4")
    assert p.config is None and "square" in p.error
    assert p.set(dp=1, tp=4).startswith("ok: tp=4 (2d) = 4 ranks")
    assert p.set(dp=2) == ("not valid: this config needs dp*pp*sp*tp = 2*1*1*4 = 8 ranks, but there are 4: "
                           "try dp=1")
    assert p.set(dp=1, tp=2, tp_mode="1d", sp_mode="split_gather").startswith("not valid: this config needs")
    assert p.set(dp=2, schedule="interleaved").startswith("not valid: schedule='interleaved' gives each")
    assert p.set(schedule="1f1b", sp_mode="ring") == "ok: dp=2 x tp=2 (1d) = 4 ranks fits the 4 ranks"
    assert p.unsupported is None
    with pytest.raises(ck.ConfigError, match="no field 'offload'"):
        p.set(offload="cpu")


def test_without_a_world_size_only_the_rules_apply():
    p = ConfigPicker(config=ck.ParallelConfig(pp=2, microbatches=4))
    assert p.world_size is None
    assert p.status() == ("ok: pp=2 = 2 ranks, 1f1b x 4 microbatches (no cluster: nothing to check the world size "
                          "against)")
    assert p.values["microbatches"] == 4
    assert p.apply() == "not applied: no cluster running (start one with %colossal start -n 4)"


def test_figure_redraws_with_the_choice():
    p = ConfigPicker(world_size=8)
    assert [list(t.customdata) for t in p.figure().data] == [list(range(8))]  # dp=8: one dp group
    p.set(dp=2, tp=4)
    assert [list(t.customdata) for t in p.figure().data] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    p.set(tp=3)
    assert p.figure().data == () and p.figure().layout.title.text == "no valid config"


def test_widgets_drive_the_same_logic():
    p = ConfigPicker(world_size=4)
    box = p.widget()
    ui = p._ui
    assert set(FIELDS) <= set(ui) and box is p.widget()
    assert ui["zero"].options == (0, 1, 2, 3) and "2.5d" in ui["tp_mode"].options
    ui["dp"].value = 2  # as if the user typed it
    assert p.values["dp"] == 2 and "not valid" in ui["status"].value and "#b00020" in ui["status"].value
    ui["tp"].value = 2
    assert ui["status"].value.startswith("<span style='color:green'>ok: dp=2 x tp=2")
    fig = ui["fig"]
    assert [list(t.customdata) for t in fig.data] == [[0, 1], [2, 3]]  # the FigureWidget was redrawn
    p.set(tp_mode="2d")  # code changes reach the widgets too
    assert ui["tp_mode"].value == "2d" and "square" in ui["status"].value


@pytest.mark.parametrize("world, changes, why", [
    (8, dict(dp=1, sp=2, tp=4, tp_mode="2d"), "sequence parallelism (sp=2) with tp_mode='2d'"),
    (4, dict(dp=1, tp=4, tp_mode="2d", sp_mode="split_gather"), "sp_mode='split_gather' with tp_mode='2d'"),
    (4, dict(dp=2, pp=2, zero=3), "ZeRO stage 3 with pipeline parallelism")])
def test_a_valid_config_that_boost_refuses_is_not_runnable_yet(world, changes, why):
    p = ConfigPicker(world_size=world)
    status = p.set(**changes)
    assert p.config is not None and p.error is None  # ParallelConfig accepts it, the mesh is drawn
    assert status == f"valid, not runnable yet: {unsupported(p.config)}" and p.unsupported == unsupported(p.config)
    assert f"does not run {why} yet" in status and p.figure().data != ()
    with pytest.raises(ck.ConfigError) as refused:  # the very message boost raises
        ck.boost(None, None, p.config)
    assert str(refused.value) == p.unsupported
    box = p.widget()
    assert box is not None and "#b36b00" in p._ui["status"].value and "not runnable yet" in p._ui["status"].value
    p.set(sp=1, zero=0, pp=1, dp=world, tp=1, tp_mode="1d", sp_mode="ring")
    assert p.status().startswith("ok: ") and p.unsupported is None and "green" in p._ui["status"].value


class _FakeState:
    """A %colossal state whose apply_config records what the Apply button showed meanwhile."""

    def __init__(self, picker_ui, outcome):
        self.cluster = SimpleNamespace(running=True, world_size=4, config=None)
        self.config, self.ui, self.outcome, self.seen = None, picker_ui, outcome, []

    def apply_config(self, config):
        button, message = self.ui()["apply"], self.ui()["message"]
        self.seen.append((button.disabled, button.description, message.value, threading.current_thread().name))
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


@pytest.mark.parametrize("outcome, shown", [
    ("config set on 4 ranks: dp=2 x tp=2 (1d) = 4 ranks", "config set on 4 ranks: dp=2 x tp=2 (1d) = 4 ranks"),
    (ClusterError("the cluster needs a restart: rank 1 died\nmore"), "not applied: the cluster needs a restart: "
                                                                     "rank 1 died"),
    (RuntimeError("unexpected"), "not applied: RuntimeError: unexpected")])
def test_apply_shows_that_it_is_applying_then_the_outcome(outcome, shown):
    p = ConfigPicker(state=None, world_size=4)
    p.state = _FakeState(lambda: p._ui, outcome)
    p.set(dp=2, tp=2)
    p.widget()
    assert p._click_apply() is None  # no running loop: done at once
    applying = (True, "Applying…", "applying dp=2 x tp=2 (1d) = 4 ranks: building the mesh on every rank…")
    assert p.state.seen == [(*applying, threading.current_thread().name)]
    button = p._ui["apply"]
    assert (button.disabled, button.description, p._ui["message"].value, p.message) == (False, "Apply", shown, shown)

    async def click_in_a_kernel():  # a running loop: the call to the cluster is awaited in a worker thread
        task = p._click_apply()
        assert isinstance(task, asyncio.Task) and button.disabled and button.description == "Applying…"
        await task

    asyncio.run(click_in_a_kernel())
    assert p.state.seen[1][:3] == applying and p.state.seen[1][3] != threading.current_thread().name
    assert (button.disabled, button.description, p._ui["message"].value) == (False, "Apply", shown)


def test_text_plain_is_the_text_form_not_the_widget_repr(monkeypatch):
    p = ConfigPicker(world_size=4)
    p.set(dp=2, tp=2)
    text = "\n".join([repr(p).splitlines()[0], "ok: dp=2 x tp=2 (1d) = 4 ranks fits the 4 ranks",
                      "mesh: dp groups [0, 2] [1, 3]; tp groups [0, 1] [2, 3]"])
    assert repr(p) == text and p._repr_mimebundle_() == {"text/plain": text}  # outside a kernel: text only
    monkeypatch.setattr(display, "in_kernel", lambda: True)
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append((obj, raw)))
    p._ipython_display_()
    (bundle, raw), = shown
    assert raw and bundle["text/plain"] == text and not bundle["text/plain"].startswith("VBox")
    assert bundle[display.WIDGET_MIME]["model_id"] == p.widget().model_id
    assert p._repr_mimebundle_() == bundle


def test_text_fallback_outside_a_kernel(capsys):
    p = ConfigPicker(world_size=2)
    p._ipython_display_()
    out = capsys.readouterr().out
    assert out.startswith("ConfigPicker(dp=2 tp=1 pp=1") and "ok: dp=2 = 2 ranks fits the 2 ranks" in out
    assert p._ui is None  # no widget was built


def test_apply_sends_the_config_to_the_cluster(cluster):
    p = ConfigPicker(cluster)
    assert p.world_size == 4 and p.status() == "ok: dp=4 = 4 ranks fits the 4 ranks"
    p.set(dp=2, tp=2)
    assert p.apply() == "config set on 4 ranks: dp=2 x tp=2 (1d) = 4 ranks"
    assert cluster.config == ck.ParallelConfig(dp=2, tp=2)
    assert cluster.execute("print(mesh.ranks('tp'))", ranks=[3])[3].stdout == "[2, 3]\n"
    p.set(tp=4)
    assert p.apply().startswith("not applied: this config needs")
    assert cluster.config == ck.ParallelConfig(dp=2, tp=2)
    assert ConfigPicker(cluster).config == ck.ParallelConfig(dp=2, tp=2)  # a new picker starts from it


def test_apply_goes_through_the_magic_state(cluster):
    state = ck.magics.ColossalState()
    state.cluster = cluster
    p = ConfigPicker(state=state)
    assert p.target is cluster and p.world_size == 4
    p.set(dp=1, tp=4, tp_mode="2d")
    assert p.apply() == "config set on 4 ranks: tp=4 (2d) = 4 ranks"
    assert state.config == cluster.config == ck.ParallelConfig(tp=4, tp_mode="2d")
    assert cluster.execute("print(mesh.coords()['tp_row'], mesh.coords()['tp_col'])", ranks=[2])[2].stdout == "1 0\n"


def test_a_figure_view_opens_with_its_traces_and_sends_nothing_unchanged(monkeypatch):
    """The comm_open of figure_view's FigureWidget carries the figure (a browser still building the model
    loses the updates sent right after it: notebook 06's PlannerView drew axes alone), and redrawing the
    same figure sends no message."""
    import comm
    import plotly.graph_objects as go

    from colab_kit.notebook.widgets.figure_view import figure_view, redraw

    opened, sent = [], []
    real = comm.create_comm

    def create_comm(**kwargs):
        opened.append(kwargs["data"]["state"])
        c = real(**kwargs)
        c.send = lambda data=None, **kw: sent.append(data)
        return c

    monkeypatch.setattr(comm, "create_comm", create_comm)
    fig = go.Figure(go.Scatter(x=[1, 2, 3], y=[4, 5, 6], name="points"), layout={"title": {"text": "t"}})
    view = figure_view(fig)
    state = next(s for s in opened if s.get("_model_name") == "AnyModel")
    assert [(t["name"], t["x"], t["y"]) for t in state["_widget_data"]] == [("points", [1, 2, 3], [4, 5, 6])]
    assert state["_widget_layout"]["title"] == {"text": "t"}
    assert not [m for m in sent if {"_widget_data", "_widget_layout"} & set((m or {}).get("state", {}))]
    sent.clear()
    redraw(view, go.Figure(fig))
    assert sent == []
    redraw(view, go.Figure(go.Scatter(x=[1], y=[7])))
    assert sent and list(view.data[0].y) == [7]
