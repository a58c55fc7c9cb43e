"""Figures of pipeline schedules: the plan's grid, activations held, bubble fractions.

Data in, ``go.Figure`` out. What is planned says so (title, legend); what the engine
recorded says "measured". The cells come from ``viz.schedule_data``::

    >>> from colab_kit.pipeline import build_plan, simulate
    >>> fig = schedule_figure(build_plan("1f1b", 2, 2))            # timestep x rank grid (planned)
    >>> [(t.name, t.meta) for t in fig.data]
    [('F forward', 'planned'), ('B backward', 'planned')]
    >>> fig = schedule_figure(build_plan("1f1b", 2, 2), executed={"0F0", "0F1", "1F0"}, current={"1B0"})
    >>> for t in fig.data: print(f"{t.name:11} {t.meta:21} {' '.join(t.text)}")
    B backward  current               1B0
    F forward   executed              0F0 0F1 1F0
    F forward   planned, not run yet  1F1
    B backward  planned, not run yet  0B0 1B1 0B1

``schedule_figure(simulate(plan))`` draws the same plan in time (B twice as long as F), and
``schedule_figure([engine.timeline() of each rank])`` the measured step, idle gaps included.
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .schedule_data import action_set, cells, held_series

__all__ = ["schedule_figure", "activation_memory_figure", "bubble_figure", "activation_peaks_figure",
           "KIND_COLOURS", "KIND_NAMES"]

KIND_COLOURS = {"F": "#4C78A8", "B": "#54A24B", "I": "#F58518", "W": "#B279A2", "SF": "#9D9D9D",
                "RF": "#9D9D9D", "SB": "#BAB0AC", "RB": "#BAB0AC", "compute": "#5D4E7B", "comm": "#F2A65A",
                "idle": "#E8E8E8"}
KIND_NAMES = {"F": "F forward", "B": "B backward", "I": "I input grad", "W": "W weight grad", "SF": "SF send act",
              "RF": "RF recv act", "SB": "SB send grad", "RB": "RB recv grad", "compute": "compute",
              "comm": "communication", "idle": "idle"}
_COMM = ("SF", "RF", "SB", "RB", "comm")
_SCHEDULE_COLOURS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2")


def _shade(colour: str, mix: float) -> str:
    """``colour`` mixed with white by ``mix`` (0 = as is)."""
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in (r, g, b))


def _title_of(source, what: str, marked: bool) -> str:
    if what == "measured":
        return "Last step per rank (measured; idle = gaps between recorded events)"
    plan = source if what == "plan" else source.plan
    shape = f"{plan.schedule}, pp={plan.pp}, microbatches={plan.microbatches}" + (
        f", chunks={plan.chunks}" if plan.chunks > 1 else "")
    if what == "timeline":
        return f"{shape}: planned timeline (simulated), bubble {source.bubble_fraction:.1%}"
    if marked:
        return f"{shape}: executed (solid), planned and not run yet (pale), each rank's next action (outlined)"
    return f"{shape}: planned timestep x rank grid" + (" (with sends and receives)" if plan.lowered else "")


def schedule_figure(source, executed=None, current=None, title: str | None = None,
                    row_name: str = "rank") -> go.Figure:
    """One box per action on its rank's row, labelled in compact form, coloured by kind.

    ``source``: a PipelinePlan (timestep grid), a Timeline from ``simulate`` (time), or a list of
    per-rank event lists from ``engine.timeline()`` (measured, ms). Microbatches are shaded
    lighter as they go. With ``executed`` (actions, compact forms or ``(rank, index)``
    pairs; see ``schedule_data.action_set``), the cells already run are solid and the rest
    pale, ``current`` cells (each rank's next action) get a thick outline. One bar trace per
    (kind, state): ``name`` is the kind, ``meta`` the state ("planned", "executed",
    "planned, not run yet", "current" or "measured"), ``customdata`` [rank, index, label].
    """
    items, what = cells(source)
    plan = source if what == "plan" else getattr(source, "plan", None)
    marked = executed is not None or current is not None
    done, now = action_set(executed, plan), action_set(current, plan)
    m = plan.microbatches if plan is not None else 1 + max((c.microbatch or 0 for c in items), default=0)
    groups: dict[tuple[str, str], list] = {}
    for c in items:
        state = "planned" if what != "measured" else "measured"
        if marked and c.label in now:
            state = "current"
        elif marked:
            state = "executed" if c.label in done else "planned, not run yet"
        groups.setdefault((c.kind, state), []).append(c)
    order = list(KIND_COLOURS)
    states = ["current", "executed", "planned", "planned, not run yet", "measured"]
    fig, legend = go.Figure(), set()
    for (kind, state), group in sorted(groups.items(), key=lambda kv: (states.index(kv[0][1]),
                                                                     order.index(kv[0][0]))):
        base = KIND_COLOURS.get(kind, "#999999")
        colours = [_shade(base, 0.45 * min(c.microbatch or 0, m - 1) / max(m - 1, 1)) for c in group]
        pale = state == "planned, not run yet"
        lanes = [f"{row_name} {c.rank}" + (" (async)" if c.lane else "") for c in group]
        fig.add_bar(
            x=[c.end - c.start for c in group], base=[c.start for c in group], y=lanes, orientation="h",
            width=0.45 if kind in _COMM else 0.85, text=[c.label if kind != "idle" else "" for c in group],
            textposition="inside", insidetextanchor="middle", textangle=0,
            textfont=dict(size=10, color="#555555" if pale or kind in _COMM + ("idle",) else "white"),
            marker=dict(color=colours, opacity=0.3 if pale else 1.0,
                        line=dict(color="black" if state == "current" else "white",
                                  width=3 if state == "current" else 0.5)),
            customdata=[[c.rank, c.index, c.label] for c in group],
            hovertemplate=f"%{{customdata[2]}} ({state})<br>from %{{base:.3g}}, lasts %{{x:.3g}}<extra>%{{y}}</extra>",
            name=KIND_NAMES.get(kind, kind), legendgroup=kind, showlegend=kind not in legend, meta=state)
        legend.add(kind)
    n_rows = len({(c.rank, c.lane) for c in items}) or 1
    span = max((c.end for c in items), default=1)
    xtitle = {"plan": "timestep (lockstep: each rank runs its next action once its inputs are ready)",
              "timeline": "planned time (F=1, B=2, I=1, W=1 units; sends and receives take 0)",
              "measured": "ms since the step began on that rank"}[what]
    fig.update_layout(
        barmode="overlay", title=title or _title_of(source, what, marked), template="plotly_white",
        xaxis=dict(title=xtitle, range=[0, span]), uniformtext=dict(minsize=7, mode="hide"),
        yaxis=dict(autorange="reversed", type="category",
                   categoryorder="array", categoryarray=sorted({f"{row_name} {c.rank}" + (" (async)" if c.lane else "")
                                                                for c in items}, key=_row_key)),
        height=150 + 45 * n_rows,
        width=min(1000, max(700, 24 * span if what == "plan" else 900)),  # fits JupyterLab's output area
        legend=dict(orientation="h", y=-0.25), margin=dict(l=70, r=20, t=60, b=40))
    return fig


def _row_key(label: str):
    words = label.split()
    return int(words[1]), len(words)


def activation_memory_figure(source, measured=None, frees: tuple[str, ...] = ("B", "W"),
                             title: str | None = None) -> go.Figure:
    """Per rank, how many microbatch activations it holds over the step.

    Planned lines come from ``held_series(source)`` (a PipelinePlan: x = timesteps done; a
    Timeline: x = planned time). ``measured``: per rank, ``[(x, held), ...]`` as recorded
    by the engine (``ScheduleStepper`` samples ``engine.pipeline.state()["held"]``), a list
    by rank or a dict rank -> samples; drawn as markers only (nothing is known between samples).
    """
    fig = go.Figure()
    for r, (x, y) in enumerate(held_series(source, frees)):
        colour = _SCHEDULE_COLOURS[r % len(_SCHEDULE_COLOURS)]
        fig.add_scatter(x=x, y=y, mode="lines", line=dict(shape="hv", color=colour, dash="dot" if measured else None),
                        name=f"rank {r} (planned)", legendgroup=f"r{r}")
    samples = measured.items() if isinstance(measured, dict) else enumerate(measured or [])
    for r, points in samples:
        if not points:
            continue
        colour = _SCHEDULE_COLOURS[r % len(_SCHEDULE_COLOURS)]
        fig.add_scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="markers",
                        marker=dict(size=8, color=colour), name=f"rank {r} (measured)",
                        legendgroup=f"r{r}")
    plan = source if hasattr(source, "actions") else source.plan
    timeline = hasattr(source, "events")
    fig.update_layout(
        title=title or (f"Activations held per rank, {plan.schedule} pp={plan.pp} m={plan.microbatches}"
                        + (" (measured on the engine vs planned)" if measured else " (planned)")),
        xaxis_title="planned time units" if timeline else "timesteps done",
        yaxis_title="microbatch activations held", template="plotly_white", height=340)
    return fig


def bubble_figure(rows, pp: int | None = None, microbatches: int | None = None,
                  title: str | None = None) -> go.Figure:
    """Bubble fraction per schedule: planned (simulated) and measured bars, textbook line.

    ``rows``: dicts with ``schedule``, ``planned`` and optionally ``measured`` and ``theory``
    (that schedule's own formula, drawn as a diamond). With ``pp`` and ``microbatches`` the
    textbook GPipe/1F1B bubble (p-1)/(m+p-1) is drawn as a dashed line.
    """
    names = [r["schedule"] for r in rows]
    fig = go.Figure()
    fig.add_bar(x=names, y=[r["planned"] for r in rows], name="planned (simulated)", marker_color="#9ecae1",
                text=[f"{r['planned']:.1%}" for r in rows], textposition="outside")
    if any(r.get("measured") is not None for r in rows):
        fig.add_bar(x=names, y=[r.get("measured") for r in rows], name="measured on the engine",
                    marker_color="#08519c", text=[f"{r['measured']:.1%}" if r.get("measured") is not None
                                                  else "" for r in rows], textposition="outside")
    if any("theory" in r for r in rows):
        fig.add_scatter(x=names, y=[r.get("theory") for r in rows], mode="markers", name="formula of the schedule",
                        marker=dict(symbol="diamond", size=11, color="black"))
    if pp and microbatches:
        book = (pp - 1) / (microbatches + pp - 1)
        fig.add_hline(y=book, line_dash="dash", line_color="#e45756")
        fig.add_scatter(x=[None], y=[None], mode="lines", line=dict(dash="dash", color="#e45756"),
                        name=f"textbook (p-1)/(m+p-1) = {book:.1%}")  # the line's legend entry
    fig.update_layout(barmode="group", title=title or "Pipeline bubble: idle share of rank time",
                      yaxis=dict(title="bubble fraction", tickformat=".0%", rangemode="tozero"),
                      template="plotly_white", height=380)
    return fig


def activation_peaks_figure(rows, title: str | None = None) -> go.Figure:
    """Peak activations per rank and schedule: planned (microbatches held) beside measured (MiB).

    ``rows``: dicts with ``schedule``, ``planned`` (per rank counts) and optionally
    ``measured`` (per rank peak activation bytes, e.g. ``engine.memory()["activations"]``).
    """
    has_measured = any(r.get("measured") for r in rows)
    fig = make_subplots(rows=1, cols=2 if has_measured else 1, subplot_titles=(
        "planned: microbatch activations held at once", "measured: peak activation MiB")[:2 if has_measured else 1])
    for i, r in enumerate(rows):
        colour = _SCHEDULE_COLOURS[i % len(_SCHEDULE_COLOURS)]
        ranks = [f"rank {k}" for k in range(len(r["planned"]))]
        fig.add_bar(x=ranks, y=list(r["planned"]), name=r["schedule"], marker_color=colour, legendgroup=r["schedule"],
                    row=1, col=1)
        if has_measured and r.get("measured"):
            fig.add_bar(x=ranks, y=[b / 2**20 for b in r["measured"]], name=r["schedule"], marker_color=colour,
                        legendgroup=r["schedule"], showlegend=False, row=1, col=2)
    fig.update_layout(barmode="group", title=title or "Activation memory per pipeline rank",
                      template="plotly_white", height=360)
    return fig
