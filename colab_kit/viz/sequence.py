"""Figures of sequence parallelism: the zigzag layout, the ring's rotations, Ulysses' all-to-all, memory vs t.

Data in, ``go.Figure`` out. The ring figure is drawn from a ``RingRecorder``'s events (what
ran); the layout figures are drawn from the layout rules of ``colab_kit.sequence.zigzag`` and
say so; the memory figure takes the bytes each engine measured.

Every K/V chunk keeps one colour in every figure: the early chunks (ids ``0 .. sp-1``) in
blues, the late ones (``sp .. 2sp-1``) in oranges, so the zigzag's pairing of one early and
one late chunk per rank shows at a glance::

    >>> fig = zigzag_figure(2)                        # 4 chunks over 2 ranks: the layout, no processes
    >>> [list(row) for row in fig.data[0].z]          # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    [[0.5, None, None, 3.5], [None, 1.5, 2.5, None]]
    >>> events = [{"phase": "forward", "rotation": i, "rank": r, "holds": list(chunk_ids((r - i) % 2, 2))}
    ...           for r in range(2) for i in range(2)]
    >>> ring_cells(events)[(1, 0)]["holds"]           # rotation 1: rank 0 holds rank 1's K/V
    [1, 2]
    >>> longest_fit({"ring": {64: 10, 128: 20, 256: 40}}, budget=30)
    {'ring': (128, False)}
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.colors import qualitative, sample_colorscale
from plotly.subplots import make_subplots

from ..config import Axis
from ..sequence.zigzag import LAYOUTS, chunk_ids

__all__ = ["chunk_colours", "zigzag_figure", "ring_cells", "ring_figure", "ulysses_figure", "ulysses_bytes",
           "longest_fit", "sequence_memory_figure"]

MIB = 2**20
RANK_COLOURS = qualitative.Set2
MODE_COLOURS = qualitative.D3
MODE_DASHES = ("solid", "dash", "dot", "dashdot", "longdash")   # lines that coincide stay visible
MODE_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x")


def chunk_colours(sp: int) -> list[str]:
    """One colour per chunk id (``2 sp`` of them): early chunks blue, late chunks orange, darker further in."""
    shade = [0.2 + 0.4 * i / max(sp - 1, 1) for i in range(sp)]
    return sample_colorscale("Blues", shade) + sample_colorscale("Oranges", shade)


def _chunk_scale(sp: int) -> list:
    """A colour scale on ``z`` in [0, 2 sp] that paints ``z = c + 0.5`` in chunk ``c``'s colour."""
    n, cols = 2 * sp, chunk_colours(sp)
    return [step for c in range(n) for step in ([c / n, cols[c]], [(c + 1) / n, cols[c]])]


def _check_layout(sp: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    if sp < 1:
        raise ValueError(f"sp must be at least 1, got {sp}")


def _tokens(c: int, t: int | None, n: int) -> str:
    return "" if t is None else f"tokens {c * t // n}-{(c + 1) * t // n - 1}"


def zigzag_figure(sp: int, layout: str = "zigzag", t: int | None = None, title: str | None = None) -> go.Figure:
    """Rank (y) by chunk of the sequence (x, in token order): which rank holds which of the ``2 sp`` chunks.

    A layout, from ``chunk_ids`` alone (no process ran). ``t`` adds each chunk's token range.
    """
    _check_layout(sp, layout)
    n = 2 * sp
    held = {r: chunk_ids(r, sp, layout) for r in range(sp)}
    z = [[c + 0.5 if c in held[r] else None for c in range(n)] for r in range(sp)]
    text = [[f"chunk {c}" if c in held[r] else "" for c in range(n)] for r in range(sp)]
    hover = [[f"rank {r} holds chunk {c} ({'early' if c < sp else 'late'}) {_tokens(c, t, n)}" if c in held[r]
              else f"rank {r} does not hold chunk {c}" for c in range(n)] for r in range(sp)]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(n)), y=list(range(sp)), zmin=0, zmax=n,
                               colorscale=_chunk_scale(sp), showscale=False, xgap=3, ygap=3, text=text,
                               texttemplate="%{text}", textfont={"size": 13, "color": "#111"}, customdata=hover,
                               hoverongaps=False,
                               hovertemplate="%{customdata}<extra></extra>"))
    ticks = [f"chunk {c}<br>{_tokens(c, t, n)}" if t else f"chunk {c}" for c in range(n)]
    fig.update_xaxes(tickvals=list(range(n)), ticktext=ticks, title_text="the sequence, in token order")
    fig.update_yaxes(tickvals=list(range(sp)), autorange="reversed",
                     ticktext=[f"rank {r}: {held[r][0]}, {held[r][1]}" for r in range(sp)])
    why = "one early and one late chunk per rank: even causal work" if layout == "zigzag" else "t/sp tokens in a row"
    fig.update_layout(title=title or f"The {layout} layout, sp={sp}: {n} chunks, {why} (the layout: no process ran)",
                      template="plotly_white", height=110 + 60 * sp, margin={"l": 110, "r": 20})
    return fig


def ring_cells(events: list[dict], phase: str = "forward", call: int = 0) -> dict[tuple[int, int], dict]:
    """``(rotation, rank) -> event`` of one attention call of ``phase``, from the recorders of every rank.

    A rank's recorder lists its calls one after another (one per block: the forward in block
    order, the backward in reverse), each ``rotation`` 0, 1, ...; ``call`` picks which (0: the
    first). ``events`` may hold several ranks' events (each carries its ``rank``), or be a
    list of per-rank lists.
    """
    flat = [e for x in events for e in (x if isinstance(x, list) else [x])]
    calls: dict[int, int] = {}
    cells = {}
    for e in flat:
        if e["phase"] != phase:
            continue
        r = e["rank"]
        if e["rotation"] == 0:
            calls[r] = calls.get(r, -1) + 1
        if calls.get(r) == call:
            cells[(e["rotation"], r)] = e
    if not cells:
        raise ValueError(f"no {phase} events of call {call} in the {len(flat)} events given")
    return cells


def _relations(q_ids, held) -> str:
    """How this rank's query chunks see a held K/V chunk under the causal mask (the rule of ``ring.py``)."""
    return ", ".join(f"q{a}-k{held}: " + ("skip" if held > a else "diagonal" if held == a else "full") for a in q_ids)


def ring_figure(events: list[dict], phase: str = "forward", call: int = 0, title: str | None = None) -> go.Figure:
    """Rotation (x) by rank (y), each cell the two K/V chunks that rank held at that rotation (recorded).

    ``events``: the ``RingRecorder.events`` of every rank of the ring (see ``ring_cells``). A
    slider steps through the rotations: the current one is drawn solid with the hop each K/V
    pair takes next (rank r -> r+1), the rest faint. Hover: the compute and wait times recorded,
    and how the rank's own query chunks see the chunk (the causal rule).
    """
    cells = ring_cells(events, phase, call)
    ranks = sorted({r for _, r in cells})
    rotations = sorted({i for i, _ in cells})
    sp = len(ranks)
    width = 3                                   # two chunk columns and a gap per rotation
    xs = list(range(width * len(rotations) - 1))
    q_ids = {r: chunk_ids(r, sp) for r in ranks}

    def grid(only=None) -> tuple[list, list, list]:
        z, text, hover = [], [], []
        for r in ranks:
            zr, tr, hr = [], [], []
            for i in rotations:
                e = cells.get((i, r))
                for j in range(width if i != rotations[-1] else 2):
                    c = e["holds"][j] if e is not None and j < 2 else None
                    show = c is not None and (only is None or i == only)
                    zr.append(None if c is None or not show else c + 0.5)
                    tr.append(f"k{c}" if show else "")
                    hr.append("" if c is None or e is None else
                              f"rotation {i}, rank {r} holds K/V chunk {c} ({'early' if c < sp else 'late'}); "
                              f"compute {1e3 * (e['end'] - e['start']):.2f} ms, waited "
                              f"{1e3 * e.get('waited', 0.0):.2f} ms<br>{_relations(q_ids[r], c)}")
            z.append(zr)
            text.append(tr)
            hover.append(hr)
        return z, text, hover

    def heat(z, text, hover, opacity, name):
        return go.Heatmap(z=z, x=xs, y=ranks, zmin=0, zmax=2 * sp, colorscale=_chunk_scale(sp), showscale=False,
                          xgap=2, ygap=6, opacity=opacity, text=text, texttemplate="%{text}",
                          textfont={"size": 14, "color": "#111"}, customdata=hover, hoverongaps=False,
                          hovertemplate="%{customdata}<extra></extra>",
                          name=name)

    def hops(i):                                # the K/V (forward) or K/V + dK/dV (backward) hop after rotation i
        if i == rotations[-1]:
            return []
        what = "K/V" if phase == "forward" else "K/V, dK/dV"
        return [dict(x=width * i + 2.45, y=(r + 1) % sp, ax=width * i + 1.55, ay=r, xref="x", yref="y",
                     axref="x", ayref="y", showarrow=True, arrowhead=3, arrowwidth=1.5, arrowcolor="#555",
                     text="", hovertext=f"rank {r} sends {what} to rank {(r + 1) % sp}") for r in ranks]

    def caption(i):
        nxt = ", then passes them on to rank r+1"
        if i == rotations[-1]:
            nxt = "; one more hop takes each chunk's dK/dV to its owner" if phase == "backward" else ""
        return f"rotation {i} of {len(rotations) - 1}: rank r attends its queries to the K/V it holds{nxt}"

    base = grid()
    first = grid(rotations[0])
    fig = go.Figure([heat(*base, 0.4, "all rotations"), heat(*first, 1.0, "this rotation")])
    fig.frames = [go.Frame(name=str(i), data=[heat(*base, 0.4, "all rotations"), heat(*grid(i), 1.0, "this rotation")],
                           traces=[0, 1], layout={"annotations": hops(i) + [_caption_note(caption(i))]})
                  for i in rotations]
    what = "K/V ring" if phase == "forward" else "dK/dV ring (backward: K/V and their gradient accumulators)"
    fig.update_layout(
        title=title or f"The {what}, sp={sp}: the chunks each rank held, rotation by rotation (recorded)",
        template="plotly_white", height=170 + 62 * sp, margin={"l": 70, "r": 20, "b": 110},
        annotations=hops(rotations[0]) + [_caption_note(caption(rotations[0]))],
        sliders=[{"active": 0, "currentvalue": {"prefix": "rotation "}, "pad": {"t": 45}, "x": 0.0, "len": 1.0,
                  "steps": [{"label": str(i), "method": "animate",
                             "args": [[str(i)], {"mode": "immediate", "frame": {"duration": 0, "redraw": True},
                                                 "transition": {"duration": 0}}]} for i in rotations]}])
    fig.update_xaxes(tickvals=[width * i + 0.5 for i in rotations], ticktext=[f"rotation {i}" for i in rotations],
                     range=[-0.6, width * rotations[-1] + 1.6], showgrid=False, zeroline=False)
    fig.update_yaxes(tickvals=ranks, ticktext=[f"rank {r}<br>(q {q_ids[r][0]}, {q_ids[r][1]})" for r in ranks],
                     autorange="reversed", showgrid=False, zeroline=False)
    return fig


def _caption_note(text: str) -> dict:
    return dict(text=text, x=0, y=1.0, xref="paper", yref="paper", xanchor="left", yanchor="bottom",
                showarrow=False, font={"size": 12, "color": "#444"})


def ulysses_bytes(sp: int, heads: int, t: int, batch: int, head_dim: int, element: int = 4) -> dict[str, int]:
    """Bytes each rank hands to each all-to-all, from the layout: q, k, v stacked before attention, the output after.

    >>> ulysses_bytes(4, 4, 64, 2, 8)
    {'q, k, v to heads': 12288, 'output to tokens': 4096}
    """
    one = batch * heads * (t // sp) * head_dim * element
    return {"q, k, v to heads": 3 * one, "output to tokens": one}


def ulysses_figure(sp: int, heads: int, t: int, records: list[dict] | None = None, layout: str = "contiguous",
                   title: str | None = None) -> go.Figure:
    """Heads (y) by chunks of the sequence (x), coloured by the rank holding them, before and after the all-to-all.

    The two grids follow from the layout (``sp``, ``heads``, ``t``); ``records``, the comm
    records of one rank (``engine.comm()``), add what was recorded: each ``all_to_all`` over
    ``sp`` with its bytes, forward and backward.
    """
    _check_layout(sp, layout)
    if heads % sp:
        raise ValueError(f"Ulysses needs sp to divide the heads: {heads} heads, sp={sp}")
    n = sp if layout == "contiguous" else 2 * sp      # contiguous: one piece of t/sp tokens per rank
    owner = {c: c if n == sp else next(r for r in range(sp) if c in chunk_ids(r, sp, layout)) for c in range(n)}
    per = heads // sp
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=[
        f"before: each rank t/sp = {t // sp} tokens, all {heads} heads",
        f"after: each rank all {t} tokens, {per} head{'s' if per > 1 else ''}"])
    scale = [s for r in range(sp) for s in ([r / sp, RANK_COLOURS[r % len(RANK_COLOURS)]],
                                            [(r + 1) / sp, RANK_COLOURS[r % len(RANK_COLOURS)]])]
    for col, who in ((1, lambda h, c: owner[c]), (2, lambda h, c: h // per)):
        z = [[who(h, c) + 0.5 for c in range(n)] for h in range(heads)]
        text = [[f"rank {who(h, c)}" for c in range(n)] for h in range(heads)]
        hover = [[f"head {h}, {_tokens(c, t, n)}: on rank {who(h, c)}" for c in range(n)] for h in range(heads)]
        fig.add_heatmap(z=z, x=list(range(n)), y=list(range(heads)), zmin=0, zmax=sp, colorscale=scale,
                        showscale=False, xgap=2, ygap=2, text=text, texttemplate="%{text}",
                        textfont={"color": "#111"}, customdata=hover,
                        hovertemplate="%{customdata}<extra>layout</extra>", row=1, col=col)
    fig.update_xaxes(tickvals=list(range(n)), ticktext=[f"{c * t // n}-{(c + 1) * t // n - 1}" for c in range(n)],
                     title_text="tokens", title_standoff=4)
    fig.update_yaxes(tickvals=list(range(heads)), ticktext=[f"head {h}" for h in range(heads)], autorange="reversed")
    note = "grids: derived from the layout (sp, heads, t)"
    if records is not None:
        a2a = [r for r in records if r["op"] == "all_to_all" and r["axis"] == Axis.SP]
        fwd = [r["bytes"] for r in a2a if "backward" not in r.get("tag", "")]
        bwd = [r["bytes"] for r in a2a if "backward" in r.get("tag", "")]
        note += (f"<br>recorded on this rank: {len(fwd)} all_to_all over sp in forward ({sum(fwd):,} B handed), "
                 f"{len(bwd)} in backward ({sum(bwd):,} B)")
    fig.add_annotation(text=note, x=0, y=0, yshift=-62, xref="paper", yref="paper", xanchor="left",
                       yanchor="top", align="left", showarrow=False, font={"size": 12, "color": "#444"})
    fig.update_layout(title=title or f"Ulysses' all-to-all, sp={sp}: from a sequence split to a head split",
                      template="plotly_white", height=250 + 34 * heads, margin={"b": 130})
    return fig


def longest_fit(measured: dict[str, dict[int, int]], budget: int) -> dict[str, tuple[int | None, bool]]:
    """Mode -> (longest t whose bytes are within ``budget``, whether every t tried fit).

    ``(t, True)``: the mode fits every length tried, so its limit lies beyond the largest t;
    ``(None, False)``: not even the shortest fits.
    """
    out = {}
    for mode, by_t in measured.items():
        longest = None
        for t in sorted(by_t):                    # from the shortest, up to the first length that does not fit
            if by_t[t] > budget:
                break
            longest = t
        out[mode] = (longest, longest is not None and longest == max(by_t))
    return out


def sequence_memory_figure(measured: dict[str, dict[int, int]], budget: int | None = None,
                           title: str | None = None) -> go.Figure:
    """Activation bytes per rank (MiB; hover: bytes) against the sequence length, one line per mode, and the budget.

    ``measured``: mode name -> {t: bytes} as each engine measured them (``engine.memory()["activations"]``).
    Points above the budget are drawn hollow; each mode has its own dash and marker, so modes that
    measure the same bytes stay visible on top of each other.
    """
    fig = go.Figure()
    for k, (mode, by_t) in enumerate(measured.items()):
        ts = sorted(by_t)
        colour = MODE_COLOURS[k % len(MODE_COLOURS)]
        over = [budget is not None and by_t[t] > budget for t in ts]
        fig.add_scatter(x=ts, y=[by_t[t] / MIB for t in ts], customdata=[by_t[t] for t in ts], name=mode,
                        mode="lines+markers", line={"color": colour, "dash": MODE_DASHES[k % len(MODE_DASHES)]},
                        marker={"size": 9, "color": ["white" if o else colour for o in over],
                                "symbol": MODE_SYMBOLS[k % len(MODE_SYMBOLS)],
                                "line": {"color": colour, "width": 2}},
                        hovertemplate=f"{mode}<br>t=%{{x}}: %{{customdata:,}} B (%{{y:.2f}} MiB)<extra></extra>")
    if budget is not None:
        fig.add_hline(y=budget / MIB, line_dash="dash", line_color="#b00020",
                      annotation_text=f"budget {budget / MIB:.2f} MiB per rank", annotation_position="top left",
                      annotation_font_color="#b00020")
    ts = sorted({t for by_t in measured.values() for t in by_t})
    fig.update_xaxes(tickvals=ts, ticktext=[str(t) for t in ts], title_text="sequence length t (tokens)",
                     range=[0, 1.04 * max(ts)] if ts else None)
    fig.update_yaxes(title_text="activations per rank, MiB", rangemode="tozero")
    fig.update_layout(title=title or "Activation memory per rank as the sequence grows (measured by each engine)",
                      template="plotly_white", height=440)
    return fig
