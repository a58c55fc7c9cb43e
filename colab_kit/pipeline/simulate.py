"""The planned timeline of a plan, with no processes: when each action would start and end.

Each action lasts ``costs[kind]`` (default F=1, B=2, I=1, W=1, communication 0), or
``costs[(stage, kind)]`` where that is given (``build_plan(..., costs=)`` takes the same), and
starts when its rank is free and everything it depends on has ended (a receive waits for
its matching send; in a plan that is not lowered, a compute waits directly for the
remote compute that produces its input). For 1F1B with pp=2, microbatches=3::

    >>> from colab_kit.pipeline import build_plan, simulate
    >>> t = simulate(build_plan("1f1b", 2, 3))
    >>> print(t.grid())  # doctest: +ELLIPSIS
    time | rank 0   | rank 1
       0 | 0F0      | .
       1 | 0F1      | 1F0
       2 | .        | 1B0
       3 | .        | 1B0
       4 | 0B0      | 1F1
       ...
    >>> t.makespan, round(t.bubble_fraction, 3)     # (p-1)/(m+p-1) = 1/4
    (12, 0.25)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .actions import Action
from .check import checked, format_grid

__all__ = ["Timeline", "simulate", "prepare", "DEFAULT_COSTS", "theory_bubble"]

DEFAULT_COSTS = {"F": 1, "B": 2, "I": 1, "W": 1, "SF": 0, "RF": 0, "SB": 0, "RB": 0}


@dataclass
class Timeline:
    """Per rank, ``(start, end, action)`` in execution order, and figures derived from them."""

    plan: object
    events: list[list[tuple[float, float, Action]]]
    costs: dict = field(default_factory=lambda: dict(DEFAULT_COSTS))

    @property
    def makespan(self) -> float:
        return max((e for row in self.events for _, e, _ in row), default=0)

    @property
    def busy(self) -> list[float]:
        """Time each rank spends running actions."""
        return [sum(e - s for s, e, _ in row) for row in self.events]

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        """Idle time over total rank time, ``sum(idle) / (pp * makespan)``."""
        total = len(self.events) * self.makespan
        return sum(self.idle) / total if total else 0.0

    def _peak(self, frees: tuple[str, ...]) -> list[int]:
        peaks = []
        for row in self.events:
            live = peak = 0
            for _, _, a in row:
                live += (a.kind == "F") - (a.kind in frees)
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    @property
    def peak_activations(self) -> list[int]:
        """Per rank, most (stage, microbatch) activations held at once: from F until its B or I."""
        return self._peak(("B", "I"))

    @property
    def peak_held(self) -> list[int]:
        """Like ``peak_activations`` but held until the weight gradient is done (B or W):
        the W pass of zero-bubble schedules still reads the stage input."""
        return self._peak(("B", "W"))

    def records(self) -> list[dict]:
        """One dict per action (rank, start, end, action, stage, kind, microbatch), for plotting."""
        return [dict(rank=r, start=s, end=e, action=str(a), stage=a.stage, kind=a.kind, microbatch=a.microbatch)
                for r, row in enumerate(self.events) for s, e, a in row]

    def grid(self, unit: float | None = None) -> str:
        """Text table, one row per ``unit`` of time, the action each rank runs ('.' = idle).

        Actions of zero duration (communication with the default costs) are not shown.
        """
        durations = [e - s for row in self.events for s, e, _ in row if e > s]
        if unit is None:
            unit = 1 if all(float(d).is_integer() for d in durations) else min(durations, default=1)
        rows = []
        for k in range(math.ceil(self.makespan / unit - 1e-9)):
            t = k * unit
            cells = [next((str(a) for s, e, a in row if s <= t + 1e-9 < e), ".") for row in self.events]
            rows.append((f"{t:g}", cells))
        return format_grid(rows, header="time")

    def __str__(self) -> str:
        return self.grid()


def prepare(plan) -> tuple:
    """``plan`` checked (a broken plan raises ``PlanError``), with its dependencies and lockstep order:
    what ``simulate`` needs beyond the costs, for a caller that times one plan under many costs."""
    return checked(plan)  # the dependencies, and the lockstep order: a valid order to fix start times in


def simulate(plan, costs: dict | None = None, prepared: tuple | None = None) -> Timeline:
    """The planned timeline of ``plan`` (checked first: a broken plan raises ``PlanError``);
    ``prepared``: ``prepare(plan)``, when the caller has it."""
    cost = {**DEFAULT_COSTS, **(costs or {})}
    deps, rows = prepared if prepared is not None else prepare(plan)
    end: dict[tuple[int, int], float] = {}
    free = [0] * plan.pp
    events: list[list[tuple[float, float, Action]]] = [[] for _ in range(plan.pp)]
    pos = [0] * plan.pp
    for row in rows:
        for r, a in enumerate(row):
            if a is None:
                continue
            i = pos[r]
            start = max([free[r]] + [end[d] for d, _ in deps[(r, i)]])
            end[(r, i)] = free[r] = start + cost.get((a.stage, a.kind), cost[a.kind])
            events[r].append((start, free[r], a))
            pos[r] += 1
    return Timeline(plan, events, cost)


def theory_bubble(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    """The textbook bubble fraction with the default costs.

    GPipe and 1F1B: (p-1)/(m+p-1). Interleaved with v chunks: (p-1)/(v*m+p-1).
    ZB-H1 (F=I=W=1): the idle time per rank is (p-1)*(F+I-W) = p-1 over 3m work: (p-1)/(3m+p-1).
    ZB-V (F=I=W=1 per chunk, two chunks): the last rank waits p-1 chunk forwards for its first
    input, then has 6m chunk passes to run, so no step is shorter than 6m+p-1: (p-1)/(6m+p-1),
    the floor the list scheduler reaches for pp <= 4 once m >= p (for m >= 2p it stays within 2
    units of it up to pp = 12).
    """
    p, m, v = pp, microbatches, chunks
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    if schedule == "zb-v":
        return (p - 1) / (6 * m + p - 1)
    return (p - 1) / (m + p - 1)
