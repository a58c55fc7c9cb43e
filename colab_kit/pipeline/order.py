"""The order in which a rank issues its pipeline messages: one order both ends derive from the plan.

NCCL matches a pair's messages by order, not by tag, and runs a pair's unbatched sends and
receives one at a time in the order they were issued (``colab_kit.comm.rules`` plays those rules
on CPU). So the two ends of every pair of pipeline ranks must issue their messages in the same
order, and that order must let every send be issued when its data is ready. ``message_order``
gives it: every message of the step is placed at the lockstep timestep of its send (``check.steps``:
one action per rank per timestep, a receive always later than its send), ties broken by the
sending rank, and a message's parts in the order header, data, side. Each rank issues its sends
and receives in that order: a receive is posted as soon as everything before it was issued (early,
like the old prefetch), a send when its action runs, after posting every receive ordered before it.

Sorting every rank's messages by one key gives each pair the same sequence at both ends, and since
nothing waits on a message issued later in that order, nothing deadlocks: by induction on the
timestep, every message whose send sits before timestep T completes, so every rank reaches the
actions at T. That holds whether a rank's messages share one stream per pair (NCCL's unbatched
sends and receives) or one stream per group, since the order is total on each rank.

A rank may also wait for a message it has issued itself: the executor waits for its earlier sends to a
peer before it sends there again, so that a sent tensor is let go when the send completes (``messages``).
That adds no deadlock. Take the first message M of the order that never completes. Its sender reaches
M's action: what it waits for before that are receives at earlier timesteps, whose sends come earlier in
the order, and messages it issued before M; all come before M, so all complete. Its receiver posts M's
receive: it issues in order, so it cannot wait for anything ordered after M without having posted M's
receive first, and what it waits for before M completes. With both ends issued and everything before M
on the pair complete, M completes: no such M.

Worked example, 1F1B with pp=2 and 4 microbatches; the grid puts 0SF1 at timestep 3 and 1SB0 at 5::

    rank 0 issues: header+0SF0 (t1), 0SF1 (t3), 0RB0 (t5), 0SF2 (t9), 0RB1 (t9 from rank 1), ...
    rank 1 issues: header+1RF0 (t1), 1RF1 (t3), 1SB0 (t5), 1RF2 (t9), 1SB1 (t9), ...

Rank 1 posts its receive of microbatch 1's activation before it sends microbatch 0's gradient, where
its action list has them the other way round (``1SB0 1RF1``): rank 0 sent microbatch 1 first.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .actions import Action
from .lowering import match

__all__ = ["Message", "PARTS", "send_timesteps", "message_order"]

PARTS = ("header", "data", "side")
"""The parts of one message, in the order they travel: the shape header (the first activation over a stage
boundary whose shape the receiver does not know yet), the tensor, the side band (``work.Sideband``)."""


@dataclass(frozen=True)
class Message:
    """One part of one message as this rank issues it."""

    action: Action  # this rank's SF / SB (send) or RF / RB (receive)
    part: str  # one of PARTS
    peer: int  # the pipeline rank at the other end
    at: int  # the lockstep timestep of the send
    sender: int  # the sending pipeline rank

    @property
    def send(self) -> bool:
        return self.action.kind in ("SF", "SB")

    def __str__(self) -> str:
        return f"{self.action}" + ("" if self.part == "data" else f" {self.part}")


def send_timesteps(plan, timesteps: list[list[int]]) -> dict[Action, int]:
    """The lockstep timestep of every send of a lowered plan (``timesteps[r][i]``: of rank r's i-th action)."""
    return {a: timesteps[r][i] for r, row in enumerate(plan.actions) for i, a in enumerate(row)
            if a.kind in ("SF", "SB")}


def message_order(plan, rank: int, actions: Iterable[Action], sent_at: dict[Action, int],
                  header: Callable[[Action], bool] = lambda a: False, side: bool = False) -> list[Message]:
    """This rank's messages among ``actions`` (its actions of the step, in list order), in issue order.

    ``header(a)``: whether the first activation over ``a``'s stage boundary this step carries a shape
    header (asked for SF and RF actions; both ends must answer alike); ``side``: whether every message
    is followed by a side-band message."""
    out: list[Message] = []
    seen: set[int] = set()  # stage boundaries (by sending stage) whose first activation was placed
    for a in actions:
        if not a.is_comm:
            continue
        sender_action = a if a.kind in ("SF", "SB") else match(a)
        peer = plan.rank_of(match(a).stage)
        at, sender = sent_at[sender_action], plan.rank_of(sender_action.stage)
        parts = ["data"]
        if a.kind in ("SF", "RF"):
            boundary = sender_action.stage
            if boundary not in seen:
                seen.add(boundary)
                if header(a):
                    parts.insert(0, "header")
        if side:
            parts.append("side")
        out += [Message(a, p, peer, at, sender) for p in parts]
    out.sort(key=lambda m: (m.at, m.sender, PARTS.index(m.part)))
    assert rank not in {m.peer for m in out}, "a local hand-off has no message"
    return out
