"""Recorded point-to-point messages between two ranks of a mesh axis: ``isend``, ``irecv``
(tagged; armed for waiting when posted) and ``sendrecv`` (a ring's exchange). Part of
``colab_kit.comm``; see its docstring."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import rules
from .records import CommRecord
from .waiting import QUEUED_COMPLETES, Pending, _Waiter, finish

__all__ = ["P2PPending", "isend", "irecv", "sendrecv"]


class P2PPending(Pending):
    """A point-to-point send or receive in flight; ``wait(timeout)`` finishes and records it.

    With a ``timeout`` (seconds) a wait that runs out raises ``WaitTimeout``; while the
    mesh's ``abort_flag`` is set up (a pipeline step) a raised flag ends it with ``Aborted``.
    ``armed``: a waiter thread waits on it from the moment it was posted (``arm=True``; not on NCCL, see
    ``_p2p``); ``ready()`` says, without blocking, whether it is done.
    """

    armed: tuple | None = None

    def ready(self) -> bool:
        """Done, by the waiter thread's event (armed), or by NCCL's CUDA event (``work.is_completed()``, on a
        backend whose Work completes when queued: ``QUEUED_COMPLETES``); else False (not known without waiting)."""
        if self.armed is not None:
            return self.armed[0].is_set()
        return bool(QUEUED_COMPLETES[0]) and self.work.is_completed()

    def wait(self, timeout: float | None = None) -> CommRecord:
        called = time.perf_counter()
        finish(self.work, self.flag, f"{self.op} over {self.axis} ({self.tag})", timeout, self.armed)
        now = time.perf_counter()
        rec = self.log.add(self.op, self.axis, self.nbytes, now - self.t0, self.tag, end=now)
        rec.waited = called
        if self.then is not None:
            self.then()
        return rec


def _p2p(op, tensor, mesh, axis, peer, msg_tag, tag, arm=False):
    if not 0 <= peer < mesh.size(axis) or peer == mesh.rank(axis):
        raise ValueError(f"{op} over {axis} needs a peer coordinate other than this rank's "
                         f"({mesh.rank(axis)}) in 0..{mesh.size(axis) - 1}, got {peer}")
    other = mesh.ranks(axis)[peer]
    fn = dist.isend if op == "send" else dist.irecv
    kw = {"dst": other} if op == "send" else {"src": other}
    work = fn(tensor, group=mesh.group(axis), tag=msg_tag, **kw)
    pending = P2PPending(work, mesh.log, op, axis, tensor.numel() * tensor.element_size(), tag,
                         flag=mesh.abort_flag)
    if arm and not QUEUED_COMPLETES[0]:
        # Not on NCCL: its Work.wait() makes the calling thread's current stream, the device's default stream
        # that every thread shares, wait for the message; a thread waiting from the moment a receive is posted
        # ahead would hold all later compute behind it. There ``ready()`` reads the CUDA event, and the wait at
        # the receive action orders the stream where the data is used.
        pending.armed = _Waiter.watch(work)
    return pending


def isend(tensor: torch.Tensor, mesh, axis: str, peer: int, *, msg_tag: int = 0, tag: str = "",
          arm: bool = False) -> P2PPending:
    """Start sending ``tensor`` to the rank whose ``axis`` coordinate is ``peer`` (same other coordinates).

    ``msg_tag`` is the backend's message tag (the receive must use the same one); ``tag``
    labels the record. Keep ``tensor`` unchanged until ``wait()`` returns. ``arm=True``: a
    waiter thread starts waiting now, so ``wait()`` on a completed send returns at once
    (the pipeline's sends and receives are armed).
    """
    return _p2p("send", tensor.contiguous(), mesh, axis, peer, msg_tag, tag, arm)


def irecv(tensor: torch.Tensor, mesh, axis: str, peer: int, *, msg_tag: int = 0, tag: str = "",
          arm: bool = False) -> P2PPending:
    """Start receiving into ``tensor`` (contiguous, of the sent shape) from the ``axis`` coordinate ``peer``
    (``arm`` as for ``isend``)."""
    return _p2p("recv", tensor, mesh, axis, peer, msg_tag, tag, arm)


def sendrecv(send: torch.Tensor, recv: torch.Tensor, mesh, axis: str, to: int, source: int, *, msg_tag: int = 0,
             tag: str = "") -> list[P2PPending]:
    """Post a send of ``send`` to ``axis`` coordinate ``to`` and a receive into ``recv`` from ``source``, together.

    One ring step: every rank sends to its next and receives from its previous at once. Both
    go in one ``batch_isend_irecv``, so NCCL runs them as one group (posted one by one, the
    sends of a ring can wait on each other); gloo runs them as two messages. Returns the two
    ``P2PPending`` (send, recv), recorded as ``send`` / ``recv`` once waited. Keep ``send``
    unchanged until then. Ring attention's step on rank 1 of sp=4::

        sendrecv(kv, incoming, mesh, "sp", to=2, source=0, msg_tag=i, tag="ring kv")
    """
    n, me = mesh.size(axis), mesh.rank(axis)
    for op, peer in (("send", to), ("recv", source)):
        if not 0 <= peer < n or peer == me:
            raise ValueError(f"{op} over {axis} needs a peer coordinate other than this rank's ({me}) "
                             f"in 0..{n - 1}, got {peer}")
    send, group, ranks = send.contiguous(), mesh.group(axis), mesh.ranks(axis)
    ops = [dist.P2POp(dist.isend, send, ranks[to], group, msg_tag),
           dist.P2POp(dist.irecv, recv, ranks[source], group, msg_tag)]
    works = rules.batch_isend_irecv(ops)  # one group on NCCL and under its rules; torch's function elsewhere
    if len(works) == 1:  # NCCL returns the group's one Work: both records wait on it (the second at once)
        works = works * 2
    flag = mesh.abort_flag
    return [P2PPending(w, mesh.log, op, axis, t.numel() * t.element_size(), tag, flag=flag)
            for w, op, t in zip(works, ("send", "recv"), (send, recv))]


# --------------------------------------------------------------------------- autograd collectives
# Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053) names the pair of conjugate operators
# around a tensor-parallel MLP f and g: f is the identity forward and an all-reduce backward,
# g the reverse. Every collective they run is recorded like the plain ones above.
