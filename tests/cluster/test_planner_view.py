"""PlannerView: the text table, choosing by row or by point, Apply by %colossal config's path."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import colab_kit as ck
from colab_kit.notebook.widgets import PlannerView
from tests.helpers import CANDS, MIB


class _State:
    """Records what Apply hands to ``apply_config`` (the path %colossal config takes)."""

    def __init__(self, outcome="config set on 4 ranks: tp=4 (1d) = 4 ranks"):
        self.outcome, self.seen = outcome, []

    def apply_config(self, config):
        self.seen.append(config)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def test_text_table_chooses_the_best_that_fits_and_says_it_is_planned(capsys):
    v = PlannerView(CANDS[2:] + CANDS[:2], state=_State(), memory_per_rank=8 * MIB)
    assert v.selected == 2  # the first candidate that fits, best first
    lines = repr(v).splitlines()
    assert lines[0] == "PlannerView: 4 candidates, best first (planned: estimated, not run); memory per rank 8.00 MiB"
    assert lines[1].split() == ["#", "config", "params", "grads", "optimizer", "activations", "step", "ms", "fits",
                                "why"]
    assert lines[2].split() == ["0", "tp=4", "9.00", "0.00", "0.00", "0.00", "30.00", "no", "tp", "all-reduce"]
    assert lines[4].startswith(" >   2  dp=4 ")
    assert lines[5].split()[:7] == ["3", "dp=4", "zero=3", "offload=cpu", "1.00", "0.00", "6.00"]
    assert lines[-1] == "  chosen: #2 dp=4: %colossal config dp=4"
    v._ipython_display_()  # outside a kernel: the text, no widget built
    assert capsys.readouterr().out == repr(v) + "\n" and v._ui is None


def test_select_and_apply_go_through_the_state():
    state = _State()
    v = PlannerView(CANDS, state=state, memory_per_rank=8 * MIB, top=3)
    assert len(v.candidates) == 3 and repr(v).startswith("PlannerView: 3 of 4 candidates, best first")
    assert v.select(2) == "chosen: #2 tp=4: %colossal config tp=4; estimated not to fit: tp all-reduce"
    assert list(v.figure().data[-1].customdata) == [2]
    assert v.apply() == "config set on 4 ranks: tp=4 (1d) = 4 ranks" and state.seen == [ck.ParallelConfig(tp=4)]
    assert repr(v).endswith("\n  config set on 4 ranks: tp=4 (1d) = 4 ranks")
    state.outcome = ck.ConfigError("this config needs dp*pp*sp*tp = 1*1*1*4 = 4 ranks, but there are 8: try dp=2")
    assert v.apply() == "not applied: this config needs dp*pp*sp*tp = 1*1*1*4 = 4 ranks, but there are 8: try dp=2"
    with pytest.raises(ValueError, match=r"candidate 3: choose 0..2"):
        v.select(3)
    with pytest.raises(ValueError, match="no candidates to show"):
        PlannerView([], state=state)
    lone = PlannerView(CANDS, state=_State())
    lone.state = None  # no state at all (state=None would take this shell's %colossal state where one is loaded)
    assert lone._apply().startswith("not applied: no %colossal state")


def test_a_row_or_a_point_chooses_and_the_button_applies():
    state = _State()
    v = PlannerView(CANDS, state=state)
    v.widget()
    ui = v._ui
    assert [label.split()[1] for label, _ in ui["table"].options] == ["dp=4", "dp=4", "tp=4", "pp=4"]
    drawn = list(getattr(ui["figure"], "data", ()))
    ui["table"].value = 3  # a click on row 3
    assert v.selected == 3 and ui["status"].value == (
        "chosen: #3 pp=4 microbatches=4: %colossal config pp=4 microbatches=4; estimated not to fit: bubble 43%")
    fig = ui["figure"]
    if not hasattr(fig, "data"):
        pytest.skip("no anywidget: the figure is a plain Output, nothing to click")
    assert list(fig.data[-1].customdata) == [3]  # the ring moved with the row
    assert len(fig.data) == len(drawn) and all(a is b for a, b in zip(fig.data, drawn))  # moved, not redrawn
    from plotly.callbacks import InputDeviceState, Points

    fits = next(t for t in fig.data if t.name == "fits")
    fits._dispatch_on_click(Points(point_inds=[1], trace_name="fits"), InputDeviceState())  # a click on a point
    assert v.selected == 1 and ui["table"].value == 1 and list(ui["figure"].data[-1].customdata) == [1]
    assert v.click_apply() is None  # no running loop: applied at once
    assert state.seen == [CANDS[1].config] and ui["message"].value == "config set on 4 ranks: tp=4 (1d) = 4 ranks"
    assert (ui["apply"].disabled, ui["apply"].description) == (False, "Apply")
    state.outcome = RuntimeError("boom")
    v.click_apply()
    assert ui["message"].value == "not applied: RuntimeError: boom"


def test_apply_through_the_view_sets_the_config_as_the_magic_does(cluster):
    state = ck.magics.ColossalState()
    state.cluster = cluster
    cands = [SimpleNamespace(**{**vars(c), "config": cfg}) for c, cfg in
             zip(CANDS, (ck.ParallelConfig(dp=2, tp=2), ck.ParallelConfig(pp=2, dp=2, microbatches=2),
                         ck.ParallelConfig(dp=8)))]
    v = PlannerView(cands, state=state)
    v.select(1)
    assert v.apply() == "config set on 4 ranks: dp=2 x pp=2 = 4 ranks, 1f1b x 2 microbatches"
    assert state.config == cluster.config == ck.ParallelConfig(pp=2, dp=2, microbatches=2)
    assert cluster.execute("print(mesh.ranks('pp'), config.microbatches)", ranks=[3])[3].stdout == "[1, 3] 2\n"
    v.select(2)  # planned for 8 ranks: refused by the same check as %colossal config, nothing changes
    assert v.apply() == ("not applied: this config needs dp*pp*sp*tp = 8*1*1*1 = 8 ranks, but there are 4: "
                         "try dp=4")
    assert state.config == cluster.config == ck.ParallelConfig(pp=2, dp=2, microbatches=2)


def test_the_planner_s_candidates_apply_as_percent_colossal_config_does(cluster):
    """ck.plan's own candidates for 4 ranks (fixed constants: no measuring here): the view's Apply and
    ``%colossal config <the same words>`` leave the state, the cluster and the ranks' mesh the same."""
    from colab_kit.models import GPTConfig
    from colab_kit.planner import EXAMPLE_CONSTANTS
    from colab_kit.viz.planner import config_words

    model = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    cands = ck.plan(model, 4, 8, memory_per_rank=MIB, constants=EXAMPLE_CONSTANTS)
    state = ck.magics.ColossalState()
    state.cluster = cluster
    v = PlannerView(cands, state=state, top=12)  # the first rows are dp=4 variants (ZeRO, recomputation)
    assert v.memory_per_rank == MIB and repr(v).startswith(f"PlannerView: 12 of {len(cands)} candidates")
    pick = next(i for i, c in enumerate(v.candidates) if c.config.world_size == 4 and c.config.dp < 4)
    v.select(pick)
    words = config_words(v.chosen.config)
    assert v.apply() == f"config set on 4 ranks: {v.chosen.config.describe()}"
    by_view = (state.config, cluster.config, cluster.execute("print(mesh.ranks('dp'))", ranks=[1])[1].stdout)
    assert by_view[0] == by_view[1] == v.chosen.config
    state.config = None
    cluster.set_config(None)
    assert state.apply_config(ck.ParallelConfig.parse(words)) == v.message  # what %colossal config prints
    assert (state.config, cluster.config, cluster.execute("print(mesh.ranks('dp'))", ranks=[1])[1].stdout) == by_view
