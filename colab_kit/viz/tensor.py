"""Figures of tensor parallelism: which rank holds which block of a weight, and traffic.

    >>> fig = weight_owner_figure({"1d, tp=2": [[0, 0], [1, 1]]})
    >>> fig.data[0].type
    'heatmap'
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

__all__ = ["weight_owner_figure", "traffic_figure"]

_PALETTE = qualitative.Plotly + qualitative.D3


def _discrete_scale(n: int) -> list:
    """A colour scale that gives each integer 0..n-1 its own flat colour."""
    scale = []
    for k in range(n):
        c = _PALETTE[k % len(_PALETTE)]
        scale += [[k / n, c], [(k + 1) / n, c]]
    return scale


def weight_owner_figure(maps: dict, title: str = "Who holds each weight entry (measured with owner_map)",
                        cols: int = 2) -> go.Figure:
    """One heatmap per entry of ``maps`` (name -> ``[out, in]`` rank matrix), coloured by rank."""
    names = list(maps)
    rows = (len(names) + cols - 1) // cols
    fig = make_subplots(rows=rows, cols=min(cols, len(names)), subplot_titles=names,
                        horizontal_spacing=0.08, vertical_spacing=0.12)
    n = 1 + max(int(max(max(r) for r in m)) for m in (_as_list(v) for v in maps.values()))
    for k, name in enumerate(names):
        z = _as_list(maps[name])
        fig.add_heatmap(z=z, zmin=0, zmax=n, colorscale=_discrete_scale(n), showscale=False,
                        text=z, texttemplate="" if len(z) * len(z[0]) > 400 else "%{text}",
                        hovertemplate="out %{y}, in %{x}: rank %{z}<extra>" + name + "</extra>",
                        row=k // cols + 1, col=k % cols + 1)
    fig.update_yaxes(autorange="reversed", title_text="out feature")
    fig.update_xaxes(title_text="in feature")
    fig.update_layout(title=title, height=320 * rows, template="plotly_white")
    return fig


def traffic_figure(rows: list[dict], title: str = "One Linear's traffic per step: measured vs formula") -> go.Figure:
    """Grouped bars; each row ``{"name", "measured", "formula"}`` in bytes (forward + backward)."""
    fig = go.Figure()
    names = [r["name"] for r in rows]
    fig.add_bar(x=names, y=[r["measured"] for r in rows], name="measured (comm log)")
    fig.add_bar(x=names, y=[r["formula"] for r in rows], name="paper's formula")
    fig.update_layout(barmode="group", title=title, yaxis_title="bytes handed to collectives",
                      template="plotly_white", height=360)
    return fig


def _as_list(m):
    return m.tolist() if hasattr(m, "tolist") else m
