"""ZeRO stage 2's gradients: each bucket's full storage lives only while it is needed.

Stage 2 keeps, between steps, only this rank's reduced piece of every gradient bucket
(4 Psi / N bytes in fp32). Inside a step each bucket's full-size storage is made when
backward first writes to that bucket and released as soon as its own reduce-scatter has
completed, so a rank never holds the whole model's gradients at once:

- the first gradient of a bucket (autograd's fresh tensor, ``param.grad`` is None) makes the
  bucket (``torch.empty``, its padding zeroed) and is copied into its slice; ``param.grad``
  then is that slice, so later contributions to it (zero-bubble W's in-place ``addmm``, a
  pipeline's later microbatches) add in place;
- when the last of the bucket's parameters has arrived the bucket is scaled by 1/N and its
  reduce-scatter starts (from the hook, overlapping the rest of backward); its parameters'
  ``.grad`` go back to None at once, so nothing writes into a buffer in flight;
- at most one reduce-scatter is in flight: before a bucket starts, the previous one is
  waited for, its result kept (this rank's piece) and its full storage dropped. A finished
  one is also dropped as soon as a new bucket is made (``is_completed``). With gradients
  arriving in bucket order (backward's order, as here) a rank holds at most two full
  buckets: one being reduced, one filling.

Mixed precision: a bucket is reduce-scattered as an fp32 copy (the 16-bit bucket is dropped once
the copy is made), in place, and this rank's block is rounded into the 16-bit piece as soon as the
reduction completes (added to it for later microbatches, as one process accumulates 16-bit
gradients), so no fp32 piece lives through backward. ``finish()`` makes the masters' fp32
gradients from the pieces one piece at a time and releases each 16-bit piece (its storage resized
to 0) as soon as its fp32 gradient exists; ``zero()`` gives the pieces back, zeroed, after the
step. So the step holds 4 Psi / N of gradients (the fp32 ones, plus at most one 16-bit piece while
it is converted) instead of 6 Psi / N, and between steps the pieces are there again: the paper's
2 Psi / N. Why not make the fp32 gradient straight from the fp32 reduction: with microbatches > 1
the 16-bit piece must exist through backward anyway (one process accumulates 16 bits), and with
one microbatch an fp32 block kept through backward would be 4 Psi / N where the piece is 2 Psi / N;
the values are the same either way (the fp32 gradient is the 16-bit piece widened), so parity with
one process stays exact. The pieces are separate tensors under mixed precision, one storage each,
so that each can go as soon as it is converted.

Gradient accumulation (``microbatches > 1``). Without pipeline parallelism every microbatch
is reduced: each microbatch's buckets are reduce-scattered and freed as above, the first
reduction of the step written into the piece, the later ones (reduced in place into this
rank's own block of the bucket) added to it. This is DeepSpeed's stage 2 and FSDP2's default
with accumulation. The other choice, keeping the buckets until the last microbatch (one
reduce-scatter per step), would hold all 4 Psi of gradients from the first microbatch's
backward to the last one's, which is stage 1's memory: the point of stage 2 is lost exactly
when memory is short enough to need accumulation. The cost is m reduce-scatters per step
instead of one (wire bytes (n-1)/n S per microbatch and bucket). Every rank makes exactly one
reduction per bucket and microbatch: a bucket still incomplete when the next microbatch is
armed (a parameter without gradient) is reduced then, its missing slices zero, and a bucket
that got nothing is reduced as zeros, so ranks whose gradients differ never disagree on the
collectives. With pipeline parallelism the executor interleaves the microbatches' backward
(and zero-bubble W) passes, so no point ends one microbatch's gradients: there each bucket
is made at its first gradient, kept to the last microbatch and freed after its single
reduce-scatter.

Worked example, dp=2, microbatches=2, four buckets b3..b0 in backward order (sizes S)::

    microbatch 0 backward   b3 filled -> RS(b3) starts      held: b3
                            b2 filled -> wait RS(b3): piece3 = its result, b3 freed; RS(b2) starts
                                                            held: b2 (+ b1 once its first grad arrives)
                            ... b0 -> RS(b0) starts
    arm microbatch 1        nothing incomplete, nothing to flush
    microbatch 1 backward   b3 filled -> wait RS(b0), b0 freed; RS(b3) into b3's own half, then piece3 += it
    finish()                wait RS(b0); every piece holds (sum over microbatches and ranks) / 2
    held between steps      the pieces only: 4 Psi / N

``peak_nbytes`` (this rank's figure, counted as the buffers come and go, an add and a compare
per bucket): the pieces plus the most full-bucket bytes (buckets and their fp32 copies under
mixed precision) held at once during the last step. ``colab_kit.memory.peak`` measures the
same from outside, on any training code alike.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from ..config import Axis
from .. import comm
from ..measure import tensor_bytes
from .stage1 import ZeroStage1

__all__ = ["ZeroStage2", "stage2_bucket_bytes"]


def stage2_bucket_bytes(params, n: int) -> int:
    """Stage 2's default bucket: 1/(2N) of the gradients (at least 64 KiB, at most DDP's 25 MB),
    so that the two full buckets a rank may hold at once weigh about its own piece (4 Psi / N)."""
    return stage2_bucket_size(sum(p.numel() * p.element_size() for p in params), n)


def stage2_bucket_size(total: int, n: int) -> int:
    """``stage2_bucket_bytes`` of ``total`` gradient bytes over ``n`` ranks (``ck.plan`` prices it so)."""
    return min(25 << 20, max(64 << 10, total // (2 * n)))


class ZeroStage2(ZeroStage1):
    """``ZeroStage1`` at stage 2 with each bucket's full storage freed after its reduce-scatter."""

    def __init__(self, params, mesh, axis: str = Axis.DP, bucket_bytes: int | None = None, events=None,
                 stage: int = 2, offload: str = "none", placements=None, group_of=None):
        params = [p for p in params if p.requires_grad]
        if bucket_bytes is None:
            bucket_bytes = stage2_bucket_bytes(params, mesh.size(axis))
        super().__init__(params, mesh, axis, bucket_bytes, events, 2, offload, placements, group_of)
        self.every_microbatch = mesh.size(Axis.PP) == 1
        """True: every microbatch is reduced (the engine's loop); False: the pipeline's, once per step."""
        for b in self.buckets:
            b.slots, off = {}, 0
            for p in b.params:
                b.slots[id(p)] = (off, p.numel())
                off += p.numel()
            b.used, b.written, b.launched = off, set(), False
        # (source, (target, block) or None, pending): the one reduce-scatter in flight
        self._inflight: tuple[torch.Tensor, tuple | None, Any] | None = None
        self._first = [True] * len(self.buckets)  # no reduction of this bucket yet this step
        self._open = False  # a generation armed with reductions on, not yet flushed
        self._active = False  # between the first arm() of a step and finish()
        if self.masters is not None:  # one storage per piece, each released once its fp32 gradient exists
            self._pieces = [torch.zeros_like(piece) for piece in self._pieces]
            self._grad_shard = None
        self._full = 0  # full-bucket bytes held now
        self.peak_full = 0
        """The most full-bucket bytes held at once during the last step."""

    # ------------------------------------------------------------------ buffers
    def _attach(self) -> None:
        """No full gradient buffer outside backward: each bucket is made at its first gradient."""
        for b in self.buckets:
            b.buffer = None
            for p in b.params:
                p.grad = None

    def _hold(self, nbytes: int) -> None:
        self._full += nbytes
        if self._full > self.peak_full:
            self.peak_full = self._full

    def _make(self, bucket) -> torch.Tensor:
        self._poll()
        buf = torch.empty(self.sizes[bucket.index], dtype=self.param_flat.dtype, device=self.param_flat.device)
        if bucket.used < buf.numel():
            buf[bucket.used:].zero_()  # padding: reduced with the bucket, must be zero
        bucket.buffer = buf
        self._hold(tensor_bytes([buf]))
        return buf

    @property
    def nbytes(self) -> int:
        """Gradient bytes held now: the pieces, and the full buckets that exist at this moment."""
        held = [b.buffer for b in self.buckets] + [self._inflight[0] if self._inflight else None]
        return tensor_bytes(self._pieces + held)

    @property
    def peak_nbytes(self) -> int:
        """The pieces plus the most full-bucket bytes held at once in the last step."""
        return tensor_bytes(self._pieces) + self.peak_full

    # ------------------------------------------------------------------ backward
    def arm(self, sync: bool, t0: float | None = None) -> None:
        if not self._active:  # a new step
            self._active, self.peak_full = True, self._full
        if self.every_microbatch:
            sync = True
        if self._open:  # the previous microbatch: reduce what it left incomplete
            self._flush()
        self._open = self._sync = sync
        if t0 is not None:
            self.t0 = t0
        for b in self.buckets:
            b.ready, b.launched = 0, False

    def _on_grad(self, bucket, param) -> None:
        key = id(param)
        if key not in bucket.written:  # a fresh gradient: into the bucket, which it may have to make
            grad = param.grad
            if grad is None:
                return
            buf = bucket.buffer if bucket.buffer is not None else self._make(bucket)
            off, k = bucket.slots[key]
            view = buf[off:off + k].view_as(param)
            view.copy_(grad)
            param.grad = view
            bucket.written.add(key)
        if self._sync:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket)

    def _launch(self, bucket) -> None:
        """Reduce-scatter this generation of ``bucket`` (missing slices zero) and detach it."""
        i, buf = bucket.index, bucket.buffer
        if buf is None:  # nothing arrived: zeros, so that every rank joins the same collectives
            buf = self._make(bucket)
            buf.zero_()
        elif len(bucket.written) < len(bucket.params):
            for p in bucket.params:
                if id(p) not in bucket.written:
                    off, k = bucket.slots[id(p)]
                    buf[off:off + k].zero_()
        for p in bucket.params:
            p.grad = None
        bucket.buffer, bucket.written, bucket.ready, bucket.launched = None, set(), 0, True
        self._retire()  # at most one in flight
        src = buf
        if self.masters is not None:  # mixed precision (or offload): reduce an fp32 copy, kept as 16 bits
            src = buf.float()
            if src.data_ptr() != buf.data_ptr():
                self._hold(tensor_bytes([src]))
                self._full -= tensor_bytes([buf])
            del buf
        n, r = self.size, self.rank
        if self.divisor != 1:
            src.div_(self.divisor)
        k = src.numel() // n
        piece = self._pieces[i]
        if self._first[i] and self.masters is None:  # straight into the piece
            out, add = piece, None
        else:  # in place into this rank's block, then into the (16-bit under mixed precision) piece
            out = src[r * k:(r + 1) * k]
            add = (piece, out, self._first[i])
        self._first[i] = False
        start = time.perf_counter() - self.t0

        def record():
            self.events.append({"name": f"reduce_scatter bucket {i}", "kind": "comm", "start": start,
                                "end": time.perf_counter() - self.t0})

        pending = comm.reduce_scatter_into(out, src, self.mesh, self.axis, async_op=True,
                                           tag=f"grad bucket {i}", then=record)
        self._inflight = (src, add, pending)

    def _retire(self) -> None:
        """Wait for the reduce-scatter in flight, keep this rank's piece, drop the full storage."""
        if self._inflight is None:
            return
        src, add, pending = self._inflight
        self._inflight = None
        pending.wait()
        if add is not None:
            piece, block, first = add
            piece.copy_(block) if first else piece.add_(block)
        self._full -= tensor_bytes([src])

    def _poll(self) -> None:
        if self._inflight is not None:
            work = self._inflight[2].work
            if work is None or work.is_completed():
                self._retire()

    def _flush(self) -> None:
        """Reduce every bucket not yet reduced in this generation."""
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        self._open = False

    def finish(self) -> None:
        """Reduce what the last microbatch left, wait for the last reduce-scatter: the pieces are whole."""
        if not self._active:
            return
        self._flush()
        self._retire()
        self._active = False
        if self.masters is not None:  # the masters' fp32 gradients, made from the pieces for this step
            for master, piece in zip(self.masters.params, self._pieces, strict=True):
                master.grad = piece.to(device=master.device, dtype=torch.float32).view_as(master)
                if master.grad.untyped_storage().data_ptr() != piece.untyped_storage().data_ptr():
                    piece.untyped_storage().resize_(0)  # its values live on in the fp32 gradient; back at zero()
        else:
            for shard, piece in zip(self.shards, self._pieces):  # again: a user's optimizer.zero_grad() drops them
                shard.grad = piece

    def zero(self) -> None:
        self._first = [True] * len(self.buckets)
        for piece in self._pieces:  # mixed precision: the pieces released at finish() come back, zeroed
            size = piece.numel() * piece.element_size()
            if piece.untyped_storage().nbytes() < size:
                piece.untyped_storage().resize_(size)
                piece.zero_()
