"""Figures of what the engine recorded: loss per step, memory per rank, step timeline.

Each builder takes plain data gathered from the ranks (lists and dicts), so it
works the same on a live cluster's results, a saved report or a test fixture::

    >>> fig = memory_figure([{"params": 400, "grads": 400, "optimizer": 800, "activations": 300}] * 2)
    >>> [trace.name for trace in fig.data]
    ['params', 'grads', 'optimizer', 'activations']
"""
from __future__ import annotations

import plotly.graph_objects as go

from .memory import memory_by_rank_figure

__all__ = ["loss_figure", "memory_figure", "timeline_figure", "accuracy_figure", "recipe_figure"]

_KIND_COLOURS = {"compute": "#4c78a8", "comm": "#f58518", "idle": "#d3d3d3"}


def loss_figure(losses, title: str = "Training loss (measured)", reference=None) -> go.Figure:
    """Loss per step; ``losses`` is a list, or a dict of name -> list for several runs.

    ``reference`` (optional list) is drawn dashed, e.g. a single-process run.
    """
    runs = losses if isinstance(losses, dict) else {"loss": losses}
    fig = go.Figure()
    for name, values in runs.items():
        fig.add_scatter(x=list(range(1, len(values) + 1)), y=list(values), mode="lines+markers", name=str(name))
    if reference is not None:
        fig.add_scatter(x=list(range(1, len(reference) + 1)), y=list(reference), mode="lines",
                        name="single process", line={"dash": "dash"})
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="mean token cross-entropy",
                      template="plotly_white", height=360)
    return fig


def recipe_figure(records, max_grad_norm: float | None = None, lrs=None,
                  title: str = "Gradient norm and learning rate (measured)") -> go.Figure:
    """What the recipe did each step, from ``engine.records``: the global gradient norm before clipping
    (``"grad_norm"``), the clipping threshold ``max_grad_norm`` dotted (norms above it were scaled down to
    it), and ``lrs`` (the learning rate of each step) on a second axis.

    >>> fig = recipe_figure([{"step": 1, "grad_norm": 3.0}, {"step": 2, "grad_norm": 0.5}], 1.0, [1e-3, 2e-3])
    >>> [t.name for t in fig.data]
    ['gradient norm (before clipping)', 'max_grad_norm', 'learning rate']
    """
    steps = [r["step"] for r in records]
    fig = go.Figure()
    fig.add_scatter(x=steps, y=[r.get("grad_norm") for r in records], mode="lines+markers",
                    name="gradient norm (before clipping)")
    if max_grad_norm is not None and steps:
        fig.add_scatter(x=[steps[0], steps[-1]], y=[max_grad_norm] * 2, mode="lines", name="max_grad_norm",
                        line={"dash": "dot", "color": "grey"})
    if lrs is not None:
        fig.add_scatter(x=steps, y=list(lrs), mode="lines", name="learning rate", yaxis="y2")
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="global gradient norm", template="plotly_white",
                      height=360, yaxis2={"title": "learning rate", "overlaying": "y", "side": "right"})
    return fig


def accuracy_figure(curves: dict, title: str = "Held-out accuracy (measured)",
                    chance: float | None = None) -> go.Figure:
    """Accuracy against the step for several runs: ``curves`` maps a name to ``[(step, accuracy), ...]``;
    ``chance`` (optional) is drawn as a dotted line.

    >>> [t.name for t in accuracy_figure({"2d": [(10, 0.2), (20, 0.4)]}, chance=0.1).data]
    ['2d', 'chance']
    """
    fig = go.Figure()
    for name, points in curves.items():
        fig.add_scatter(x=[s for s, _ in points], y=[a for _, a in points], mode="lines+markers", name=str(name))
    if chance is not None and curves:
        steps = [s for points in curves.values() for s, _ in points]
        fig.add_scatter(x=[min(steps), max(steps)], y=[chance, chance], mode="lines", name="chance",
                        line={"dash": "dot", "color": "grey"})
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="accuracy", yaxis_range=[0, 1],
                      template="plotly_white")
    return fig


def memory_figure(per_rank: list[dict], title: str = "Memory per rank (measured)") -> go.Figure:
    """Stacked bars: one bar per rank, one segment per category (bytes shown as MiB, hover in bytes).

    The measured half of ``viz.memory.memory_by_rank_figure`` (which adds the estimate, places, a budget).
    """
    return memory_by_rank_figure(per_rank, title=title)


def timeline_figure(per_rank: list[list[dict]], title: str = "Last step per rank (measured)") -> go.Figure:
    """Gantt chart of each rank's events (``name``, ``kind``, ``start``, ``end`` in seconds).

    Overlapping events (a bucket all-reduce during backward) are drawn on a second
    lane of the rank so that both stay visible.
    """
    fig = go.Figure()
    shown = set()
    for rank, events in enumerate(per_rank):
        for e in events:
            lane = f"rank {rank}" + (" comm" if e["kind"] == "comm" else "")
            fig.add_bar(x=[(e["end"] - e["start"]) * 1e3], base=[e["start"] * 1e3], y=[lane], orientation="h",
                        marker_color=_KIND_COLOURS.get(e["kind"], "#999"), name=e["kind"],
                        legendgroup=e["kind"], showlegend=e["kind"] not in shown,
                        hovertemplate=f"{e['name']}<br>%{{base:.2f}} ms + %{{x:.2f}} ms<extra>{lane}</extra>")
            shown.add(e["kind"])
    fig.update_layout(barmode="overlay", title=title, xaxis_title="ms since step start", template="plotly_white",
                      height=120 + 40 * max(1, len(per_rank)), yaxis={"autorange": "reversed"})
    return fig
