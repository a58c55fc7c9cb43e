"""Copies between the host and the device for offload: on a GPU, on a side stream ordered by events.

Offload moves two kinds of bytes every step (``colab_kit.zero.offload``): a host chunk's shard to the
device before its all-gather (host -> device), and its reduced gradient piece back to the host
(device -> host). Made on the compute stream, each copy waits for every kernel queued before it and
holds back every kernel queued after it; a blocking copy back also stops the host until the GPU has
caught up, so the GPU then idles while the host queues the next unit's kernels. ``Copies`` makes them
on two side streams instead, one each way, so that a shard going up and a gradient going down overlap too:

- host -> device (``to_device``): the destination is allocated on the up stream and the copy from pinned
  host memory queued there at once, waiting for nothing the compute stream queued; an event is recorded.
  ``Copy.wait()`` makes the compute stream (not the host) wait for that event, and records the destination
  as used by the compute stream (``record_stream``), so the caching allocator does not reuse its memory
  until the compute stream is done with it. ``ChunkPlacement`` starts these one unit ahead of the
  all-gather that reads them, so the copy runs beside the compute before it.
- device -> host (``to_host``): the down stream waits for the compute stream (the piece is made there),
  copies into a pinned buffer, and records an event; the piece's memory is recorded as used by the down
  stream, so it goes back to the allocator as soon as the copy ran. ``Copy.wait()`` makes the host wait,
  then adds (or copies) the buffer into the host gradient. ZeRO-3 waits for them all (``drain``: both
  streams synchronized) before the optimizer steps the host shards, which is also when a pinned shard may
  next change.

Modes (``COLAB_KIT_COPIES``, or ``mode=``): ``"stream"`` (the default on CUDA), ``"inline"`` (the copies
on the compute stream, the device -> host ones blocking; ``bench/zero_streams.py`` times both), ``"now"``
(the default elsewhere: plain copies) and ``"lazy"``, CUDA's ordering played on CPU for tests: a copy happens
only when it is waited, reading its source then, its destination reads NaN until then, and a shard changed
between the copy's start and the drain raises. A missing wait changes the losses; a source changed too early
raises.

What each rank sees, dp=2, ZeRO-3 with offload, blocks b0 b1 b2 on the host, in forward::

    b0 starts   gather b1 (its copy, started at the embeddings, waited by the compute stream: done by now)
                copy b2's shard on the up stream         | b0's kernels on the compute stream
    b1 starts   gather b2 (waits b2's copy)             ; copy b3's shard ...
    backward    as forward in reverse; each block's reduced piece down on the down stream beside the next
    finish()    drain: both streams synchronized, the pieces added into the host gradients; the step
"""
from __future__ import annotations

import os

import torch

__all__ = ["Copies", "Copy", "MODES"]

MODES = ("stream", "inline", "now", "lazy")


class Copy:
    """One copy in flight; ``out`` is where it lands, ``wait()`` orders what reads ``out`` after it."""

    def __init__(self, out: torch.Tensor, hold=(), event=None, on_wait=None, where: str = "device"):
        self.out, self._hold, self._event, self._on_wait, self.where = out, hold, event, on_wait, where
        self.done = event is None and on_wait is None

    def wait(self) -> torch.Tensor:
        if not self.done:
            if self._event is not None:
                if self.where == "device":  # the compute stream waits; the host goes on
                    compute = torch.cuda.current_stream(self.out.device)
                    compute.wait_event(self._event)
                    self.out.record_stream(compute)  # made on the copy's stream, used (and freed) on this one
                else:
                    self._event.synchronize()
            if self._on_wait is not None:
                self._on_wait()
            self.done, self._hold, self._on_wait = True, (), None
        return self.out


class Copies:
    """Host <-> device copies of one rank's offload (see the module's docstring)."""

    def __init__(self, device, mode: str | None = None):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.mode = mode or os.environ.get("COLAB_KIT_COPIES") or ("stream" if cuda else "now")
        if self.mode not in MODES:
            raise ValueError(f"offload's copy mode {self.mode!r} (mode= or COLAB_KIT_COPIES): one of "
                             f"{', '.join(MODES)}")
        if self.mode in ("stream", "inline") and not cuda:
            self.mode = "now"  # no stream to order on a CPU device
        stream = self.mode == "stream"
        self.up = torch.cuda.Stream(self.device) if stream else None  # host -> device
        self.down = torch.cuda.Stream(self.device) if stream else None  # device -> host: the two run at once
        self.pending: list[Copy] = []
        self.counts = {"to_device": 0, "to_host": 0}
        self._queued = False  # inline: copies to the device queued since the host last waited for the device
        self._landed: list[tuple[torch.Tensor, torch.Tensor]] = []  # lazy: (source, what it landed as)

    def to_device(self, src: torch.Tensor) -> Copy:
        """``src`` (pinned, on the host) copied to the device."""
        self.counts["to_device"] += 1
        if self.mode == "now":
            return Copy(src.to(self.device))
        if self.mode == "inline":
            self._queued = True
            return Copy(src.to(self.device, non_blocking=True))
        if self.mode == "lazy":
            out, then = torch.full(src.shape, float("nan"), dtype=src.dtype, device=self.device), src.clone()
            return self._keep(Copy(out, on_wait=lambda: self._land(src, then, out)))
        assert self.up is not None
        with torch.cuda.stream(self.up):  # made here, so the copy waits for nothing the compute stream queued
            out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            out.copy_(src, non_blocking=True)
            event = self.up.record_event()
        return self._keep(Copy(out, hold=(src,), event=event, where="device"))

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, add: bool = False) -> Copy:
        """``src`` (on the device, in ``dst``'s dtype) copied into the host tensor ``dst``, or added to it
        (``add``); ``dst`` is read only after ``wait()`` (or ``drain()``)."""
        self.counts["to_host"] += 1
        land = dst.add_ if add else dst.copy_
        if self.mode == "now" or self.mode == "inline":
            land(src.to(dst.device))  # the host waits for the device here: in inline mode for all it was given,
            self._queued = False      # the shard copies queued before included (the optimizer may change them)
            return Copy(dst)
        if self.mode == "lazy":
            if not add:
                dst.fill_(float("nan"))
            return self._keep(Copy(dst, on_wait=lambda: land(src.to(dst.device))))
        assert self.down is not None
        buffer = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self.down.wait_stream(torch.cuda.current_stream(self.device))  # src is made on the compute stream
        with torch.cuda.stream(self.down):
            buffer.copy_(src, non_blocking=True)
            event = self.down.record_event()
        src.record_stream(self.down)  # its memory (a reduce-scatter's whole buffer) goes back once the copy ran
        return self._keep(Copy(dst, event=event, on_wait=lambda: land(buffer), where="host"))  # holds the buffer

    def _land(self, src: torch.Tensor, then: torch.Tensor, out: torch.Tensor) -> None:
        """Lazy: the copy lands at its wait; ``then`` is the source as it was when the copy was made."""
        if not _same(src, then):
            raise RuntimeError("a shard changed between its copy to the device and the copy's wait: on a GPU the "
                               "copy could have read either value")
        self._landed.append((src, out.copy_(src)))

    def _keep(self, copy: Copy) -> Copy:
        self.pending = [c for c in self.pending if not c.done] + [copy]
        return copy

    def drain(self) -> None:
        """Wait for every copy in flight, in the order they were made (the host waits): before the optimizer
        changes the pinned shards a copy may still read, and before the host gradients are read."""
        if self.up is not None and self.down is not None:
            self.up.synchronize()  # first: set_sync_debug_mode sees a stream's sync, not an event's
            self.down.synchronize()
        elif self._queued:  # inline, after a forward without backward (eval): no blocking copy back since
            torch.cuda.current_stream(self.device).synchronize()
            self._queued = False
        pending, self.pending = self.pending, []
        for c in pending:
            c.wait()
        landed, self._landed = self._landed, []
        for src, out in landed:  # lazy: a shard changed while a GPU's copy could still have been reading it
            if not _same(src, out):
                raise RuntimeError("a shard copied to the device changed before the copies were drained: on a GPU "
                                   "the copy could have read the new values")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bytes (NaN included)."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
