"""Pipeline schedules as cells to draw: planned grids, simulated timelines, measured events.

The figure builders of ``viz.pipeline`` draw *cells*: one box per action on its pipeline
rank's row, from ``start`` to ``end``. Three sources give cells, each labelled for what it is:

* a ``PipelinePlan`` (planned): the lockstep grid of ``check.steps``, one timestep per cell; for a
  lowered plan these are exactly the timesteps ``engine.step.advance`` walks;
* a ``Timeline`` from ``simulate`` (planned): start and end in cost units (F=1, B=2, ...);
* per-rank event lists from ``engine.timeline()`` (measured): seconds since that rank's
  step began, with the gaps between events filled in as ``idle``.

For 1F1B with pp=2, microbatches=2 (``plan_cells(build_plan("1f1b", 2, 2))``)::

    rank 0: 0F0 [0,1)  0F1 [1,2)  0B0 [3,4)  0B1 [5,6)
    rank 1: 1F0 [1,2)  1B0 [2,3)  1F1 [3,4)  1B1 [4,5)

    >>> from colab_kit.pipeline import build_plan
    >>> [(c.label, c.start) for c in plan_cells(build_plan("1f1b", 2, 2)) if c.rank == 1]
    [('1F0', 1), ('1B0', 2), ('1F1', 3), ('1B1', 4)]
"""
from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.actions import COMPUTE, Action, parse, parse_one
from ..pipeline.check import steps

__all__ = ["Cell", "cells", "plan_cells", "timeline_cells", "event_cells", "held_series", "measured_bubble",
           "action_set"]


@dataclass(frozen=True)
class Cell:
    """One box of a schedule figure."""

    rank: int
    """Row: the pipeline rank (plans, timelines) or the global rank (measured events)."""
    index: int | None
    """Position in that rank's action list (None for measured events that are not plan actions)."""
    label: str
    """Compact form (``2F0``) or the event's name."""
    kind: str
    """F, B, I, W, SF, RF, SB, RB; or compute, comm, idle for events that are not actions."""
    microbatch: int | None
    start: float
    end: float
    lane: int = 0
    """0, or 1 for a measured event that overlaps the one before it (an async all-reduce)."""

    @property
    def action(self) -> Action | None:
        try:
            return parse_one(self.label) if self.index is not None else None
        except ValueError:
            return None


def plan_cells(plan) -> list[Cell]:
    """The lockstep grid of ``plan``: each action at its timestep (``check.steps``), one unit wide."""
    pos, out = [0] * plan.pp, []
    for t, row in enumerate(steps(plan)):
        for r, a in enumerate(row):
            if a is not None:
                out.append(Cell(r, pos[r], str(a), a.kind, a.microbatch, t, t + 1))
                pos[r] += 1
    return out


def timeline_cells(timeline) -> list[Cell]:
    """The simulated timeline: each action from its start to its end (zero-length ones left out)."""
    return [Cell(r, i, str(a), a.kind, a.microbatch, s, e)
            for r, row in enumerate(timeline.events) for i, (s, e, a) in enumerate(row) if e > s]


def event_cells(per_rank: list[list[dict]], unit: float = 1e3, idle: bool = True) -> list[Cell]:
    """Measured events (``engine.timeline()`` of each rank) as cells, times scaled by ``unit`` (ms).

    Events that carry an ``action`` (the executor's) keep its kind (F, SF, ...); others keep
    their ``kind`` (compute, comm, idle). An event that starts before the previous one on
    its rank ended goes to lane 1. With ``idle``, the gaps of lane 0 from 0 to the end of
    the latest rank are added as ``idle`` cells.
    """
    out = []
    end_all = max((e["end"] for evs in per_rank for e in evs), default=0.0) * unit
    for r, events in enumerate(per_rank):
        busy_until, pos = 0.0, 0
        for e in sorted(events, key=lambda e: e["start"]):
            s, t = e["start"] * unit, e["end"] * unit
            lane = 1 if s < busy_until - 1e-9 else 0
            if lane == 0:
                if idle and s - busy_until > 1e-9:
                    out.append(Cell(r, None, "idle", "idle", None, busy_until, s))
                busy_until = max(busy_until, t)
            if e.get("action"):
                out.append(Cell(r, pos, e["action"], parse_one(e["action"]).kind, e.get("microbatch"), s, t, lane))
                pos += 1
            else:
                out.append(Cell(r, None, e["name"], e["kind"], None, s, t, lane))
        if idle and end_all - busy_until > 1e-9:
            out.append(Cell(r, None, "idle", "idle", None, busy_until, end_all))
    return out


def cells(source) -> tuple[list[Cell], str]:
    """(cells, what they are: "plan", "timeline" or "measured") of a PipelinePlan, Timeline or event lists."""
    if hasattr(source, "actions") and hasattr(source, "pp"):
        return plan_cells(source), "plan"
    if hasattr(source, "events") and hasattr(source, "plan"):
        return timeline_cells(source), "timeline"
    if isinstance(source, (list, tuple)) and all(isinstance(r, (list, tuple)) and not isinstance(r, Action)
                                                 for r in source):
        return event_cells(list(source)), "measured"
    raise TypeError(f"expected a PipelinePlan, a Timeline (from simulate) or per-rank event lists "
                    f"(engine.timeline() of every rank), got {type(source).__name__}")


def action_set(marks, plan=None) -> set[str]:
    """Normalise ``executed`` / ``current`` marks to a set of compact forms.

    Accepts actions, their compact forms, ``(rank, index)`` pairs (needs ``plan``: the index
    is the position in ``plan.actions[rank]``), or a dict rank -> list of those.
    """
    if marks is None:
        return set()
    if isinstance(marks, dict):
        marks = [m for v in marks.values()
                 for m in (v if isinstance(v, (list, tuple, set)) and not isinstance(v, Action) else [v])]
    out = set()
    for m in marks:
        if m is None:
            continue
        if isinstance(m, tuple) and len(m) == 2 and all(isinstance(x, int) for x in m):
            if plan is None:
                raise ValueError(f"(rank, index) mark {m} needs the plan to look the action up")
            out.add(str(plan.actions[m[0]][m[1]]))
        else:
            out.add(str(m if isinstance(m, Action) else parse(str(m))))
    return out


def held_series(source, frees: tuple[str, ...] = ("B", "W")) -> list[tuple[list[float], list[int]]]:
    """Per rank, ``(x, held)``: how many (stage, microbatch) activations the rank holds over time.

    An activation is held from its F until the backward that frees it: ``frees=("B", "W")``
    is what the executor does (its W pass walks the saved graph again, so a zero-bubble I
    keeps the activation); ``("B", "I")`` is the count the ZB-H1 paper uses. For a PipelinePlan, x
    counts completed timesteps (``held`` after every action before timestep x, as
    ``engine.pipeline.state()`` reports after ``advance_to(x)``); for a Timeline, x is time.
    """
    if hasattr(source, "events"):
        out = []
        for row in source.events:
            changes = sorted([(s, 1) for s, _, a in row if a.kind == "F"] +
                             [(e, -1) for _, e, a in row if a.kind in frees])
            x, y, live = [0.0], [0], 0
            for t, d in changes:
                live += d
                x.append(t)
                y.append(live)
            out.append((x, y))
        return out

    rows = steps(source)
    out = []
    for r in range(source.pp):
        x, y, live = [0], [0], 0
        for t, row in enumerate(rows):
            a = row[r]
            if a is not None and a.kind in COMPUTE:
                live += (a.kind == "F") - (a.kind in frees)
            x.append(t + 1)
            y.append(live)
        out.append((x, y))
    return out


def measured_bubble(per_rank: list[list[dict]]) -> float:
    """Idle share of the measured step: ``1 - compute time / (ranks * span)``.

    Compute time counts the executor's F, B, I and W actions; the span runs from 0 (each
    rank's step start) to the end of the last of them on any rank. Waiting in a receive
    counts as idle, as it does in the planned bubble.
    """
    busy, end = 0.0, 0.0
    for events in per_rank:
        for e in events:
            if e.get("action") and parse_one(e["action"]).kind in COMPUTE:
                busy += e["end"] - e["start"]
                end = max(end, e["end"])
    return 1.0 - busy / (len(per_rank) * end) if end > 0 else 0.0
