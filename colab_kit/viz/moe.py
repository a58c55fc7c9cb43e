"""Mixture-of-experts figures from what the engine recorded (data in, ``go.Figure`` out).

``expert_load_figure(loads, layer=None)``: experts x steps, each cell the expert's assignments over the mean
of the layer's experts at that step (1.0: balanced; hover: the count), one layer or every layer stacked (a
band of rows per layer). ``loads`` is ``colab_kit.observe.moe.loads_by_layer(engine.records)``::

    loads = {1: {"steps": [1, 2], "counts": [[14, 6, 6, 6], [10, 8, 7, 7]], "dropped": [4, 1]}}
    fig = expert_load_figure(loads)
    # one Heatmap: y "layer 1 · expert 0" .. "layer 1 · expert 3", x steps 1, 2,
    # z [[1.75, 1.25], [0.75, 1.0], [0.75, 0.875], [0.75, 0.875]], customdata the counts

``moe_traffic_figure(matrix)``: rank x rank bytes of one step's dispatch, ``matrix[i][j]`` = bytes rank ``i``
sent to rank ``j`` (``colab_kit.expert.records.traffic``); the diagonal is what stayed on the rank::

    fig = moe_traffic_figure([[2816, 1792], [1920, 1664]], step=3)
    # Heatmap, y "from rank 0", "from rank 1"; x "to rank 0", "to rank 1"; text "2.8 KiB", ...
    # title "Dispatch bytes, rank to rank (step 3, all MoE layers; recorded)"

Both titles say the data was recorded. Empty or malformed data is a ``ConfigError`` saying what to pass:
a figure never invents a load.
"""
from __future__ import annotations

import plotly.graph_objects as go

from ..config import ConfigError

__all__ = ["expert_load_figure", "moe_traffic_figure"]


def _check_loads(loads: dict, layer: int | None) -> list[int]:
    if not loads:
        raise ConfigError("no MoE records to draw: train a model with MoE layers (GPTConfig(n_experts=4, ...)) "
                          "for a step, then pass loads_by_layer(engine.records)")
    if layer is not None and layer not in loads:
        raise ConfigError(f"layer={layer} has no MoE records: the recorded MoE layers are "
                          f"{', '.join(map(str, loads))} (or layer=None for all of them)")
    for n, row in loads.items():
        if len(row["steps"]) != len(row["counts"]) or not row["counts"]:
            raise ConfigError(f"layer {n}: {len(row['steps'])} steps but {len(row['counts'])} rows of counts: "
                              "each step needs its counts per expert (loads_by_layer gives both)")
        if len({len(c) for c in row["counts"]}) != 1:
            raise ConfigError(f"layer {n}: the steps' counts have different numbers of experts; "
                              "every step of a layer counts the same experts")
    return [layer] if layer is not None else list(loads)


def _relative(counts: list[int]) -> list[float | None]:
    total = sum(counts)
    return [c * len(counts) / total if total else None for c in counts]


def expert_load_figure(loads: dict, layer: int | None = None, *, title: str | None = None) -> go.Figure:
    """The load heatmap (module docstring): rows experts (per layer), columns steps, colour load / mean."""
    layers = _check_loads(loads, layer)
    steps = sorted({s for n in layers for s in loads[n]["steps"]})
    col = {s: i for i, s in enumerate(steps)}
    ys: list[str] = []
    z: list[list[float | None]] = []
    counts: list[list[int | None]] = []
    for n in layers:
        row = loads[n]
        experts = len(row["counts"][0])
        rel: list[list[float | None]] = [[None] * len(steps) for _ in range(experts)]
        raw: list[list[int | None]] = [[None] * len(steps) for _ in range(experts)]
        for s, c in zip(row["steps"], row["counts"]):
            for e, (r, k) in enumerate(zip(_relative(c), c)):
                rel[e][col[s]], raw[e][col[s]] = r, k
        ys += [f"layer {n} · expert {e}" for e in range(experts)]
        z += rel
        counts += raw
    top = max([v for r in z for v in r if v is not None] or [2.0])
    fig = go.Figure(go.Heatmap(
        x=steps, y=ys, z=z, customdata=counts, zmin=0.0, zmid=1.0, zmax=max(2.0, top), colorscale="RdBu_r",
        colorbar=dict(title="load / mean"), xgap=1, ygap=1,
        hovertemplate="step %{x}<br>%{y}<br>%{customdata} assignments<br>%{z:.2f}x the mean<extra></extra>"))
    which = f"layer {layer}" if layer is not None else (f"layer {layers[0]}" if len(layers) == 1
                                                        else f"{len(layers)} MoE layers")
    fig.update_layout(
        title=title or f"Expert load per step, {which} (recorded: assignments over the mean; 1 = balanced)",
        xaxis=dict(title="step", type="category" if len(steps) <= 40 else "linear"),
        yaxis=dict(autorange="reversed", type="category"),
        height=int(min(900, 160 + 22 * len(ys))), width=820, margin=dict(l=140, r=40, t=60, b=50))
    return fig


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def moe_traffic_figure(matrix, *, step: int | None = None, layer: int | None = None,
                       title: str | None = None) -> go.Figure:
    """The rank x rank heatmap of dispatch bytes (module docstring); ``step`` and ``layer`` go in the title."""
    n = len(matrix)
    if n == 0 or any(len(row) != n for row in matrix):
        raise ConfigError(f"the traffic matrix must be square, world x world (got {n} rows of lengths "
                          f"{sorted({len(r) for r in matrix})}): pass expert.records.traffic(records_by_rank, layout)")
    if not any(any(row) for row in matrix):
        raise ConfigError("the traffic matrix holds no byte: dispatch bytes are recorded with expert parallelism "
                          "(ParallelConfig(ep=2) or more) only")
    ranks = list(range(n))
    fig = go.Figure(go.Heatmap(
        x=[f"to rank {j}" for j in ranks], y=[f"from rank {i}" for i in ranks], z=matrix,
        text=[[_size(b) if b else "" for b in row] for row in matrix], texttemplate="%{text}",
        colorscale="Blues", colorbar=dict(title="bytes"), xgap=1, ygap=1,
        hovertemplate="%{y} %{x}: %{z:,} B<extra></extra>"))
    what = f"step {step}" if step is not None else "one step"
    which = f"layer {layer}" if layer is not None else "all MoE layers"
    fig.update_layout(
        title=title or f"Dispatch bytes, rank to rank ({what}, {which}; recorded)",
        yaxis=dict(autorange="reversed"), height=int(min(800, 160 + 45 * n)), width=int(min(900, 380 + 70 * n)),
        margin=dict(l=100, r=40, t=60, b=50))
    return fig
