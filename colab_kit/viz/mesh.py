"""``mesh_figure(config, axis="tp")``: the device mesh as a plotly figure (data in, figure out).

One square per rank, placed by its coordinates: pipeline stages (``pp``) are
blocks left to right, data-parallel replicas (``dp``) are blocks top to bottom,
and inside a block ``sp`` stacks rows while the tensor block lies along a row.
For 2D/2.5D/3D tensor modes the tensor block is itself a grid:

=========  ==================================================================
``1d``     one row of ``tp`` squares
``2d``     a q x q grid (rows ``tp_row``, columns ``tp_col``)
``2.5d``   ``tp_dep`` q x q grids side by side
``3d``     ``tp_in`` q x q grids side by side (rows ``tp_wt``, columns ``tp_out``)
=========  ==================================================================

Squares are coloured by their group on ``axis``: one trace per group (its name
lists the ranks, ``customdata`` holds them), so the legend reads as the groups.
Worked example, ``ParallelConfig(dp=2, tp=2)`` coloured by ``tp``::

    dp 0:  [0][1]      trace "tp group 0: ranks 0, 1"  (colour A)
    dp 1:  [2][3]      trace "tp group 1: ranks 2, 3"  (colour B)

With ``axis="dp"`` the same squares are coloured by columns instead:
groups [0, 2] and [1, 3]. ``expert_mesh_figure(config)`` draws a config with ``ep > 1`` three times side
by side: by its dense groups (dp), by its ``ep`` groups and by its ``edp`` groups.
"""
from __future__ import annotations

from dataclasses import replace

import plotly.graph_objects as go

from ..config import Axis, ConfigError, ParallelConfig
from ..mesh import MeshLayout

__all__ = ["mesh_figure", "expert_mesh_figure", "cell_positions", "PALETTE"]

PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6",
           "#9D755D", "#BAB0AC", "#2F6B9A", "#C2571A", "#3D7A35", "#A8323E", "#4E8F8A", "#B89B1E")
_GAP = 0.6        # between pp / dp blocks
_SUB_GAP = 0.25   # between the q x q layers of 2.5d / 3d and between sp rows of a 2-D tensor block


def _tp_grid(layout: MeshLayout) -> tuple[str, str, str | None]:
    """(row axis, column axis, layer axis) of the tensor block; layers lie side by side."""
    mode = layout.config.tp_mode
    if mode == "2d":
        return Axis.TP_ROW, Axis.TP_COL, None
    if mode == "2.5d":
        return Axis.TP_ROW, Axis.TP_COL, Axis.TP_DEP
    if mode == "3d":
        return Axis.TP_WT, Axis.TP_OUT, Axis.TP_IN
    return "", Axis.TP, None


def cell_positions(layout: MeshLayout) -> dict[int, tuple[float, float]]:
    """rank -> (x, y) centre of its square; y grows downwards (rank 0 at the top left)."""
    cfg = layout.config
    row_ax, col_ax, layer_ax = _tp_grid(layout)
    rows_t = layout.size(row_ax) if row_ax else 1
    cols_t = layout.size(col_ax)
    layers = layout.size(layer_ax) if layer_ax else 1
    sp_gap = _SUB_GAP if rows_t > 1 else 0.0
    block_w = layers * cols_t + (layers - 1) * _SUB_GAP
    block_h = cfg.sp * rows_t + (cfg.sp - 1) * sp_gap
    pos = {}
    for rank in range(layout.world_size):
        c = layout.all_coords(rank)
        layer = c.get(layer_ax, 0) if layer_ax else 0
        x = c[Axis.PP] * (block_w + _GAP) + layer * (cols_t + _SUB_GAP) + c[col_ax]
        y = c[Axis.DP] * (block_h + _GAP) + c[Axis.SP] * (rows_t + sp_gap) + (c[row_ax] if row_ax else 0)
        pos[rank] = (x, y)
    return pos


def _label(layout: MeshLayout, rank: int, small: bool) -> tuple[str, str]:
    """(text in the square, hover text)."""
    coords = layout.all_coords(rank)
    shown = {a: v for a, v in coords.items() if layout.size(a) > 1}
    if any(a.startswith("tp_") for a in shown):  # the sub-axes say more than the flat tp index
        shown.pop(Axis.TP, None)
    hover = f"rank {rank}<br>" + ", ".join(f"{a} {v}" for a, v in coords.items())
    text = f"<b>{rank}</b>"
    if small and shown:  # one coordinate per line, so that the text stays inside its square
        text += "".join(f"<br><span style='font-size:8px'>{a} {v}</span>" for a, v in shown.items())
    return text, hover


def _panel(fig: go.Figure, layout: MeshLayout, axis: str, pos: dict, dx: float = 0.0) -> list[dict]:
    """The squares of one mesh drawing coloured by ``axis`` groups, shifted right by ``dx``: adds one trace per
    group to ``fig`` and returns the squares' shapes."""
    groups = layout.groups(axis)  # raises ValueError naming the axes this mesh has
    small = layout.world_size <= 32
    shapes = []
    for i, ranks in enumerate(groups):
        colour = PALETTE[i % len(PALETTE)]
        labels = [_label(layout, r, small) for r in ranks]
        fig.add_trace(go.Scatter(
            x=[pos[r][0] + dx for r in ranks], y=[pos[r][1] for r in ranks], mode="markers+text",
            marker=dict(symbol="square", size=38, color=colour, opacity=0.0),
            text=[t for t, _ in labels], hovertext=[h for _, h in labels], hoverinfo="text",
            textfont=dict(color="white", size=13), customdata=ranks,
            name=f"{axis} group {i}: ranks {', '.join(map(str, ranks))}", legendgroup=f"{axis}{i}"))
        shapes += [dict(type="rect", x0=pos[r][0] + dx - 0.45, x1=pos[r][0] + dx + 0.45, y0=pos[r][1] - 0.45,
                        y1=pos[r][1] + 0.45, fillcolor=colour, line=dict(color="white", width=1), layer="below",
                        name=f"rank {r}") for r in ranks]
    return shapes


MAX_DRAWN = 1024
"""Ranks a mesh figure draws at most: beyond, one square per rank is too dense to read and takes the browser
tens of seconds (4,096 ranks: 44 s); the same groups show on a smaller dp and pp (``_too_many``)."""


def _too_many(layout: MeshLayout) -> None:
    """Refuse a mesh of more than ``MAX_DRAWN`` ranks, naming a smaller one that shows the same groups."""
    cfg = layout.config
    if layout.world_size <= MAX_DRAWN:
        return
    try:  # (ep must still divide dp x sp)
        smaller: ParallelConfig | None = replace(cfg, dp=min(cfg.dp, 2), pp=min(cfg.pp, 2))
    except ConfigError:
        smaller = None
    hint = (f"draw {smaller.describe()} instead: every dp replica and pipeline stage holds the same groups on the "
            "other axes" if smaller is not None and MeshLayout(smaller).world_size <= MAX_DRAWN else
            "draw the same degrees with a smaller dp and pp: each replica and stage repeats the same groups")
    raise ValueError(f"{cfg.describe()}: more ranks than the {MAX_DRAWN} a mesh figure draws (a square each, "
                     f"too dense to read): {hint}")


def mesh_figure(config_or_layout: ParallelConfig | MeshLayout, axis: str = Axis.TP) -> go.Figure:
    """The device mesh, one square per rank, coloured by its group on ``axis`` (at most ``MAX_DRAWN`` ranks)."""
    layout = config_or_layout if isinstance(config_or_layout, MeshLayout) else MeshLayout(config_or_layout)
    _too_many(layout)
    cfg = layout.config
    groups = layout.groups(axis)  # raises ValueError naming the axes this mesh has
    pos = cell_positions(layout)
    fig = go.Figure()
    shapes = _panel(fig, layout, axis, pos)
    _block_titles(fig, layout, pos)
    width = max(x for x, _ in pos.values()) + 1
    height = max(y for _, y in pos.values()) + 1
    fig.update_layout(
        shapes=shapes,
        title=f"{cfg.describe()}: coloured by {axis} group ({len(groups)} groups of {layout.size(axis)})",
        xaxis=dict(visible=False, range=[-1.6 if cfg.dp > 1 else -0.8, width - 0.2]),
        yaxis=dict(visible=False, autorange="reversed", scaleanchor="x", range=[height - 0.2, -1.0]),
        plot_bgcolor="white", showlegend=len(groups) <= 16,
        width=int(min(1100, 160 + 70 * width + (260 if len(groups) <= 16 else 0))),
        height=int(min(900, 140 + 70 * (height + 1))), margin=dict(l=60, r=20, t=60, b=20))
    return fig


def expert_mesh_figure(config_or_layout: ParallelConfig | MeshLayout, dense: str = Axis.DP) -> go.Figure:
    """The same mesh drawn three times side by side: coloured by the ``dense`` axis's groups, by the ``ep``
    groups (ranks that exchange tokens by all-to-all, each holding ``n_experts / ep`` experts) and by the
    ``edp`` groups (ranks holding the same experts, whose gradients are summed).

    Worked example, ``ParallelConfig(dp=4, ep=2)``::

        dp groups        ep groups           edp groups
        [0][1][2][3]     [0][1] [2][3]       [0][2] [1][3]
        (one group)      (colours A, B)      (colours A, B)

    A config without experts split (``ep=1``) is a ``ConfigError``: ``mesh_figure`` draws it.
    """
    layout = config_or_layout if isinstance(config_or_layout, MeshLayout) else MeshLayout(config_or_layout)
    _too_many(layout)
    cfg = layout.config
    if layout.ep <= 1:
        raise ConfigError(f"{cfg.describe()} does not split the experts (ep=1), so it has no ep or edp groups: "
                          "draw it with mesh_figure(config, axis), or set ep (a divisor of dp x sp) above 1")
    pos = cell_positions(layout)
    width = max(x for x, _ in pos.values()) + 1
    height = max(y for _, y in pos.values()) + 1
    fig, shapes = go.Figure(), []
    roles: dict[str, str] = {Axis.EP: "experts split (all-to-all)", Axis.EDP: "same experts (grads summed)"}
    for i, axis in enumerate((dense, Axis.EP, Axis.EDP)):
        dx = i * (width + 1.2)
        shapes += _panel(fig, layout, axis, pos, dx)
        what = roles.get(axis, "dense")
        fig.add_annotation(x=dx + (width - 1) / 2, y=-0.8, text=f"<b>{axis}</b> groups: {what}", showarrow=False)
    total = 3 * width + 2.4
    fig.update_layout(
        shapes=shapes, title=f"{cfg.describe()}: {dense} groups beside the expert groups (ep, edp)",
        xaxis=dict(visible=False, range=[-0.8, total - 0.2]),
        yaxis=dict(visible=False, autorange="reversed", scaleanchor="x", range=[height - 0.2, -1.2]),
        plot_bgcolor="white", showlegend=len(fig.data) <= 16,
        width=int(min(1100, 120 + 55 * total + (260 if len(fig.data) <= 16 else 0))),
        height=int(min(900, 140 + 70 * (height + 1))), margin=dict(l=20, r=20, t=60, b=20))
    return fig


def _block_titles(fig: go.Figure, layout: MeshLayout, pos: dict) -> None:
    """'stage i' above each pipeline block and 'dp j' left of each replica row, when > 1."""
    cfg = layout.config
    if cfg.pp > 1:
        for s in range(cfg.pp):
            xs = [pos[r][0] for r in range(layout.world_size) if layout.coords(r)[Axis.PP] == s]
            fig.add_annotation(x=(min(xs) + max(xs)) / 2, y=-0.75, text=f"pp stage {s}", showarrow=False)
    if cfg.dp > 1:
        for d in range(cfg.dp):
            ys = [pos[r][1] for r in range(layout.world_size) if layout.coords(r)[Axis.DP] == d]
            fig.add_annotation(x=-0.55, y=(min(ys) + max(ys)) / 2, text=f"dp {d}", showarrow=False,
                               xanchor="right")
