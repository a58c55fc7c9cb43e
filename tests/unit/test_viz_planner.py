"""viz.planner: the planner's candidates drawn as estimated memory against estimated step time (tier 1)."""
from __future__ import annotations


import pytest

from colab_kit.config import ParallelConfig
from colab_kit.viz.planner import config_words, device_bytes, plan_figure, plan_vs_measured_figure

from tests.helpers import CANDS, MIB

def test_one_marker_per_candidate_split_by_fit_with_its_index():
    fig = plan_figure(CANDS)
    fits, miss = fig.data
    assert (fits.name, list(fits.customdata), list(fits.x), list(fits.y)) == ("fits", [0, 1], [20.0, 40.0], [3.0, 1.0])
    assert (miss.name, list(miss.customdata), list(miss.x), list(miss.y)) == ("does not fit", [2, 3], [30.0, 50.0],
                                                                              [9.0, 10.0])
    assert fits.marker.symbol != miss.marker.symbol and fits.marker.color != miss.marker.color
    assert not fig.layout.shapes  # no budget given: no line


def test_labelled_as_planned_with_the_budget_line_and_hover():
    fig = plan_figure(CANDS, memory_per_rank=8 * MIB)
    title = fig.layout.title.text
    assert title.startswith("Planned (estimated, not run)") and "measured" not in title
    assert fig.layout.xaxis.title.text == "estimated step time (ms)"
    assert fig.layout.yaxis.title.text == "estimated device MiB per rank"
    (line,) = fig.layout.shapes
    assert (line.name, line.line.dash, line.y0, line.y1) == ("memory per rank", "dash", 8.0, 8.0)
    hover = fig.data[0].text[1]
    assert "dp=4 zero=3 offload=cpu" in hover and "host 6.00 MiB" in hover and "fits: host copies" in hover
    assert "does not fit: bubble 43%" in fig.data[1].text[1]


def test_chosen_is_ringed_and_checked():
    fig = plan_figure(CANDS, chosen=2)
    ring = fig.data[-1]
    assert (ring.name, list(ring.customdata), list(ring.x), list(ring.y)) == ("chosen", [2], [30.0], [9.0])
    with pytest.raises(ValueError, match=r"chosen=4: there are 4 candidates \(0..3\)"):
        plan_figure(CANDS, chosen=4)


def test_all_fit_gives_one_trace():
    assert [t.name for t in plan_figure(CANDS[:2]).data] == ["fits"]


def test_config_words_read_back_as_the_same_config():
    for cfg in (ParallelConfig(dp=2, pp=2, microbatches=4, schedule="gpipe", zero=1),
                ParallelConfig(tp=4, tp_mode="2d", recompute=True), ParallelConfig(), ParallelConfig(dp=2, sp=2)):
        assert ParallelConfig.parse(config_words(cfg)) == cfg
    assert config_words(ParallelConfig(tp=4, tp_mode="2d", recompute=True)) == "tp=4 tp_mode=2d recompute=full"


def test_device_bytes_reads_places_or_totals():
    assert device_bytes(CANDS[1].memory) == 1 * MIB
    assert device_bytes({"params": 3, "grads": 4, "optimizer": 5, "activations": 6}) == 18
    assert device_bytes({"params": 3, "device": 7}) == 7


def test_plan_vs_measured_labels_each_bar():
    rows = [{"label": "dp=4", "estimated_bytes": 3 * MIB, "measured_bytes": 3.5 * MIB,
             "estimated_seconds": 0.02, "measured_seconds": 0.025},
            {"label": "tp=4", "estimated_bytes": 9 * MIB, "measured_bytes": None,
             "estimated_seconds": 0.03, "measured_seconds": None}]
    fig = plan_vs_measured_figure(rows)
    assert [(t.name, list(t.x), [round(v, 3) for v in t.y]) for t in fig.data] == [
        ("estimated", ["dp=4", "tp=4"], [3.0, 9.0]), ("estimated", ["dp=4", "tp=4"], [20.0, 30.0]),
        ("measured", ["dp=4"], [3.5]), ("measured", ["dp=4"], [25.0])]
    assert "estimated" in fig.layout.title.text and "measured" in fig.layout.title.text
    with pytest.raises(ValueError, match=r"row 'x' lacks \['measured_seconds'\]"):
        plan_vs_measured_figure([{k: v for k, v in rows[0].items() if k != "measured_seconds"} | {"label": "x"}])
