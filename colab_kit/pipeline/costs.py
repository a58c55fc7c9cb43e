"""Per-stage action costs, and ZB-V scheduled from them instead of from unit steps.

``build_plan("zb-v", pp, m, 2)`` orders each rank's actions by a greedy list scheduler
whose clock ticks in unit steps: it assumes every chunk's F, I and W take the same time.
On real ranks they do not. The zero-bubble paper (Qi et al. 2023, section 3) builds its
automatic schedules from profiled T_F, T_B and T_W; ``build_plan("zb-v", pp, m, 2,
costs=...)`` does the same with the V's greedy rules: the clock is continuous, and each
action lasts its own stage's cost. The rules stay those of ``schedules._zb_v`` (ready I
first, then a forward, chunk 1 before chunk 0, while the rank holds fewer than 2p
chunk-microbatches, else the oldest W it owes). A rank whose rules give nothing that can
start now takes the candidate that can start soonest. With equal costs this writes exactly
the unit-step plan. On some durations a rank fills its slots with chunk-0 forwards and then
waits for itself; the schedule is then written again with one more rule (a chunk-0 forward
never takes a rank's last free slot while a microbatch it sent down the V has not come back
through its chunk 1). ``zb_v_plan`` keeps whichever of that plan and the unit-step plan
simulates shorter under the costs, so a fitted plan is never planned slower than the unit one.

Costs are a dict ``{(stage, kind): seconds}`` for every stage and kind F, I, W (any unit;
only ratios matter), kind defaults ``{"F": t, "I": t, "W": t}`` standing in for stages not
named. ``engine.pipeline.replan()`` measures them (``measured_costs``: the median duration
of each stage's actions in the last training step, the largest over the ranks holding that
stage; pass it the events of several steps for steadier medians) and installs the plan on
every rank. Re-planning changes only the order: the same F, I and W run once each per
microbatch, so training stays equal to one process (to fp32 rounding of the gradient sums,
which now add up in another order).

Why it matters: ``python bench/pp.py`` (GPT d=128 x 4, 8 microbatches, 2 CPU ranks) prints
the costs it fits; one run on a loaded machine read a chunk's F at 1.9-2.4 ms, I
2.3-2.7 ms and W 1.4-1.6 ms, and the first stage, which never splits (see ``executor``), an I
of 0.01 ms and a W of 3.8 ms (its whole backward). The example rounds such costs to one
value per kind. With them and free messages the unit-step plan leaves 11 ms of its 113.5 ms
idle on the busiest rank; the plan built from them leaves 7 ms. Worked example, pp=2, 8
microbatches (``simulate`` takes the same costs)::

    >>> from colab_kit.pipeline import build_plan, simulate
    >>> c = {"F": 2.1, "I": 2.7, "W": 1.6, (0, "I"): 0.0, (0, "W"): 4.0}
    >>> unit, fitted = build_plan("zb-v", 2, 8, 2), build_plan("zb-v", 2, 8, 2, costs=c)
    >>> round(simulate(unit, c).makespan, 1), round(simulate(fitted, c).makespan, 1)
    (113.5, 109.4)
    >>> [round(b, 1) for b in simulate(fitted, c).busy]   # rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    [100.0, 102.4]
"""
from __future__ import annotations

import math
import statistics
from collections import deque

from .actions import Action, parse_one
from .plan import PipelinePlan
from .simulate import simulate

__all__ = ["stage_costs", "zb_v_timed", "zb_v_plan", "measured_costs", "flop_costs", "flops_per_token", "shorter_plan"]

KINDS = ("F", "I", "W")


def stage_costs(costs: dict, n_stages: int) -> dict[tuple[int, str], float]:
    """``{(stage, kind): cost}`` for every stage and kind F, I, W, from per-stage entries and
    kind defaults; ValueError naming what is missing or negative."""
    out, missing = {}, []
    for s in range(n_stages):
        for k in KINDS:
            v = costs.get((s, k), costs.get(k))
            if v is None:
                missing.append(f"({s}, {k!r})")
            elif not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"cost of stage {s}'s {k} must be a finite number >= 0, got {v!r}")
            else:
                out[s, k] = float(v)
    if missing:
        raise ValueError(f"costs need every stage's F, I and W: missing {', '.join(missing[:6])}"
                         f"{' ...' if len(missing) > 6 else ''}; give them, or kind defaults like "
                         "{'F': 1.0, 'I': 1.0, 'W': 1.0}")
    unknown = [k for k in costs if k not in KINDS and not (isinstance(k, tuple) and len(k) == 2 and k[1] in KINDS
                                                          and isinstance(k[0], int) and 0 <= k[0] < n_stages)]
    if unknown:
        raise ValueError(f"unknown cost keys {unknown[:4]}: use (stage, kind) with stage in 0..{n_stages - 1} and "
                         "kind 'F', 'I' or 'W', or a kind alone as the default")
    return out


def zb_v_timed(pp: int, m: int, costs: dict, reserve: bool = False) -> list[list[Action]] | None:
    """ZB-V's actions per rank, list-scheduled on a continuous clock with ``costs`` (module
    docstring); None if the rules get stuck (``reserve``: keep the chunk-1 slot, which cannot)."""
    timed = _zb_v_clocked(pp, m, costs, reserve)
    return None if timed is None else timed[0]


def _zb_v_clocked(pp: int, m: int, costs: dict, reserve: bool = False) -> tuple[list[list[Action]], float] | None:
    """``zb_v_timed``'s plan and its makespan on the scheduler's own clock: each action starts when its rank is
    free and what it waits for has ended, the rule ``simulate`` times a plan by, so this is the simulated makespan
    (tests/unit/test_pipeline_costs.py) without simulating."""
    n, limit = 2 * pp, 2 * pp
    cost = stage_costs(costs, n)
    mine = [[r, n - 1 - r] for r in range(pp)]  # the V: PipelinePlan(..., placement="v").stages_of(r)
    ended: dict[tuple[str, int, int], float] = {}
    next_f, next_i = [0] * n, [0] * n
    held = [0] * pp
    owed: list[deque] = [deque() for _ in range(pp)]
    plan: list[list[Action]] = [[] for _ in range(pp)]
    free = [0.0] * pp

    def at(kind, s, i):  # when that action ends (not scheduled yet: never)
        return ended.get((kind, s, i), math.inf)

    def choice(r):  # (start, priority, stage, microbatch, kind) of what rank r would run next
        t, cands = free[r], []
        for s in mine[r]:
            i = next_i[s]
            if i < m:
                cands.append((max(t, at("F", s, i), at("I", s + 1, i) if s < n - 1 else 0.0), 0, i, -s, "I"))
            i = next_f[s]
            # the last free slot is kept for the chunk-1 forward of a microbatch this rank sent down
            # the V, else a rank full of chunk-0 forwards waits for itself
            room = not reserve or held[r] + 1 < limit or s == mine[r][1] or next_f[mine[r][1]] == next_f[mine[r][0]]
            if i < m and held[r] < limit and room:
                cands.append((max(t, at("F", s - 1, i) if s else 0.0), 1, -s, i, "F"))
        if owed[r]:
            cands.append((t, 2, 0, 0, "W"))
        now = [c for c in cands if c[0] <= t]
        return min(now, key=lambda c: c[1:4]) if now else min(cands, default=None)

    # a rank's choice reads its own state, its stages' counters, and when the stages beside its own end their
    # actions: after rank r runs stage s, only r and the owners of stages s - 1 and s + 1 can choose otherwise
    owner = {s: r for r in range(pp) for s in mine[r]}
    chosen = [choice(r) for r in range(pp)]
    for _ in range(3 * n * m):
        picks = [(c, r) for r, c in enumerate(chosen) if c is not None]
        (start, _, a, b, kind), r = min(picks, key=lambda p: (p[0][0], p[1]))
        if math.isinf(start):
            return None
        s, i = {"I": (-b, a), "F": (-a, b)}.get(kind) or owed[r][0]
        ended[kind, s, i] = free[r] = start + cost[s, kind]
        plan[r].append(Action(s, kind, i))
        if kind == "F":
            next_f[s] += 1
            held[r] += 1
        elif kind == "I":
            next_i[s] += 1
            owed[r].append((s, i))
        else:
            owed[r].popleft()
            held[r] -= 1
        for d in {r, owner.get(s - 1, r), owner.get(s + 1, r)}:
            chosen[d] = choice(d)
    return plan, max(free)


def zb_v_plan(pp: int, m: int, costs: dict, unit: list[list[Action]]) -> list[list[Action]]:
    """The actions ``build_plan("zb-v", pp, m, 2, costs=costs)`` returns: the timed list schedule,
    or ``unit`` (the unit-step plan) where that simulates no longer under ``costs``."""
    timed = _zb_v_clocked(pp, m, costs) or _zb_v_clocked(pp, m, costs, reserve=True)
    if timed is None:
        return unit
    unit_makespan = simulate(PipelinePlan(pp, m, 2, "zb-v", unit, placement="v"), stage_costs(costs, 2 * pp)).makespan
    return timed[0] if timed[1] < unit_makespan else unit


def measured_costs(events: list[dict], stages, device="cpu") -> dict[tuple[int, str], float]:
    """Median seconds of each (stage, kind) compute action in ``events`` (one step's timeline on
    this rank), the largest over every rank: a collective (an all-reduce of integer microseconds,
    so every rank gets the same dict). ``stages`` are the stages of the whole pipeline, in order. On a GPU
    an action's seconds are its CUDA events' (``device_seconds``), not the host's time to issue it."""
    import torch
    import torch.distributed as dist

    durations: dict[tuple[int, str], list[float]] = {}
    for ev in events:
        if ev.get("action") and ev.get("kind") == "compute":
            a = parse_one(ev["action"])
            durations.setdefault((a.stage, a.kind), []).append(ev.get("device_seconds", ev["end"] - ev["start"]))
    keys = [(s, k) for s in stages for k in KINDS]
    us = torch.tensor([round(statistics.median(durations[k]) * 1e6) if k in durations else -1 for k in keys],
                      dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(us, op=dist.ReduceOp.MAX)
    missing = [f"{s}{k}" for (s, k), v in zip(keys, us.tolist()) if v < 0]
    if missing:
        raise RuntimeError(f"no measured duration for {', '.join(missing[:6])}: run a training step with this plan "
                           "(all of its F, I and W actions) before measuring its costs")
    return {key: v / 1e6 for key, v in zip(keys, us.tolist())}


def flop_costs(model_cfg, n_stages: int) -> dict:
    """Each stage's F, I and W in FLOPs per token of a GPT (``model_cfg``: a ``GPTConfig``) cut
    into ``n_stages`` equal stages: the costs the engine's first zb-v plan is scheduled on.

    Per block and token, with ``h`` d_model, ``f`` d_ff, ``t`` seq_len and ``v`` vocab_size: the
    four Linears' forward matmuls ``lin = 2 (4 h^2 + 2 h f)`` and attention's two products
    ``att = 4 t h``; I is the input gradients (``lin`` again) and attention's backward
    (``2 att``), W the weight gradients (``lin``). The last stage adds the head (``2 h v`` to
    each of F, I, W); the first stage's I is 0 and its W the whole backward (nothing waits for
    its input gradient: ``executor``). Only ratios matter to the scheduler. Worked example,
    d_model 128, d_ff 512, seq_len 64, vocab 256, 4 layers over 4 stages::

        >>> from colab_kit.models import GPTConfig
        >>> c = flop_costs(GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4), 4)
        >>> c["F"], c["I"], c["W"], c[(0, "I")], c[(0, "W")], c[(3, "F")]
        (425984, 458752, 393216, 0, 851968, 491520)

    On CPU ranks the elementwise backward ops make I dearer than this (``python bench/pp.py``
    measured I/W about 1.5 against these 1.17); ``engine.pipeline.replan()`` fits measured costs.
    """
    lin, att, head = flops_per_token(model_cfg)
    per = model_cfg.n_layers // n_stages
    F, I, W = per * (lin + att), per * (lin + 2 * att), per * lin  # noqa: E741 - named after the F/I/W actions
    last = n_stages - 1
    costs = {"F": F, "I": I, "W": W, (last, "F"): F + head, (last, "I"): I + head, (last, "W"): W + head}
    costs[0, "I"], costs[0, "W"] = 0, costs.get((0, "I"), I) + costs.get((0, "W"), W)
    return costs


def flops_per_token(model_cfg) -> tuple[int, int, int]:
    """Forward FLOPs per token of a GPT by the standard count: ``(lin, att, head)``, the four
    Linears of a block ``2 (4 h^2 + 2 h f)``, attention's two products over the whole sequence
    ``4 t h`` (the CPU kernel computes the whole square: no causal halving) and the head ``2 h v``.
    ``flop_costs`` and the planner's cost model (``planner.local.step``) both count with it."""
    h, f, t, v = model_cfg.d_model, model_cfg.d_ff, model_cfg.seq_len, model_cfg.vocab_size
    return 2 * (4 * h * h + 2 * h * f), 4 * t * h, 2 * h * v


def shorter_plan(first, second, costs: dict):
    """Whichever of two plans of the same zb-v step simulates shorter under ``costs`` (``first`` on
    a tie): what ``engine.pipeline.replan()`` installs, so that re-planning from measured costs
    never installs a plan those costs say is slower than the one the engine started with."""
    cost = stage_costs(costs, first.n_stages)
    return second if simulate(second, cost).makespan < simulate(first, cost).makespan else first
