"""The planner's candidates drawn: estimated memory per rank against estimated step time.

Everything here is a plan (``ck.plan``'s estimates), and the figures say so; the one figure
that shows runs (``plan_vs_measured_figure``) labels each bar estimated or measured. The data
are the candidates as ``ck.plan`` returns them (anything with ``.config``, ``.memory``,
``.step_seconds``, ``.fits`` and ``.why``), nothing is computed but the units::

    >>> from types import SimpleNamespace as C
    >>> from colab_kit.config import ParallelConfig
    >>> mem = lambda mib: {"params": mib * MIB, "grads": 0, "optimizer": 0, "activations": 0,
    ...                    "device": {"params": mib * MIB}, "host": {"params": 0}}
    >>> cands = [C(config=ParallelConfig(dp=4), memory=mem(3), step_seconds=0.020, fits=True, why="compute"),
    ...          C(config=ParallelConfig(tp=4), memory=mem(9), step_seconds=0.030, fits=False, why="tp all-reduce")]
    >>> fig = plan_figure(cands, memory_per_rank=8 * MIB)
    >>> [(t.name, list(t.x), list(t.y), list(t.customdata)) for t in fig.data]
    [('fits', [20.0], [3.0], [0]), ('does not fit', [30.0], [9.0], [1])]
    >>> fig.layout.shapes[0].name, fig.layout.title.text.startswith("Planned")
    ('memory per rank', True)
    >>> config_words(ParallelConfig(dp=2, pp=2, microbatches=4, zero=1))
    'dp=2 pp=2 zero=1 microbatches=4'

x is the estimated step time in milliseconds, y the estimated bytes a rank holds on its device
(``memory["device"]``, the part a memory budget limits; the four categories' sum where a
candidate gives no places), in MiB. The marker's ``customdata`` is the candidate's index in the
list, so a click on a point names the candidate (``widgets.PlannerView`` uses it).
"""
from __future__ import annotations

import dataclasses

import plotly.graph_objects as go

from .memory import CATEGORIES, MIB
from ..planner.cluster.tp_traffic import block_wire_bytes, mode_sizes

__all__ = ["plan_figure", "plan_vs_measured_figure", "config_words", "device_bytes"]

FIT_COLOUR, MISS_COLOUR, CHOSEN_COLOUR = "#4c78a8", "#b00020", "#f58518"


def config_words(config) -> str:
    """The fields that differ from the defaults, as ``%colossal config`` reads them (``dp=2 tp=2 zero=1``)."""
    default = type(config)()
    words = [f"{f.name}={getattr(config, f.name)}".replace("True", "true").replace("False", "false")
             for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(default, f.name)]
    return " ".join(words) or "dp=1"


def device_bytes(memory: dict) -> int:
    """Bytes a rank holds on its device: ``memory["device"]`` (a dict by category, or a number),
    else the sum of the four categories."""
    device = memory.get("device")
    if isinstance(device, dict):
        return int(sum(device.values()))
    if isinstance(device, (int, float)):
        return int(device)
    return int(sum(memory.get(c, 0) for c in CATEGORIES))


def _hover(c) -> str:
    m = c.memory
    parts = " · ".join(f"{k} {m.get(k, 0) / MIB:.2f}" for k in CATEGORIES)
    host = m.get("host")
    host = sum(host.values()) if isinstance(host, dict) else (host or 0)
    return (f"<b>{config_words(c.config)}</b><br>{c.config.describe()}<br>"
            f"estimated step {c.step_seconds * 1e3:.2f} ms · device {device_bytes(m) / MIB:.2f} MiB"
            + (f" · host {host / MIB:.2f} MiB" if host else "")
            + f"<br>MiB: {parts}<br>{'fits' if c.fits else 'does not fit'}: {c.why}")


def plan_figure(candidates, memory_per_rank: int | None = None, chosen: int | None = None,
                title: str | None = None) -> go.Figure:
    """One marker per candidate: estimated step time (ms) against estimated device MiB per rank.

    candidates: ``ck.plan``'s list (best first), or any list of objects with its attributes.
    memory_per_rank: bytes; a dashed line is drawn there ("memory per rank").
    chosen: the index of a candidate to ring (the one a widget has selected).
    Candidates that fit are blue circles, those that do not are red crosses (their own trace,
    "does not fit"); hover shows the config, the categories in MiB, the estimate and ``why``.
    """
    candidates = list(candidates)
    fig = go.Figure()
    for name, fits, symbol, colour in (("fits", True, "circle", FIT_COLOUR),
                                       ("does not fit", False, "x", MISS_COLOUR)):
        idx = [i for i, c in enumerate(candidates) if bool(c.fits) is fits]
        if not idx:
            continue
        fig.add_scatter(x=[candidates[i].step_seconds * 1e3 for i in idx],
                        y=[device_bytes(candidates[i].memory) / MIB for i in idx],
                        customdata=idx, mode="markers", name=name,
                        marker={"symbol": symbol, "size": 11, "color": colour, "line": {"width": 1}},
                        text=[_hover(candidates[i]) for i in idx], hovertemplate="%{text}<extra>#%{customdata}</extra>")
    if chosen is not None:
        if not 0 <= chosen < len(candidates):
            raise ValueError(f"chosen={chosen}: there are {len(candidates)} candidates (0..{len(candidates) - 1})")
        c = candidates[chosen]
        fig.add_scatter(x=[c.step_seconds * 1e3], y=[device_bytes(c.memory) / MIB], customdata=[chosen],
                        mode="markers", name="chosen", hoverinfo="skip",
                        marker={"symbol": "circle-open", "size": 22, "color": CHOSEN_COLOUR, "line": {"width": 3}})
    if memory_per_rank is not None:
        fig.add_hline(y=memory_per_rank / MIB, line_dash="dash", line_color=MISS_COLOUR, name="memory per rank",
                      annotation_text=f"memory per rank {memory_per_rank / MIB:.2f} MiB",
                      annotation_position="top left", annotation_font_color=MISS_COLOUR)
    fig.update_layout(title=title or f"Planned (estimated, not run): memory per rank vs step time, "
                                     f"{len(candidates)} candidates",
                      xaxis_title="estimated step time (ms)", yaxis_title="estimated device MiB per rank",
                      template="plotly_white", height=420, hovermode="closest")
    return fig


def plan_vs_measured_figure(rows: list[dict], title: str | None = None) -> go.Figure:
    """Estimated beside measured, per config: device MiB per rank (left) and step ms (right).

    rows: one dict per config, ``{"label", "estimated_bytes", "measured_bytes", "estimated_seconds",
    "measured_seconds"}`` (a measured value None: that bar is left out). Estimated bars are hatched.
    """
    from plotly.subplots import make_subplots

    for r in rows:
        missing = {"label", "estimated_bytes", "measured_bytes", "estimated_seconds", "measured_seconds"} - set(r)
        if missing:
            raise ValueError(f"row {r.get('label', r)!r} lacks {sorted(missing)}")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("device MiB per rank", "step time (ms)"))
    labels = [r["label"] for r in rows]
    for kind, est in (("estimated", True), ("measured", False)):
        style = {"color": FIT_COLOUR if est else CHOSEN_COLOUR, "opacity": 0.55 if est else 1.0,
                 "pattern": {"shape": "/" if est else ""}}
        for col, key, scale in ((1, "bytes", 1 / MIB), (2, "seconds", 1e3)):
            vals = [r[f"{kind}_{key}"] for r in rows]
            fig.add_bar(x=[x for x, v in zip(labels, vals) if v is not None],
                        y=[v * scale for v in vals if v is not None], name=kind, legendgroup=kind,
                        showlegend=col == 1, marker=style, row=1, col=col,
                        hovertemplate=f"{kind}: %{{y:.3f}}<extra>%{{x}}</extra>")
    fig.update_layout(barmode="group", template="plotly_white", height=420,
                      title=title or "Planned (estimated) beside measured, per config")
    return fig


def tp_scaling_figure(model, rows: int, ranks=(4, 8, 16, 27, 32, 64, 128, 216, 256, 512), depth: int = 2,
                      title: str | None = None) -> go.Figure:
    """Planned, not run: MiB one rank sends for one block of ``model`` under each tensor mode, by group size.

    One line per mode over the ``ranks`` it can use exactly (2D squares, 2.5D ``depth`` x squares, 3D cubes),
    from ``planner.cluster.tp_traffic.block_wire_bytes`` (the count ``tests/ranks/test_tp_scaling.py`` checks against
    the engine's records on 4 and 8 ranks). Log-log axes: 1D flattens out, 2D falls as p^-1/2, 3D as p^-2/3.
    """
    fig = go.Figure()
    for mode, dash in (("1d", "solid"), ("2d", "dash"), ("2.5d", "dashdot"), ("3d", "dot")):
        ps = [p for p in ranks if mode_sizes(mode, p, depth)]
        fig.add_scatter(x=ps, y=[block_wire_bytes(model, mode, p, rows, depth=depth) / MIB for p in ps],
                        mode="lines+markers", name=mode + (f" (depth {depth})" if mode == "2.5d" else ""),
                        line={"dash": dash}, hovertemplate=f"{mode}, %{{x}} ranks: %{{y:.1f}} MiB<extra></extra>")
    fig.update_layout(title=title or f"Planned (the cost model, not run): bytes one rank sends per block, "
                                     f"d_model {model.d_model}, {rows:,} token rows",
                      xaxis={"title": "tensor-parallel ranks", "type": "log"},
                      yaxis={"title": "MiB sent per rank per block (forward + backward)", "type": "log"},
                      template="plotly_white", height=420)
    return fig
