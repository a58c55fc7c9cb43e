"""The executor's communication actions: SF, SB (``isend``) and RF, RB (blocking receive).

A mixin of ``PipelineExecutor``: each message goes between the same dp/sp/tp coordinates
of two neighbouring pipeline ranks, over the mesh's ``pp`` group, recorded in ``mesh.log``
as ``send@pp`` / ``recv@pp`` with the action as its tag.

Messages are issued in one order that both ends derive from the plan (``order.message_order``:
by the lockstep timestep of the send, then the sending rank, then header, data, side), so they
match by order as NCCL matches them, whatever the tags. A send is issued when its action runs,
after every receive ordered before it has been posted; a receive is posted as soon as everything
ordered before it was issued: before each action the executor posts, as far as the order allows
without waiting, up to the next ``prefetch`` receives of its list (2 by default), so a message that
arrives while the rank computes lands at once. Every posted send and receive is armed
(``comm.isend(..., arm=True)``): a waiter thread waits on it from the moment it is posted, so a
receive action finds a message that came in during compute already complete (on NCCL its CUDA event
says so instead: a thread in NCCL's ``wait()`` would stall the compute stream, ``comm.p2p``). The backend tag is
still ``lowering.message_tag`` with the step (mod 256) and a header or side bit (``step_tag``), which
gloo uses and NCCL (and ``comm.rules``) ignore.

A send is let go as soon as it completes: its Work keeps the tensor alive (NCCL's Work does, and so do
gloo's and ``comm.rules``'), so a Work kept to the end of the step would keep every activation and
input gradient the rank sent, a 1F1B stage's memory growing with the microbatches. Before each action
the executor finishes (records and drops) the sends that completed meanwhile, without blocking; before
a send to a peer it waits for its earlier sends to that peer, as NCCL runs a pair's messages in issue
order anyway. So beside what the schedule keeps for backward a rank holds at most the latest send
action's messages per peer, whatever the number of microbatches. Waiting for a message this rank has
issued cannot deadlock (``order``'s docstring).

Worked example, 1F1B, pp=2, step 5, stage 0 on rank 0 sends microbatch 1's activation ``[2, 16, 32]``::

    rank 0  0SF1: wait for 0SF0 (the pair's last send; received by now), drop it and its tensor;
                  isend(act, to pp 1, tag=step_tag(0SF1, step 5))
    rank 1  (while running 1F0) irecv(buffer [2, 16, 32], from pp 0) posted early: ordered next
    rank 1  1RF1: wait for it (at most ``timeout`` s, waking on the hang flag)  -> input of 1F1
    rank 0  before its first action after 1RF1 took the data: 0SF1 complete, dropped with the activation

The receiver learns the activation's shape and dtype from a small header (8 int64s) sent
before the first activation over each stage boundary (per batch shape and microbatch
count); later transfers reuse it. A gradient has the shape of the output it belongs to,
which the receiving stage holds already.

With a ``work.side`` (``pipeline.work.Sideband``) each cross-rank activation and gradient is followed by
its microbatch's side message (fixed shape), sent right after the data and posted right after its
receive, and handed to ``side.incoming`` when the receive action completes; none rides a forward-only pass.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..config import Axis
from .. import comm
from .lowering import message_tag
from .order import Message, message_order

if TYPE_CHECKING:
    from ..mesh import ProcessMesh
    from .hang import HangMonitor, PipelineHang
    from .plan import PipelinePlan
    from .work import Sideband

__all__ = ["CommActions"]

_STEP_SHIFT, _STEPS = 23, 256  # tag = step % 256 << 23 | kind << 21 | message_tag (kind: 0 data, 1 header, 2 side)
_HEADER_BIT, _SIDE_BIT = 1 << 21, 1 << 22
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def step_tag(a, microbatches: int, step: int, header: bool = False, side: bool = False) -> int:
    """The backend tag of action ``a``'s message in ``step`` (equal at both ends)::

        >>> from colab_kit.pipeline.actions import parse
        >>> step_tag(parse("0SF1"), 2, step=5) == step_tag(parse("1RF1"), 2, step=5)
        True
        >>> step_tag(parse("0SF1"), 2, step=5) != step_tag(parse("0SF1"), 2, step=6)
        True
        >>> len({step_tag(parse("0SF1"), 2, 5), step_tag(parse("0SF1"), 2, 5, header=True),
        ...      step_tag(parse("0SF1"), 2, 5, side=True)})
        3
    """
    base = message_tag(a, microbatches)
    if base >= _HEADER_BIT:
        raise ValueError(f"{a}: message number {base} does not fit the 21 bits of a pipeline tag; use fewer "
                         "stages x microbatches per step")
    return ((step % _STEPS) << _STEP_SHIFT) | (_HEADER_BIT if header else 0) | (_SIDE_BIT if side else 0) | base


class CommActions:
    """SF, SB, RF, RB and the timed wait behind every receive (see ``PipelineExecutor``)."""

    prefetch: int = 2
    """How many of the coming receives are posted ahead of the action that waits for them."""

    # what this mixin reads and writes of the executor it is part of (``PipelineExecutor`` sets them)
    mesh: ProcessMesh
    plan: PipelinePlan
    monitor: HangMonitor
    me: int  # this rank's pipeline rank
    m: int  # microbatches of the step
    step: int
    timeout: float
    _key: tuple  # the step's batch shape and microbatch count: names the activation shapes
    _ahead: list[tuple]
    _actions: list  # the actions this step runs on this rank
    _order: list[Message]  # this step's messages in issue order (``order.message_order``)
    _last: dict  # action -> the index in _order of its last part
    _next: int  # the first message of _order not issued yet
    _posted: dict  # (action, part) -> (pending receive, buffer)
    _side: Sideband | None  # the step's, or None (none set, or a forward-only pass)
    _shapes: dict
    _shapes_sent: set
    _saved: dict
    _act: dict
    _out: dict
    _gout: dict
    _gin: dict
    _sends: list  # (action, peer, pending send): this rank's sends not finished yet (``_settle``)
    _since: float
    _hang: Callable[[str], PipelineHang]
    _set: Callable[..., None]
    _take: Callable[[dict, object, str], torch.Tensor]

    def _tag(self, a, header: bool = False, side: bool = False) -> int:
        return step_tag(a, self.m, self.step, header, side)

    def _peer(self, a) -> int:
        """The pipeline rank receive ``a`` comes from: the stage before (RF) or after (RB)."""
        return self.plan.rank_of(a.stage - 1 if a.kind == "RF" else a.stage + 1)

    def _plan_messages(self, sent_at: dict) -> None:
        """This step's issue order (``order.message_order``) over the actions the step runs."""
        def header(a):
            if a.kind == "SF":
                return (a.stage, self._key) not in self._shapes_sent
            return (a.stage - 1, self._key) not in self._shapes
        self._order = message_order(self.plan, self.me, self._actions, sent_at, header, self._side is not None)
        self._last = {msg.action: i for i, msg in enumerate(self._order)}
        self._next, self._posted = 0, {}

    def _post_ahead(self, j: int) -> None:
        """Post the receives ordered before the next ``prefetch`` receives after position ``j``, as far as
        the order allows without waiting: up to this rank's next send, or a buffer not yet shapeable."""
        if self._ahead[j]:
            self._issue_to(self._last[self._ahead[j][-1]], block=False)

    def _issue_to(self, i: int, block: bool, sending=None) -> None:
        """Issue this step's messages up to index ``i`` of the order: post the receives, and the parts of
        ``sending`` (``(action, tensor)``, the send being run). Without ``block`` it stops where it would
        have to wait (this rank's next send, or a receive whose shape is not known yet)."""
        while self._next <= i:
            msg = self._order[self._next]
            if msg.send:
                if sending is None or msg.action != sending[0]:
                    if block:
                        raise RuntimeError(f"rank {self.mesh.global_rank}: {msg} is ordered before "
                                           f"{self._order[i]} but has not run (the message order is broken)")
                    return
                self._send_part(msg, sending[1])
            else:
                buf = self._buffer(msg, block)
                if buf is None:
                    return
                self._posted[msg.action, msg.part] = self._post(msg, buf)
            self._next += 1

    def _buffer(self, msg, block: bool):
        """An empty buffer for receive ``msg``, or None (without ``block``) while its shape is unknown."""
        a = msg.action
        if msg.part == "header":
            return torch.zeros(8, dtype=torch.int64, device=self.mesh.device)
        if msg.part == "side":
            assert self._side is not None
            return torch.empty(self._side.shape, dtype=self._side.dtype, device=self.mesh.device)
        if a.kind == "RB":
            saved = self._saved.get((a.stage, a.microbatch))
            if saved is None and block:
                raise RuntimeError(f"rank {self.mesh.global_rank}: {a} is due before its own forward ran")
            return None if saved is None else torch.empty_like(saved[1])
        key = (a.stage - 1, self._key)
        if key not in self._shapes:
            posted = self._posted.get((a, "header"))
            if posted is None or not (block or posted[0].ready()):
                return None
            del self._posted[a, "header"]
            self._wait(posted[0], a, f"its shape header, from pp {msg.peer}")
            self._shapes[key] = _unpack(posted[1])
        shape, dtype = self._shapes[key]
        return torch.empty(shape, dtype=dtype, device=self.mesh.device)

    def _post(self, msg, buf):
        try:
            return comm.irecv(buf, self.mesh, Axis.PP, msg.peer, msg_tag=self._tag(msg.action, msg.part == "header",
                                                                               msg.part == "side"),
                              tag=str(msg), arm=True), buf
        except RuntimeError as exc:
            raise self._hang(f"rank {self.mesh.global_rank} could not receive {msg}: {_last(exc)}") from exc

    def _send_part(self, msg, t) -> None:
        a = msg.action
        if msg.part == "header":
            self._shapes_sent.add((a.stage, self._key))
            t = _pack(t)
        elif msg.part == "side":
            assert self._side is not None
            t = self._side.outgoing(a.microbatch)
        self._send(a, t, msg.peer, self._tag(a, msg.part == "header", msg.part == "side"), str(msg))

    def _do_SF(self, a, s, m):
        self._issue_to(self._last[a], True, (a, self._take(self._out, a, "the activation to send")))

    def _do_SB(self, a, s, m):
        self._issue_to(self._last[a], True, (a, self._take(self._gin, a, "the input gradient to send")))

    def _do_RF(self, a, s, m):
        self._act[s, m] = self._recv(a)
        self._recv_side(a, m)

    def _do_RB(self, a, s, m):
        self._gout[s, m] = self._recv(a)
        self._recv_side(a, m)

    def _recv_side(self, a, m):
        """Wait for receive ``a``'s side message (posted with it) and hand it to the step's sideband."""
        if self._side is None:
            return
        pending, buf = self._posted.pop((a, "side"))
        self._wait(pending, a, f"its side message (microbatch {m})")
        self._side.incoming(m, buf)

    # ------------------------------------------------------------------ posting and waiting
    def _send(self, a, t, peer, msg_tag, label):
        self._settle(peer, a)  # the pair's earlier sends first: their tensors go as soon as they are received
        try:
            self._sends.append((a, peer, comm.isend(t, self.mesh, Axis.PP, peer, msg_tag=msg_tag, tag=label, arm=True)))
        except RuntimeError as exc:
            raise self._hang(f"rank {self.mesh.global_rank} could not send {a}: {_last(exc)}") from exc

    def _settle(self, peer: int | None = None, a=None) -> None:
        """Finish this rank's sends that are complete, and wait for those to ``peer`` of actions other than ``a``;
        each finished send is dropped, and the tensor it sent with it (a Work keeps its tensor, NCCL's as well).
        Before each action (no ``peer``) nothing blocks; before a send to ``peer``, the pair's earlier sends
        (a message already issued, so waiting cannot deadlock: ``order``'s docstring)."""
        keep = []
        for sent, to, pending in self._sends:
            if pending.ready():
                self._wait(pending, sent, "the peer to receive it")  # done: records it, raises its error if any
            elif to == peer and sent != a:
                self._set("waiting", f"{sent} (its send) to be received, before {a}")
                self._wait(pending, sent, "the peer to receive it")
                self._set("running")
            else:
                keep.append((sent, to, pending))
        self._sends = keep

    def _recv(self, a):
        """Issue everything up to receive ``a`` (and its side part), wait for it and return its buffer."""
        self._issue_to(self._last[a], block=True)
        pending, buf = self._posted.pop((a, "data"))
        peer = self._peer(a)
        self._set("waiting")
        what = (f"the activation of stage {a.stage - 1}" if a.kind == "RF" else
                f"the input gradient of stage {a.stage + 1}") + f", microbatch {a.microbatch}"
        self._wait(pending, a, what + f", from rank {self.mesh.ranks(Axis.PP)[peer]} (pp {peer})")
        return buf

    def _wait(self, pending, a, what: str) -> None:
        try:
            pending.wait(self.timeout)
        except comm.Aborted:
            self._set("stopped", f"in {a}")
            first = self.monitor.first()
            raise self._hang(f"rank {self.mesh.global_rank} (pp {self.me}) stopped waiting for {a} ({what}) "
                             f"because rank {first.get('rank')} reported: {first.get('reason')}") from None
        except RuntimeError as exc:
            waited = time.perf_counter() - self._since
            raise self._hang(f"rank {self.mesh.global_rank} (pp {self.me}) waited {waited:.1f} s for {a} "
                             f"({what}); the backend said: {_last(exc)}") from exc


def receives_ahead(actions, n: int) -> list[tuple]:
    """For each position j of ``actions``, the first ``n`` receives at or after j: what
    ``_post_ahead(j)`` looks at (worked out once per step, not once per action)."""
    out: list[tuple] = [()] * len(actions)
    coming: list = []
    for j in range(len(actions) - 1, -1, -1):
        if actions[j].kind in ("RF", "RB"):
            coming = [actions[j]] + coming[:n - 1]
        out[j] = tuple(coming[:n])
    return out


def _pack(t: torch.Tensor) -> torch.Tensor:
    """Shape header: [dtype code, ndim, dims...] in 8 int64s."""
    if t.dim() > 6:
        raise ValueError(f"pipeline activations of up to 6 dims travel between stages, got shape {tuple(t.shape)}")
    return torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (6 - t.dim()), dtype=torch.int64,
                        device=t.device)


def _unpack(h: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    v = h.tolist()
    return tuple(v[2:2 + v[1]]), _DTYPES[v[0]]


def _last(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


