"""Lowering: add the sends and receives a plan's compute actions need.

Data flows along stages: the forward of stage s needs the output of stage s-1's forward,
the backward (B or I) of stage s needs the input gradient from stage s+1's backward.
``lower`` puts, on each rank,

* each send (``SF`` / ``SB``) immediately after the compute that produces it, and
* each receive (``RF`` / ``RB``) immediately before the compute that consumes it, preceded
  by any message the same peer sent earlier that this rank has not received yet: a rank
  takes the messages from one peer in the order they were sent.

The executor runs a rank's actions in list order; a receive blocks until its data has
arrived, a send is an asynchronous ``isend`` (buffered, completed later). Under those
rules a lowered plan cannot deadlock as long as the compute order does not: a rank only
ever blocks at a receive, whose send sits right after a compute that itself only waited
on earlier data, so every wait points back along the (acyclic) dependency order of the
schedule. A receive pulled forward to keep the sender's order waits no longer than the
receive behind it would have: its message left the peer first. ``check`` proves all this
for a given plan by stepping it.

Local handoff: when producer and consumer stage live on the same rank (``plan.rank_of``
gives both one rank), no communication action is added; the executor keeps the producer's
output (or input gradient) in memory keyed by (stage, microbatch) and the consumer reads it
there. That happens with pp=1, where every chunk is on rank 0, and at the tip of the V of
``zb-v``, where stages pp-1 and pp share the last rank. Under the 'loop' placement with
pp > 1, stages s and s+1 are always on different ranks, including across chunk boundaries
of the interleaved schedule (stage pp-1 on rank pp-1 feeds stage pp on rank 0). For zb-v
with pp=2, microbatches=1 (stages 0, 3 on rank 0; 1, 2 on rank 1), rank 1 hands 1F0's output
to 2F0 and 2I0's input gradient to 1I0 in memory, ``print(lower(build_plan("zb-v", 2, 1, 2)))``::

    rank 0: 0F0 0SF0 3RF0 3F0 3I0 3SB0 3W0 0RB0 0I0 0W0
    rank 1: 1RF0 1F0 2F0 2SF0 2RB0 2I0 1I0 1SB0 2W0 1W0

For 1F1B with pp=2, microbatches=2, ``print(lower(build_plan("1f1b", 2, 2)))``::

    rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1
    rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1

Between any two ranks, messages are received in the order they were sent (``check``
enforces it), so an executor may match sends and receives by order (as NCCL does) or by
``message_tag``, which gives the same number at both ends. Under the 'loop' placement the
consumers already come in send order; under the V, rank 0 sends rank 1 both activations
(stage 0 -> 1) and gradients (stage 2p-1 -> 2p-2), and rank 1 may need a gradient before
an activation sent ahead of it. Lowering zb-v with pp=2, microbatches=4 gives rank 1
``... 1RF2 2RB0 2I0 1I0 1SB0 2W0 1F2 ...``: microbatch 2's activation left rank 0 before
microbatch 0's gradient, so rank 1 takes it first and ``1F2`` later reads it from memory.
"""
from __future__ import annotations

from collections import deque

from .actions import Action
from .plan import PipelinePlan, stage_rank

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


def peer(action: Action, plan) -> int:
    """The pipeline rank at the other end of a send or receive: ``plan.rank_of`` of the matching
    stage (a bare ``pp`` instead of a plan means the round-robin 'loop' placement)."""
    stage = match(action).stage
    return plan.rank_of(stage) if hasattr(plan, "rank_of") else stage_rank(stage, plan)


def message_tag(action: Action, microbatches: int) -> int:
    """One integer per message, equal at both ends: use it as the p2p tag."""
    sender = action if action.kind in ("SF", "SB") else match(action)
    direction = 0 if sender.kind == "SF" else 1
    return (sender.stage * microbatches + sender.microbatch) * 2 + direction


def lower(plan):
    """A copy of ``plan`` with SF/RF/SB/RB actions added (a lowered plan is returned as it is)."""
    if plan.lowered:
        return plan
    n = plan.n_stages
    with_sends = []
    for r, row in enumerate(plan.actions):
        out = []
        for a in row:
            out.append(a)
            send = outputs_of(a, n)
            if send is not None and peer(send, plan) != r:
                out.append(send)
        with_sends.append(out)
    queued: dict[tuple[int, int], deque[Action]] = {}  # (sender, receiver) -> receives in send order
    for r, row in enumerate(with_sends):
        for a in row:
            if a.kind in ("SF", "SB"):
                queued.setdefault((r, peer(a, plan)), deque()).append(match(a))
    actions = []
    for r, row in enumerate(with_sends):
        out, got = [], set()
        for a in row:
            recv = inputs_of(a, n) if not a.is_comm else None
            if recv is not None and peer(recv, plan) != r and recv not in got:
                queue = queued.get((peer(recv, plan), r), deque())
                while recv in queue:  # absent only if its producer is missing: check() names that
                    got.add(queue[0])
                    out.append(queue.popleft())
                if recv not in got:
                    out.append(recv)
            out.append(a)
        actions.append(out)
    return PipelinePlan(plan.pp, plan.microbatches, plan.chunks, plan.schedule, actions, lowered=True,
                placement=plan.placement)
