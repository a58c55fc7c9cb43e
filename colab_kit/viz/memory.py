"""Memory per rank: the measured bytes beside the estimate, by category or by place.

The data are the dicts of ``engine.memory()`` and ``engine.memory_estimate()`` gathered
from every rank (``{"params", "grads", "optimizer", "activations", "device": {...},
"host": {...}}``, bytes); nothing is computed here but the MiB of the axis::

    >>> measured = [{"params": 400, "grads": 400, "optimizer": 800, "activations": 300,
    ...              "device": {"params": 400, "grads": 400, "optimizer": 0, "activations": 300},
    ...              "host": {"params": 0, "grads": 0, "optimizer": 800, "activations": 0}}] * 2
    >>> fig = memory_by_rank_figure(measured, estimated=measured, budget=1024)
    >>> [t.name for t in fig.data][:5]
    ['params', 'grads', 'optimizer', 'activations', 'params (estimated)']
    >>> list(fig.data[2].customdata), list(fig.data[2].x[1])      # bytes as given, per (rank, kind)
    ([800, 800], ['measured', 'measured'])
    >>> [t.name for t in memory_by_rank_figure(measured, by="place").data]
    ['device', 'host']
    >>> fig.layout.shapes[0].name                                  # the dashed line at the budget
    'device budget'

Each rank gets a stacked bar of what was measured and, when an estimate is given, a
paler hatched bar beside it labelled "estimated" (x axis: rank, then measured /
estimated). ``by="place"`` stacks what lives on the device under what lives on the host,
so the device segment can be read against the budget line directly; in ``by="category"``
the stack is the total (device + host), and the line still marks the device budget.
"""
from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

__all__ = ["memory_by_rank_figure", "CATEGORIES", "PLACES", "segments"]

CATEGORIES = ("params", "grads", "optimizer", "activations")
PLACES = ("device", "host")
COLOURS = {"params": "#4c78a8", "grads": "#f58518", "optimizer": "#54a24b", "activations": "#e45756",
           "device": "#4c78a8", "host": "#9ecae9"}
MIB = 2**20


def segments(per_rank: Sequence[dict | None], by: str = "category") -> dict[str, list[int | None]]:
    """Segment name -> bytes per rank (None where a rank has no dict), in stacking order.

    by="category": the four categories, then any other number the dicts hold (sorted);
    by="place": "device" and "host", each the sum of that place's categories.

        >>> segments([{"params": 4, "grads": 0, "device": {"params": 4}, "host": {"params": 0}}], "place")
        {'device': [4], 'host': [0]}
    """
    if by not in ("category", "place"):
        raise ValueError(f"by={by!r}: choose 'category' or 'place'")
    rows = [m for m in per_rank if m is not None]
    if by == "place":
        lacking = [i for i, m in enumerate(per_rank) if m is not None and not all(p in m for p in PLACES)]
        if lacking:
            raise ValueError(f"by='place' needs 'device' and 'host' in every dict; rank {lacking[0]} has "
                             f"only {sorted(per_rank[lacking[0]] or {})}")
        return {p: [None if m is None else int(sum(m[p].values())) for m in per_rank] for p in PLACES}
    names = [c for c in CATEGORIES if any(c in m for m in rows)]
    names += sorted({k for m in rows for k, v in m.items() if isinstance(v, (int, float))} - set(names))
    return {c: [None if m is None else m.get(c, 0) for m in per_rank] for c in names}


def memory_by_rank_figure(measured: list[dict], estimated: list[dict | None] | None = None,
                          budget: int | None = None, by: str = "category", title: str | None = None,
                          labels: list[str] | None = None) -> go.Figure:
    """Stacked bars per rank (MiB; hover: bytes), the estimate beside the measurement, a budget line.

    measured: ``engine.memory()`` of each rank, in rank order.
    estimated: ``engine.memory_estimate()`` of each rank (None: no estimate bars; a None
        entry: none for that rank).
    budget: the device budget in bytes, drawn as a dashed horizontal line ("device budget").
    by: "category" (params, grads, optimizer, activations) or "place" (device, host).
    labels: a name per bar instead of "rank r" (e.g. one rank's memory under several configs).
    """
    kinds = [("measured", measured)] + ([("estimated", estimated)] if estimated is not None else [])
    if estimated is not None and len(estimated) != len(measured):
        raise ValueError(f"{len(measured)} measured ranks but {len(estimated)} estimates: give one per rank")
    fig = go.Figure()
    for kind, rows in kinds:
        est = kind == "estimated"
        for name, values in segments(rows, by).items():
            present = [(r, v) for r, v in enumerate(values) if v is not None]
            ranks = [r for r, _ in present]
            names = [labels[r] if labels else f"rank {r}" for r in ranks]
            x = names if estimated is None else [names, [kind] * len(ranks)]
            label = f"{name} (estimated)" if est else name
            fig.add_bar(x=x, y=[v / MIB for _, v in present], customdata=[v for _, v in present],
                        name=label, legendgroup=kind, legendgrouptitle_text=kind,
                        marker={"color": COLOURS.get(name), "opacity": 0.5 if est else 1.0,
                                "pattern": {"shape": "/" if est else ""}},
                        hovertemplate=f"{label}: %{{customdata:,}} B (%{{y:.3f}} MiB)<extra>%{{x}}</extra>")
    if budget is not None:
        fig.add_hline(y=budget / MIB, line_dash="dash", line_color="#b00020", name="device budget",
                      annotation_text=f"device budget {budget:,} B ({budget / MIB:.2f} MiB)",
                      annotation_position="top left", annotation_font_color="#b00020")
    if title is None:
        title = f"Memory per rank{' by place' if by == 'place' else ''} (measured" \
                + (", beside the estimate)" if estimated is not None else ")")
    fig.update_layout(barmode="stack", title=title, yaxis_title="MiB", template="plotly_white", height=420,
                      legend={"groupclick": "toggleitem"})
    return fig
