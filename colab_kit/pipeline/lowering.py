"""Lowering: add the sends and receives a plan's compute actions need.

Data flows along stages: the forward of stage s needs the output of stage s-1's forward,
the backward (B or I) of stage s needs the input gradient from stage s+1's backward.
``lower`` puts, on each rank,

* each receive (``RF`` / ``RB``) immediately before the compute that consumes it, and
* each send (``SF`` / ``SB``) immediately after the compute that produces it.

The executor runs a rank's actions in list order; a receive blocks until its data has
arrived, a send is an asynchronous ``isend`` (buffered, completed later). Under those
rules a lowered plan cannot deadlock as long as the compute order does not: a rank only
ever blocks at a receive, whose send sits right after a compute that itself only waited
on earlier data, so every wait points back along the (acyclic) dependency order of the
schedule. ``check`` proves this for a given plan by stepping it.

Local handoff: when producer and consumer stage live on the same rank (pp=1, where every
chunk is on rank 0), no communication action is added; the executor keeps the producer's
output (or input gradient) in memory keyed by (stage, microbatch) and the consumer reads it
there. With pp > 1, stages s and s+1 are always on different ranks (s % pp differs),
including across chunk boundaries of the interleaved schedule (stage pp-1 on rank pp-1 feeds
stage pp on rank 0).

For 1F1B with pp=2, microbatches=2, ``print(lower(build_plan("1f1b", 2, 2)))``::

    rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1
    rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1

Between any two ranks, the generated schedules receive messages in the order they were
sent (``check`` enforces it), so an executor may match sends and receives by order (as
NCCL does) or by ``message_tag``, which gives the same number at both ends.
"""
from __future__ import annotations

from .actions import Action

__all__ = ["lower", "match", "peer", "message_tag", "inputs_of", "outputs_of"]


def inputs_of(action: Action, n_stages: int) -> Action | None:
    """The receive a compute action needs if its producer is elsewhere (ignoring rank placement)."""
    if action.kind == "F" and action.stage > 0:
        return Action(action.stage, "RF", action.microbatch)
    if action.kind in ("B", "I") and action.stage < n_stages - 1:
        return Action(action.stage, "RB", action.microbatch)
    return None


def outputs_of(action: Action, n_stages: int) -> Action | None:
    """The send a compute action's result needs if its consumer is elsewhere (ignoring rank placement)."""
    if action.kind == "F" and action.stage < n_stages - 1:
        return Action(action.stage, "SF", action.microbatch)
    if action.kind in ("B", "I") and action.stage > 0:
        return Action(action.stage, "SB", action.microbatch)
    return None


def match(action: Action) -> Action:
    """The other end of a communication action: ``2SF0`` <-> ``3RF0``, ``3SB0`` <-> ``2RB0``."""
    s, mb = action.stage, action.microbatch
    other = {"SF": (s + 1, "RF"), "RF": (s - 1, "SF"), "SB": (s - 1, "RB"), "RB": (s + 1, "SB")}
    if action.kind not in other:
        raise ValueError(f"{action} is a compute action and has no matching end")
    stage, kind = other[action.kind]
    return Action(stage, kind, mb)


def peer(action: Action, pp: int) -> int:
    """The pipeline rank at the other end of a send or receive."""
    return match(action).stage % pp


def message_tag(action: Action, microbatches: int) -> int:
    """One integer per message, equal at both ends: use it as the p2p tag."""
    sender = action if action.kind in ("SF", "SB") else match(action)
    direction = 0 if sender.kind == "SF" else 1
    return (sender.stage * microbatches + sender.microbatch) * 2 + direction


def lower(plan):
    """A copy of ``plan`` with SF/RF/SB/RB actions added (a lowered plan is returned as it is)."""
    from .schedules import Plan

    if plan.lowered:
        return plan
    pp, n = plan.pp, plan.n_stages
    actions = []
    for r, row in enumerate(plan.actions):
        out = []
        for a in row:
            recv = inputs_of(a, n)
            if recv is not None and peer(recv, pp) != r:
                out.append(recv)
            out.append(a)
            send = outputs_of(a, n)
            if send is not None and peer(send, pp) != r:
                out.append(send)
        actions.append(out)
    return Plan(plan.pp, plan.microbatches, plan.chunks, plan.schedule, actions, lowered=True)
