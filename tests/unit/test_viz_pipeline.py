"""Pipeline figures from known plans: cells, labels, executed/current states (tier 1)."""
from __future__ import annotations

import pytest

from colab_kit.pipeline import Action, build_plan, lower, simulate, steps
from colab_kit.viz import activation_memory_figure, activation_peaks_figure, bubble_figure, schedule_figure
from colab_kit.viz.pipeline import KIND_COLOURS
from colab_kit.viz.schedule_data import action_set, cells, event_cells, held_series, measured_bubble, plan_cells

SHAPES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb-h1", 4, 8, 1), ("1f1b", 2, 3, 1)]


def _bars(fig):
    """label -> (trace meta, rank row, start, length, outline width)."""
    out = {}
    for t in fig.data:
        widths = t.marker.line.width
        for i, (label, y, base, x) in enumerate(zip(t.text, t.y, t.base, t.x)):
            out[t.customdata[i][2]] = (t.meta, y, base, x, widths)
    return out


def test_plan_cells_are_the_lockstep_grid():
    plan = build_plan("1f1b", 2, 2)
    got = [(c.rank, c.index, c.label, c.start, c.end) for c in plan_cells(plan)]
    assert sorted(got) == [(0, 0, "0F0", 0, 1), (0, 1, "0F1", 1, 2), (0, 2, "0B0", 3, 4), (0, 3, "0B1", 5, 6),
                           (1, 0, "1F0", 1, 2), (1, 1, "1B0", 2, 3), (1, 2, "1F1", 3, 4), (1, 3, "1B1", 4, 5)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_grid_figure_has_every_action_once_at_its_timestep(shape):
    for plan in (build_plan(*shape), lower(build_plan(*shape))):
        fig = schedule_figure(plan)
        bars = _bars(fig)
        assert sorted(bars) == sorted(str(a) for row in plan.actions for a in row)
        for t, row in enumerate(steps(plan)):
            for r, a in enumerate(row):
                if a is not None:
                    meta, y, base, x, _ = bars[str(a)]
                    assert (meta, y, base, x) == ("planned", f"rank {r}", t, 1)
        assert {t.name for t in fig.data} <= {"F forward", "B backward", "I input grad", "W weight grad",
                                              "SF send act", "RF recv act", "SB send grad", "RB recv grad"}
        assert "planned" in fig.layout.title.text and plan.schedule in fig.layout.title.text
        assert all(t.showlegend for t in fig.data)  # one trace per kind when nothing is marked


def test_colours_follow_kind_and_microbatch():
    fig = schedule_figure(build_plan("1f1b", 2, 4))
    f = next(t for t in fig.data if t.name == "F forward")
    shade = dict(zip(f.text, f.marker.color))
    assert shade["0F0"] == shade["1F0"] == KIND_COLOURS["F"].lower()
    assert shade["0F0"] != shade["0F1"] != shade["0F3"] and shade["0F3"] == shade["1F3"]
    b = next(t for t in fig.data if t.name == "B backward")
    assert dict(zip(b.text, b.marker.color))["0B0"] == KIND_COLOURS["B"].lower()


def test_executed_and_current_partition_the_cells():
    plan = lower(build_plan("1f1b", 4, 8))
    executed = {"0F0", "0SF0", "0F1", "1RF0", "1F0"}
    current = {0: "0SF1", 1: "1SF0", 2: "2RF0", 3: "3RF0"}
    fig = schedule_figure(plan, executed=executed, current=current)
    bars = _bars(fig)
    states = {label: b[0] for label, b in bars.items()}
    assert {k for k, v in states.items() if v == "executed"} == executed
    assert {k for k, v in states.items() if v == "current"} == set(current.values())
    assert sum(v == "planned, not run yet" for v in states.values()) == len(states) - 9
    for t in fig.data:
        assert t.marker.line.width == (3 if t.meta == "current" else 0.5)
        assert t.marker.opacity == (0.3 if t.meta == "planned, not run yet" else 1.0)
    assert [t.showlegend for t in fig.data].count(True) == len({t.name for t in fig.data})
    assert "executed (solid)" in fig.layout.title.text
    # the same marks given as (rank, index) pairs, Actions, or per-rank lists from engine.pipeline.state()
    pairs = {(r, i) for r, row in enumerate(plan.actions) for i, a in enumerate(row) if str(a) in executed}
    for form in (pairs, {Action(int(s[0]), s[1:-1], int(s[-1])) for s in executed},
                 {0: ["0F0", "0SF0", "0F1"], 1: ["1RF0", "1F0"], 2: [], 3: []}):
        again = _bars(schedule_figure(plan, executed=form, current=list(current.values())))
        assert {k: v[0] for k, v in again.items()} == states
    empty = _bars(schedule_figure(plan, executed=set()))
    assert {v[0] for v in empty.values()} == {"planned, not run yet"}


def test_marks_need_the_plan_for_pairs_and_must_parse():
    with pytest.raises(ValueError, match="needs the plan"):
        action_set({(0, 1)})
    with pytest.raises(ValueError, match="cannot read pipeline action"):
        action_set({"forward 0"})
    with pytest.raises(TypeError, match="a PipelinePlan, a Timeline"):
        cells("1f1b")
    with pytest.raises(TypeError, match="a PipelinePlan, a Timeline"):  # one rank's row, not every rank's
        cells([Action(0, "F", 0), Action(0, "F", 1)])
    # a rank's one current action (an Action is a tuple of its fields: taken whole, not field by field)
    assert action_set({0: Action(0, "F", 0), 1: None, 2: [Action(2, "I", 1)]}) == {"0F0", "2I1"}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_timeline_figure_draws_the_simulated_times(shape):
    timeline = simulate(build_plan(*shape))
    bars = _bars(schedule_figure(timeline, executed={"0F0"}))
    for row in timeline.events:
        for s, e, a in row:
            assert bars[str(a)][2:4] == (s, e - s)
    assert bars["0F0"][0] == "executed"
    fig = schedule_figure(timeline)
    assert f"bubble {timeline.bubble_fraction:.1%}" in fig.layout.title.text
    assert "planned time" in fig.layout.xaxis.title.text and fig.layout.xaxis.range == (0, timeline.makespan)
    lowered = simulate(lower(build_plan(*shape)))  # sends and receives take 0: not drawn
    assert sorted(_bars(schedule_figure(lowered))) == sorted(bars)


def test_measured_events_fill_idle_gaps_and_lanes():
    rank0 = [{"name": "0F0", "kind": "compute", "start": 0.0, "end": 0.002, "action": "0F0", "microbatch": 0},
             {"name": "0SF0", "kind": "comm", "start": 0.002, "end": 0.0025, "action": "0SF0", "microbatch": 0},
             {"name": "0B0", "kind": "compute", "start": 0.006, "end": 0.010, "action": "0B0", "microbatch": 0},
             {"name": "all_reduce bucket 0", "kind": "comm", "start": 0.008, "end": 0.011},
             {"name": "optimizer step", "kind": "compute", "start": 0.011, "end": 0.012}]
    rank1 = [{"name": "1RF0", "kind": "comm", "start": 0.0, "end": 0.0021, "action": "1RF0", "microbatch": 0},
             {"name": "1F0", "kind": "compute", "start": 0.0021, "end": 0.004, "action": "1F0", "microbatch": 0},
             {"name": "1B0", "kind": "compute", "start": 0.004, "end": 0.006, "action": "1B0", "microbatch": 0}]
    got = [(c.rank, c.label, c.kind, c.lane, round(c.start, 6), round(c.end, 6)) for c in event_cells([rank0, rank1])]
    assert got == [(0, "0F0", "F", 0, 0, 2), (0, "0SF0", "SF", 0, 2, 2.5), (0, "idle", "idle", 0, 2.5, 6),
                   (0, "0B0", "B", 0, 6, 10), (0, "all_reduce bucket 0", "comm", 1, 8, 11),
                   (0, "idle", "idle", 0, 10, 11),  # lane 0 waits for the async all-reduce
                   (0, "optimizer step", "compute", 0, 11, 12),
                   (1, "1RF0", "RF", 0, 0, 2.1), (1, "1F0", "F", 0, 2.1, 4), (1, "1B0", "B", 0, 4, 6),
                   (1, "idle", "idle", 0, 6, 12)]
    assert measured_bubble([rank0, rank1]) == pytest.approx(1 - (0.002 + 0.004 + 0.0019 + 0.002) / (2 * 0.010))
    fig = schedule_figure([rank0, rank1])
    assert "measured" in fig.layout.title.text and "ms" in fig.layout.xaxis.title.text
    assert {t.meta for t in fig.data} == {"measured"}
    assert set(fig.layout.yaxis.categoryarray) == {"rank 0", "rank 0 (async)", "rank 1"}
    assert measured_bubble([[], []]) == 0.0


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_held_series_peaks_match_the_simulation(shape):
    plan = build_plan(*shape)
    timeline = simulate(plan)
    for source in (plan, lower(plan), timeline):
        held = held_series(source)
        assert [max(y) for _, y in held] == timeline.peak_held
        assert [y[-1] for _, y in held] == [0] * plan.pp
        assert [max(y) for _, y in held_series(source, frees=("B", "I"))] == timeline.peak_activations
    x, _ = held_series(lower(plan))[0]
    assert x == list(range(len(steps(lower(plan))) + 1))


def test_activation_memory_figure_planned_and_measured():
    plan = lower(build_plan("1f1b", 4, 8))
    fig = activation_memory_figure(plan)
    assert [t.name for t in fig.data] == [f"rank {r} (planned)" for r in range(4)]
    assert [max(t.y) for t in fig.data] == [4, 3, 2, 1] and "(planned)" in fig.layout.title.text
    fig = activation_memory_figure(plan, measured={0: [(0, 0), (5, 2)], 3: [(0, 0)], 1: []})
    assert [t.name for t in fig.data][4:] == ["rank 0 (measured)", "rank 3 (measured)"]
    assert list(fig.data[4].x) == [0, 5] and list(fig.data[4].y) == [0, 2] and "measured" in fig.layout.title.text


def test_bubble_and_peak_figures():
    rows = [{"schedule": "gpipe", "planned": 0.27, "measured": 0.31, "theory": 0.2727},
            {"schedule": "zb-h1", "planned": 0.1, "measured": None}]
    fig = bubble_figure(rows, pp=4, microbatches=8)
    assert [t.name for t in fig.data] == ["planned (simulated)", "measured on the engine", "formula of the schedule",
                                          "textbook (p-1)/(m+p-1) = 27.3%"]
    assert list(fig.data[0].y) == [0.27, 0.1] and list(fig.data[1].text) == ["31.0%", ""]
    line = fig.layout.shapes[0]
    assert line.y0 == line.y1 == pytest.approx(3 / 11)
    assert [t.name for t in bubble_figure(rows[1:]).data] == ["planned (simulated)"]
    fig = activation_peaks_figure([{"schedule": "1f1b", "planned": [4, 3, 2, 1], "measured": [2**21] * 4}])
    assert list(fig.data[0].y) == [4, 3, 2, 1] and list(fig.data[1].y) == [2.0] * 4
    assert len(activation_peaks_figure([{"schedule": "1f1b", "planned": [1, 1]}]).data) == 1


def test_docstring_examples_are_true():
    import doctest
    import importlib

    for name in ("colab_kit.viz.pipeline", "colab_kit.viz.schedule_data", "colab_kit.notebook.magics.pipeline_views"):
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, name
