"""The executor's communication actions: SF, SB (``isend``) and RF, RB (blocking receive).

A mixin of ``PipelineExecutor``: each message goes between the same dp/sp/tp coordinates
of two neighbouring pipeline ranks, over the mesh's ``pp`` group, recorded in ``mesh.log``
as ``send@pp`` / ``recv@pp`` with the action as its tag. A message's backend tag is
``lowering.message_tag`` (equal at both ends, so messages match whatever order they arrive
in) with the step number (mod 256) and a header bit above it (``step_tag``): a message left
over from a broken step can never be taken for one of the next.

Receives are posted early: before each action the executor posts the ``irecv`` of the next
``prefetch`` receives of its list (2 by default) whose buffer it can already shape, so a
message that arrives while the rank computes lands at once, and a send followed by a
receive (``0SF3 0RB1`` in 1F1B's steady state) has both in flight before anything waits.
Every posted send and receive is armed (``comm.isend(..., arm=True)``): a waiter thread
waits on it from the moment it is posted, so the receive action finds a message that came
in during compute already complete and goes on without handing its wait to a thread, and
the end of the step finds its sends done. The receive action itself then only waits.

Worked example, pp=2, step 5, stage 0 on rank 0 sends microbatch 1's activation ``[2, 16, 32]``::

    rank 0  0SF1: isend(act, to pp 1, tag=step_tag(0SF1, step 5))   completed at the end of the step
    rank 1  (while running 1F0) irecv(buffer [2, 16, 32], from pp 0, same tag) posted early
    rank 1  1RF1: wait for it (at most ``timeout`` s, waking on the hang flag)  -> input of 1F1

The receiver learns the activation's shape and dtype from a small header (8 int64s) sent
before the first activation over each stage boundary (per batch shape and microbatch
count); later transfers reuse it. A gradient has the shape of the output it belongs to,
which the receiving stage holds already.

With a ``work.side`` (``pipeline.work.Sideband``) each cross-rank activation and gradient is followed by
its microbatch's side message (fixed shape, its own tag bit), posted with the main receive and handed to
``side.incoming`` when the receive action completes; none rides a forward-only pass.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .. import comm
from .lowering import message_tag

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
    _posted: dict
    _side_posted: dict
    _side: Sideband | None  # the step's, or None (none set, or a forward-only pass)
    _shapes: dict
    _shapes_sent: set
    _saved: dict
    _act: dict
    _out: dict
    _gout: dict
    _gin: dict
    _sends: list
    _since: float
    _hang: Callable[[str], PipelineHang]
    _set: Callable[..., None]
    _take: Callable[[dict, object, str], torch.Tensor]

    def _tag(self, a, header: bool = False, side: bool = False) -> int:
        return step_tag(a, self.m, self.step, header, side)

    def _peer(self, a) -> int:
        """The pipeline rank receive ``a`` comes from: the stage before (RF) or after (RB)."""
        return self.plan.rank_of(a.stage - 1 if a.kind == "RF" else a.stage + 1)

    def _post_ahead(self, j: int) -> None:
        """Post the irecv of the next ``prefetch`` receives after position ``j`` that can be shaped now."""
        for a in self._ahead[j]:
            if a not in self._posted:
                buf = self._recv_buffer(a)
                if buf is not None:
                    self._posted[a] = self._post(a, buf)

    def _recv_buffer(self, a):
        """An empty buffer of the right shape for receive ``a``, or None while its shape is unknown."""
        if a.kind == "RF":
            known = self._shapes.get((a.stage - 1, self._key))
            return None if known is None else torch.empty(known[0], dtype=known[1], device=self.mesh.device)
        saved = self._saved.get((a.stage, a.microbatch))
        return None if saved is None else torch.empty_like(saved[1])

    def _post(self, a, buf):
        peer = self._peer(a)
        try:
            self._post_side(a, peer)
            return comm.irecv(buf, self.mesh, "pp", peer, msg_tag=self._tag(a), tag=str(a), arm=True), buf
        except RuntimeError as exc:
            raise self._hang(f"rank {self.mesh.global_rank} could not receive {a}: {_last(exc)}") from exc

    def _do_SF(self, a, s, m):
        t = self._take(self._out, a, "the activation to send")
        key = (s, self._key)
        if key not in self._shapes_sent:
            self._shapes_sent.add(key)
            self._send(a, _pack(t), self.plan.rank_of(s + 1), self._tag(a, header=True), f"{a} shape")
        self._send(a, t, self.plan.rank_of(s + 1), self._tag(a), str(a))
        self._send_side(a, m, self.plan.rank_of(s + 1))

    def _do_SB(self, a, s, m):
        self._send(a, self._take(self._gin, a, "the input gradient to send"), self.plan.rank_of(s - 1),
                   self._tag(a), str(a))
        self._send_side(a, m, self.plan.rank_of(s - 1))

    def _send_side(self, a, m, peer):
        if self._side is not None:
            self._send(a, self._side.outgoing(m), peer, self._tag(a, side=True), f"{a} side")

    def _post_side(self, a, peer):
        """With a sideband, post receive ``a``'s side message beside it (once)."""
        if self._side is not None and a not in self._side_posted:
            buf = torch.empty(self._side.shape, dtype=self._side.dtype, device=self.mesh.device)
            self._side_posted[a] = (comm.irecv(buf, self.mesh, "pp", peer, msg_tag=self._tag(a, side=True),
                                               tag=f"{a} side", arm=True), buf)

    def _do_RF(self, a, s, m):
        key = (s - 1, self._key)
        if key not in self._shapes and a not in self._posted:
            header = torch.zeros(8, dtype=torch.int64, device=self.mesh.device)
            self._recv(a, (comm.irecv(header, self.mesh, "pp", self.plan.rank_of(s - 1),
                                      msg_tag=self._tag(a, header=True), tag=f"{a} shape"), header))
            self._shapes[key] = _unpack(header)
        self._act[s, m] = self._recv(a)
        self._recv_side(a, m)

    def _do_RB(self, a, s, m):
        self._gout[s, m] = self._recv(a)
        self._recv_side(a, m)

    def _recv_side(self, a, m):
        """Wait for receive ``a``'s side message (posted with it) and hand it to the step's sideband."""
        if self._side is None:
            return
        self._post_side(a, self._peer(a))
        pending, buf = self._side_posted.pop(a)
        self._wait(pending, a, f"its side message (microbatch {m})")
        self._side.incoming(m, buf)

    # ------------------------------------------------------------------ posting and waiting
    def _send(self, a, t, peer, msg_tag, label):
        try:
            self._sends.append((a, comm.isend(t, self.mesh, "pp", peer, msg_tag=msg_tag, tag=label, arm=True)))
        except RuntimeError as exc:
            raise self._hang(f"rank {self.mesh.global_rank} could not send {a}: {_last(exc)}") from exc

    def _recv(self, a, posted=None):
        """Wait for receive ``a`` (posted ahead, or now) and return its buffer."""
        posted = posted or self._posted.pop(a, None) or self._post(a, self._recv_buffer(a))
        pending, buf = posted
        peer = self._peer(a)
        self._set("waiting")
        what = (f"the activation of stage {a.stage - 1}" if a.kind == "RF" else
                f"the input gradient of stage {a.stage + 1}") + f", microbatch {a.microbatch}"
        self._wait(pending, a, what + f", from rank {self.mesh.ranks('pp')[peer]} (pp {peer})")
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


