"""A pipeline schedule's makespan when its ranks share fewer cores than there are ranks.

``pipeline.simulate`` gives every rank its own core. On a machine with ``cores`` < ranks (4 CPU
ranks on 2 cores), a rank that waits (for its input, in the bubble, or in a collective) leaves its
core to the ranks that compute, and a rank runs on one core at most (one thread). So the speed of a
computing rank at any moment is ``min(1, cores / ranks computing)`` of its own, and the bubble is
what a schedule loses beyond that. ``makespan`` runs the plan as events: each action is its compute
(``work``: seconds at its rank's own speed, shared as above) then its waiting (``wait``: seconds
in the stage's tp and sp collectives, at wall speed, holding no core), and starts when its rank is
free and what it depends on has ended (``pipeline.check``'s dependencies).

Each pipeline rank of the plan stands for ``group`` ranks (its sp and tp peers, which run the same
actions in step, meeting in their collectives; the planner prices dp replicas of a pipeline otherwise,
``bubble.bubble``). Worked example, pp=2 GPipe, 2 microbatches, F = 1 s and B = 2 s of work, no
waiting, ``group`` 2 (tp=2) on 2 cores: rank 0's F0 runs alone (2 ranks on 2 cores, full
speed, ends at 1); F1 and rank 1's F0 share (4 ranks, half speed, end at 3); rank 1 runs F1 and B0
alone (ends at 6), then B1 beside rank 0's B0 (half speed, both end at 10), rank 0's B1 alone::

    >>> from colab_kit.pipeline import build_plan
    >>> makespan(build_plan("gpipe", 2, 2), {"F": (1, 0), "B": (2, 0)}, group=2, cores=2)
    12.0

12 s: the 6 s of each rank's work at half speed, no bubble left. With a core per rank (``cores=4``) it
is the schedule's own 9 s.

Ranks bound to cores (``launch.bind_rank``: rank g on core ``g % cores``) share only their own core:
``placement[r]`` lists the cores of the ranks pipeline rank r stands for (its tp and sp peers, and its
dp replicas, which run the same actions), and each runs at ``1 / (busy ranks on its core)``, the
slowest of them setting the pace. dp=2 x pp=2 on 2 cores puts each replica's two stages on one core
(ranks 0, 2 on core 0: replica 0's stages), so a stage's bubble is its other stage's time on the core::

    >>> makespan(build_plan("gpipe", 2, 2), {"F": (1, 0), "B": (2, 0)}, placement=[(0, 1), (0, 1)])
    12.0

(here the same 12 s: every action of the one-core replica runs alone or beside its other stage).
"""
from __future__ import annotations
from ...pipeline.check import check, dependencies, positions

__all__ = ["makespan"]


def makespan(plan, costs: dict, group: int = 1, cores: float = float("inf"), latency: float = 0.0,
             placement: list | None = None) -> float:
    """Seconds from the first action to the last; ``costs[kind]`` or ``costs[(stage, kind)]`` =
    ``(work, wait)``; ``latency``: seconds from the end of an action to the start of one on another rank
    that waits for it (the message between them); ``placement``: the bound cores of each pipeline rank's
    ranks (then ``group`` and ``cores`` are not used)."""
    if cores <= 0 or group < 1:
        raise ValueError(f"cores={cores!r}, group={group!r}: give at least one core and one rank a pipeline rank")
    if placement is not None and (len(placement) != len(plan.actions) or not all(placement)):
        raise ValueError(f"placement lists {len(placement)} pipeline ranks' cores, the plan has {len(plan.actions)} "
                         f"ranks: give each its ranks' cores (one or more)")
    check(plan)
    deps = dependencies(plan, positions(plan))
    rows = plan.actions
    pos = [0] * len(rows)
    phase: list[str | None] = [None] * len(rows)   # None: between actions; "work"; "wait"
    left = [0.0] * len(rows)
    done: dict = {}  # (rank, position) -> when it ended
    t = 0.0

    def ready_at(r):
        need = deps[(r, pos[r])]
        if not all(d in done for d, _ in need):
            return None
        return max([t] + [done[d] + (latency if d[0] != r else 0.0) for d, _ in need])

    while True:
        later: list[float] = []
        started = True
        while started:  # start what can start (an action of no cost ends at once: look again)
            later, started = [], False
            for r, row in enumerate(rows):
                when = ready_at(r) if phase[r] is None and pos[r] < len(row) else None
                if when is None:
                    continue
                if when > t + 1e-15:
                    later.append(when)
                    continue
                a = row[pos[r]]
                work, wait = costs.get((a.stage, a.kind), costs.get(a.kind, (0.0, 0.0)))
                phase[r], left[r] = ("work", work) if work > 0 else ("wait", wait)
                if phase[r] == "wait" and wait <= 0:
                    phase[r], done[(r, pos[r])], started = None, t, True
                    pos[r] += 1
        running = [r for r in range(len(rows)) if phase[r] is not None]
        if not running and not later:
            if any(pos[r] < len(row) for r, row in enumerate(rows)):
                raise RuntimeError("the plan stopped with actions left: pipeline.check should have refused it")
            return t
        busy = [r for r in running if phase[r] == "work"]
        rate = _rates(busy, group, cores, placement)
        step = min([left[r] / rate.get(r, 1.0) for r in running] + [w - t for w in later])
        t += step
        for r in running:
            left[r] -= step * rate.get(r, 1.0)
            if left[r] > 1e-12:
                continue
            a = rows[r][pos[r]]
            wait = costs.get((a.stage, a.kind), costs.get(a.kind, (0.0, 0.0)))[1]
            if phase[r] == "work" and wait > 0:
                phase[r], left[r] = "wait", wait
            else:
                phase[r] = None
                done[(r, pos[r])] = t
                pos[r] += 1


def _rates(busy: list, group: int, cores: float, placement) -> dict:
    """Speed of each busy pipeline rank (1: a core of its own): the ``cores`` shared by every busy rank, or,
    bound (``placement``), each rank's core shared by the busy ranks bound to it, the slowest of a pipeline
    rank's ranks setting its pace."""
    if placement is None:
        rate = min(1.0, cores / (len(busy) * group)) if busy else 1.0
        return {r: rate for r in busy}
    load: dict = {}
    for r in busy:
        for c in placement[r]:
            load[c] = load.get(c, 0) + 1
    return {r: min(1.0 / load[c] for c in placement[r]) for r in busy}
