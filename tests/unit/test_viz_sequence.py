"""Sequence-parallel figures from known layouts and events: cells, colours, frames, fits (tier 1, no processes)."""
from __future__ import annotations

import pytest

from colab_kit.sequence import chunk_ids
from colab_kit.viz import longest_fit, ring_figure, sequence_memory_figure, ulysses_figure, zigzag_figure
from colab_kit.viz.sequence import chunk_colours, ring_cells, ulysses_bytes


def _ring_events(sp: int, calls: int = 2) -> list[list[dict]]:
    """What the recorders of an sp ring hold after one step: per rank, ``calls`` forward calls then as many backward."""
    out = []
    for r in range(sp):
        rank = []
        for phase in ("forward", "backward"):
            for call in range(calls):
                for i in range(sp):
                    rank.append({"phase": phase, "rotation": i, "rank": r, "holds": list(chunk_ids((r - i) % sp, sp)),
                                 "start": 0.01 * i, "end": 0.01 * i + 0.002 * (call + 1), "waited": 0.0005})
        out.append(rank)
    return out


def _cells(trace) -> dict[tuple[int, int], int]:
    """(row, column) -> chunk id of every filled cell of a chunk heatmap (z = id + 0.5)."""
    return {(y, x): int(v - 0.5) for y, row in enumerate(trace.z) for x, v in enumerate(row) if v is not None}


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_zigzag_figure_puts_each_chunk_on_its_rank(sp):
    fig = zigzag_figure(sp)
    cells = _cells(fig.data[0])
    assert sorted(cells.values()) == list(range(2 * sp))           # every chunk once
    for (rank, column), c in cells.items():
        assert column == c and c in chunk_ids(rank, sp)              # in token order, on its owner
    assert "no process ran" in fig.layout.title.text
    contiguous = _cells(zigzag_figure(sp, "contiguous").data[0])
    assert all(c in (2 * rank, 2 * rank + 1) for (rank, _), c in contiguous.items())


def test_chunk_colours_are_early_blue_late_orange_and_distinct():
    cols = chunk_colours(4)
    assert len(cols) == 8 and len(set(cols)) == 8
    blue = [int(c[4:-1].split(",")[2]) > int(c[4:-1].split(",")[0]) for c in cols]   # rgb(r, g, b): b > r
    assert blue == [True] * 4 + [False] * 4


def test_ring_cells_take_one_call_per_phase():
    events = _ring_events(4)
    first = ring_cells(events, "forward")
    assert sorted(first) == [(i, r) for i in range(4) for r in range(4)]
    assert first[(1, 0)]["holds"] == [3, 4] and first[(1, 0)]["end"] == pytest.approx(0.012)   # call 0
    assert ring_cells(events, "forward", call=1)[(1, 0)]["end"] == pytest.approx(0.014)
    flat = [e for rank in events for e in rank]                    # flat or per-rank lists alike
    assert ring_cells(flat, "backward") == ring_cells(events, "backward")
    with pytest.raises(ValueError, match="no forward events of call 2"):
        ring_cells(events, "forward", call=2)


@pytest.mark.parametrize("sp", [2, 3, 4])
def test_ring_figure_shows_the_recorded_holds_rotation_by_rotation(sp):
    events = _ring_events(sp)
    fig = ring_figure(events)
    assert "(recorded)" in fig.layout.title.text
    base, current = fig.data
    cells = _cells(base)                                            # all rotations: column 3i + j
    for rank in range(sp):
        for i in range(sp):
            held = [cells[(rank, 3 * i + j)] for j in range(2)]
            assert held == list(chunk_ids((rank - i) % sp, sp))
    assert [f.name for f in fig.frames] == [str(i) for i in range(sp)]
    for i, frame in enumerate(fig.frames):                         # a frame shows its rotation solid
        solid = _cells(frame.data[1])
        assert {x // 3 for _, x in solid} == {i} and len(solid) == 2 * sp
        hops = [a for a in frame.layout.annotations if a.showarrow]
        assert len(hops) == (sp if i < sp - 1 else 0)              # rank r -> r + 1, none after the last
    assert len(_cells(current)) == 2 * sp
    assert [s.label for s in fig.layout.sliders[0].steps] == [str(i) for i in range(sp)]
    assert "dK/dV" in ring_figure(events, "backward").layout.title.text


def test_ring_figure_hover_has_times_and_causal_relations():
    fig = ring_figure(_ring_events(2))
    hover = fig.data[0].customdata[0][0]                            # rank 0, rotation 0, its own chunk 0
    assert "compute 2.00 ms" in hover and "q0-k0: diagonal" in hover and "q3-k0: full" in hover


def test_ulysses_figure_grids_and_recorded_bytes():
    records = [{"op": "all_to_all", "axis": "sp", "bytes": 24576, "tag": "ulysses"},
               {"op": "all_to_all", "axis": "sp", "bytes": 8192, "tag": "ulysses"},
               {"op": "all_to_all", "axis": "sp", "bytes": 8192, "tag": "ulysses backward"},
               {"op": "all_reduce", "axis": "sp", "bytes": 4, "tag": "loss"}]
    fig = ulysses_figure(4, 8, 64, records=records)
    before, after = ([[int(v) for v in row] for row in t.z] for t in fig.data)
    assert before == [[0, 1, 2, 3]] * 8                              # each rank a quarter of the tokens, all heads
    assert after == [[h // 2] * 4 for h in range(8)]                 # all tokens, two heads each
    note = fig.layout.annotations[-1].text
    assert "2 all_to_all over sp in forward (32,768 B handed)" in note and "1 in backward (8,192 B)" in note
    zig = ulysses_figure(2, 2, 16, layout="zigzag")
    assert [int(v) for v in zig.data[0].z[0]] == [0, 1, 1, 0]
    with pytest.raises(ValueError, match="sp to divide the heads"):
        ulysses_figure(4, 6, 64)
    assert ulysses_bytes(4, 4, 64, 4, 8) == {"q, k, v to heads": 24576, "output to tokens": 8192}


def test_longest_fit_and_the_memory_figure():
    measured = {"ring": {64: 10, 128: 20, 256: 40}, "tp": {64: 20, 128: 40}, "one": {64: 50}, "all": {64: 1, 128: 2}}
    assert longest_fit(measured, 30) == {"ring": (128, False), "tp": (64, False), "one": (None, False),
                                         "all": (128, True)}
    fig = sequence_memory_figure(measured, budget=30)
    assert [t.name for t in fig.data] == list(measured)
    assert list(fig.data[0].customdata) == [10, 20, 40]              # bytes as measured
    assert fig.data[0].marker.color[-1] == "white"                   # over the budget: hollow
    assert fig.layout.shapes and "measured" in fig.layout.title.text
