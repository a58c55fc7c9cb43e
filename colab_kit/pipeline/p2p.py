"""The executor's communication actions: SF, SB (``isend``) and RF, RB (blocking receive).

A mixin of ``PipelineExecutor``: each message goes between the same dp/sp/tp coordinates
of two neighbouring pipeline ranks, over the mesh's ``pp`` group, recorded in ``mesh.log``
as ``send@pp`` / ``recv@pp`` with the action as its tag. Messages carry
``lowering.message_tag`` (equal at both ends), so they match whatever order they arrive in.

Worked example, pp=2, stage 0 on rank 0 sends microbatch 1's activation ``[2, 16, 32]``::

    rank 0  0SF1: isend(act, to pp 1, tag=message_tag(0SF1))      completed at the end of the step
    rank 1  1RF1: irecv(buffer [2, 16, 32], from pp 0, same tag).wait(timeout)  -> input of 1F1

The receiver learns the activation's shape and dtype from a small header (8 int64s) sent
before the first activation over each stage boundary (per batch shape and microbatch
count); later transfers reuse it. A gradient has the shape of the output it belongs to,
which the receiving stage holds already.
"""
from __future__ import annotations

import time

import torch

from .. import comm
from .lowering import message_tag

__all__ = ["CommActions"]

_HEADER = 1 << 24  # tag offset of shape headers
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


class CommActions:
    """SF, SB, RF, RB and the timed wait behind every receive (see ``PipelineExecutor``)."""

    def _do_SF(self, a, s, m):
        t = self._take(self._out, a, "the activation to send")
        key = (s, self._key)
        if key not in self._shapes_sent:
            self._shapes_sent.add(key)
            self._send(a, _pack(t), (s + 1) % self.pp, _HEADER + message_tag(a, self.m), f"{a} shape")
        self._send(a, t, (s + 1) % self.pp, message_tag(a, self.m), str(a))

    def _do_SB(self, a, s, m):
        self._send(a, self._take(self._gin, a, "the input gradient to send"), (s - 1) % self.pp,
                   message_tag(a, self.m), str(a))

    def _do_RF(self, a, s, m):
        key, src = (s - 1, self._key), (s - 1) % self.pp
        if key not in self._shapes:
            header = torch.zeros(8, dtype=torch.int64, device=self.mesh.device)
            self._recv(a, header, src, _HEADER + message_tag(a, self.m), f"{a} shape")
            self._shapes[key] = _unpack(header)
        shape, dtype = self._shapes[key]
        self._act[s, m] = self._recv(a, torch.empty(shape, dtype=dtype, device=self.mesh.device), src,
                                     message_tag(a, self.m), str(a))

    def _do_RB(self, a, s, m):
        y = self._saved[s, m][1]
        self._gout[s, m] = self._recv(a, torch.empty_like(y), (s + 1) % self.pp, message_tag(a, self.m), str(a))

    # ------------------------------------------------------------------ posting and waiting
    def _send(self, a, t, peer, msg_tag, label):
        try:
            self._sends.append((a, comm.isend(t, self.mesh, "pp", peer, msg_tag=msg_tag, tag=label)))
        except RuntimeError as exc:
            raise self._hang(f"rank {self.mesh.global_rank} could not send {a}: {_last(exc)}") from exc

    def _recv(self, a, buf, peer, msg_tag, label):
        try:
            pending = comm.irecv(buf, self.mesh, "pp", peer, msg_tag=msg_tag, tag=label)
        except RuntimeError as exc:
            raise self._hang(f"rank {self.mesh.global_rank} could not receive {a}: {_last(exc)}") from exc
        self._set("waiting")
        what = (f"the activation of stage {a.stage - 1}" if a.kind == "RF" else
                f"the input gradient of stage {a.stage + 1}") + f", microbatch {a.microbatch}"
        self._wait(pending, a, what + f", from rank {self.mesh.ranks('pp')[peer]} (pp {peer})")
        return buf

    def _wait(self, pending, a, what: str) -> None:
        try:
            pending.wait(self.timeout)
        except RuntimeError as exc:
            waited = time.perf_counter() - self._since
            raise self._hang(f"rank {self.mesh.global_rank} (pp {self.me}) waited {waited:.1f} s for {a} "
                             f"({what}); the backend said: {_last(exc)}") from exc


def _pack(t: torch.Tensor) -> torch.Tensor:
    """Shape header: [dtype code, ndim, dims...] in 8 int64s."""
    if t.dim() > 6:
        raise ValueError(f"pipeline activations of up to 6 dims travel between stages, got shape {tuple(t.shape)}")
    return torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (6 - t.dim()), dtype=torch.int64,
                        device=t.device)


def _unpack(h: torch.Tensor):
    h = h.tolist()
    return tuple(h[2:2 + h[1]]), _DTYPES[h[0]]


def _last(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


