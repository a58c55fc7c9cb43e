"""The Works a rules group hands back, and the watchdog that wakes the ones whose collective differs.

``Checked``: gloo's work for collective ``seq``, compared with the other ranks' fingerprints on the board when
waited; a wait whose collective every rank has started, the same one, waits on gloo's own work (no thread
hand-off), any other sleeps on an event that completion or the watchdog sets. ``FutureWork``: a Work done
with its future, whose ``wait()`` raises the future's error (the messages' works). The watchdog (one thread per
process) looks at every group's collectives running past ``STALL`` seconds (``RulesGroup.stalled``).
"""
from __future__ import annotations

import queue
import threading
import time
import weakref

import torch
import torch._C._distributed_c10d as c10d

from ..spin import spin
from .pairs import RuleBroken

__all__ = ["LIVE", "STALL", "Checked", "FutureWork", "start_watchdog", "wait_loop", "report", "last_of"]

LIVE: weakref.WeakSet = weakref.WeakSet()
"""Every rules group of this process (``pending()`` reads their queues, the watchdog their collectives)."""

STALL = 0.5
"""Seconds a collective may run before the watchdog compares it with the other ranks' (see ``board``)."""

_WATCHDOG: list[threading.Thread] = []


def start_watchdog() -> None:
    """One thread per process that looks at every rules group's running collectives (``RulesGroup.stalled``)."""
    if _WATCHDOG:
        return
    with _WATCH_LOCK:
        if not _WATCHDOG:
            t = threading.Thread(target=_watch, daemon=True, name="colab_kit nccl-rules watchdog")
            _WATCHDOG.append(t)
            t.start()


_WATCH_LOCK = threading.Lock()


def _watch() -> None:
    while True:
        time.sleep(STALL / 2)
        now = time.monotonic()
        for g in list(LIVE):
            try:
                g.stalled(now)
            except Exception:  # noqa: BLE001 - a group shut down meanwhile: nothing left to watch there
                pass


def wait_loop(q: queue.SimpleQueue) -> None:
    while True:
        item = q.get()
        if item is None:
            return
        work, callback = item
        report(work.wait, callback)


def report(wait, callback) -> None:
    """``callback(None)`` once ``wait()`` returns, ``callback(error)`` if it raises (the caller's wait raises it)."""
    try:
        wait()
    except BaseException as exc:  # noqa: BLE001 - handed to the caller's wait
        callback(exc)
        return
    callback(None)


class FutureWork(c10d.Work):
    """A Work that is done when its future is, and raises the future's error in ``wait()`` (torch's
    ``_create_work_from_future`` returns a Work whose wait swallows the error).

    ``tensor``: a message's tensor, which the Work keeps for as long as it lives, as NCCL's Work does
    (``outputs_``, and the allocator-safety stash): a sent activation stays alive until its sender drops
    the Work, even after the message completed. A program that keeps every Work to the end of a step
    keeps every tensor it sent, on a GPU as here."""

    def __init__(self, future: torch.futures.Future, tensor: torch.Tensor | None = None):
        super().__init__()
        self.future, self.tensor = future, tensor

    def wait(self, timeout=None) -> bool:
        self.future.wait()  # no polling first (``comm.spin``): a channel's thread completes it, and needs the GIL
        return True

    def is_completed(self) -> bool:
        return self.future.done()

    def get_future(self):
        return self.future


class Checked(c10d.Work):
    """gloo's work for collective ``seq``, compared with the other ranks' on the board when waited."""

    polls = True
    """Its wait polls ``is_completed()`` for a moment first (``comm.spin``): gloo's own threads complete it, with
    no Python on their way, so a polling rank takes nothing from them (``comm.waiting.finish`` reads this)."""

    def __init__(self, group, seq: int, mine: list[int], inner, result):
        super().__init__()
        self.group, self.seq, self.mine, self.inner, self._result = group, seq, mine, inner, result
        self.broken: RuleBroken | None = None  # set by the watchdog
        self.woken: threading.Event | None = None  # what a wait sleeps on, set by completion or the watchdog
        self._verdict: list = []

    def everyone_called_it(self) -> bool:
        """Whether every rank has started this collective, and the same one: then gloo's own wait (no thread
        hand-off) cannot hang on a difference. A difference raises here."""
        board = self.group._board
        rows = board.read(self.seq) if board is not None else [None]
        if any(row is None for row in rows):
            return False
        bad = self.verdict()
        if bad is not None:
            raise bad
        return True

    def verdict(self) -> RuleBroken | None:
        if not self._verdict:
            self._verdict.append(self.group.compare(self.seq, self.mine))
        return self._verdict[0]

    def wait(self, timeout=None) -> bool:
        # a moment's polling first (``comm.spin``); then, unless every rank has started this collective, the same
        # one, a sleep on an Event that completion or the watchdog sets
        if not spin(self.inner.is_completed) and not self.everyone_called_it():
            try:
                fut = self.inner.get_future()
            except RuntimeError:  # gloo's reduce-scatter has no future: its own (uninterruptible) wait
                fut = None
            if fut is not None:
                self.woken = woken = threading.Event()
                fut.add_done_callback(lambda _: woken.set())
                woken.wait()
                if self.broken is not None:
                    raise self.broken
        self._settled(self.inner.wait)
        return True

    def _settled(self, wait) -> None:
        """``wait()`` for gloo's part, then the verdict: a difference on the board wins over gloo's own error."""
        try:
            wait()
        except BaseException as exc:
            bad = self.broken or self.verdict()
            if bad is not None:
                raise bad from exc
            raise
        self.group._inflight.pop(self.seq, None)
        bad = self.broken or self.verdict()
        if bad is not None:
            raise bad

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def result(self):
        return self._result

    def get_future(self):
        def check(fut):  # on gloo's thread, as the work completes (its wait() would block here)
            self._settled(fut.wait)
            return self._result
        return self.inner.get_future().then(check)


def last_of(works):
    for w in works[:-1]:
        w.wait()
    return works[-1]
