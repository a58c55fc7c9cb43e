"""Waiting for collectives and messages without hanging: ``finish`` (looks at the job's hang flag
every ``ABORT_POLL`` seconds), its waiter threads, and ``Pending`` (an async collective in flight,
recorded when it completes). Part of ``colab_kit.comm``; see its docstring."""
from __future__ import annotations

import threading
import time

from .records import CommLog, CommRecord
from .spin import spin

__all__ = ["ABORT_POLL", "QUEUED_COMPLETES", "Aborted", "WaitTimeout", "finish", "Pending"]


ABORT_POLL = 0.25
"""Seconds between looks at ``mesh.abort_flag`` while a wait is blocked (see ``finish``)."""

QUEUED_COMPLETES = [False]
"""Whether this process's backend completes a Work's future, and returns from its ``wait()``, once the call is
queued on the GPU's stream (NCCL), not when its data has arrived. ``ProcessMesh`` sets it for NCCL; ``finish``
then reads completion from ``work.is_completed()`` (NCCL's CUDA events) while it looks at the hang flag and the
clock: a peer that never joins is found, where the future had said "done" at once and the rank would have hung
at its next host sync until NCCL's watchdog killed the process."""


class Aborted(RuntimeError):
    """A wait given up because another rank raised the job's hang flag (``mesh.abort_flag``)."""


class WaitTimeout(RuntimeError):
    """A point-to-point wait that ran past its timeout (the connection stays open)."""


def finish(work, flag: threading.Event | None = None, what: str = "a collective", timeout: float | None = None,
           armed: tuple | None = None):
    """Wait for a backend ``Work``; while ``flag`` (an Event) is given, look at it every ``ABORT_POLL`` s.

    Without a flag or timeout this is ``work.wait()``. With one, the main thread sleeps on an
    Event that the work's completion sets, waking every ``ABORT_POLL`` s to look at the flag
    and the clock: a collective sets it from its future; work without a future (gloo's sends
    and receives, whose ``is_completed()`` stays False until someone waits) is waited on by a
    ``_Waiter`` thread. ``armed`` is what ``_Waiter.watch(work)`` returned when the work was
    posted (``isend(..., arm=True)``): that thread has been waiting since, so a message that
    arrived meanwhile costs no hand-off here. A set flag raises ``Aborted``, a timeout
    ``WaitTimeout``; neither touches the work, so gloo keeps its connections (a timed
    ``Work.wait`` would close them).
    """
    if armed is None and flag is None and timeout is None:
        work.wait()
        return
    if QUEUED_COMPLETES[0]:
        _until_completed(work, flag, what, timeout)
        return
    if armed is None and getattr(work, "polls", False) and spin(work.is_completed):
        work.wait()  # a rules collective polled a moment first (``comm.spin``): complete, its checks run here
        return
    t0 = time.monotonic()
    if armed is not None:
        done, errors, waiter = armed
    else:
        try:
            done, errors, waiter = threading.Event(), [], None
            work.get_future().add_done_callback(lambda _: done.set())
        except RuntimeError:  # no future for this kind of work
            done, errors, waiter = _Waiter.watch(work)
    while not done.wait(ABORT_POLL if timeout is None else min(ABORT_POLL, timeout)):
        stop: RuntimeError | None = None
        if flag is not None and flag.is_set():
            stop = Aborted(f"gave up waiting for {what}: another rank raised the hang flag")
        elif timeout is not None and time.monotonic() - t0 > timeout:
            stop = WaitTimeout(f"{what} did not complete within {timeout:g} s")
        if stop is not None:
            if waiter is not None:
                waiter.abandon()  # its thread stays in that wait and is never reused
            raise stop
    if errors:
        raise errors[0]
    if waiter is None:
        work.wait()  # completed: returns at once, or raises the backend's error


def _until_completed(work, flag, what: str, timeout: float | None) -> None:
    """``finish`` where a Work's future completes when queued (``QUEUED_COMPLETES``): poll ``is_completed()``
    (from 50 us apart up to 1 ms: the host issues the next kernel at most that late), looking at the flag and
    the clock in between, then ``wait()``.

    Worked example, NCCL, rank 1's receive of an activation rank 0 never sends, hang flag set by rank 0 after its
    own error: ``is_completed()`` stays False; at the next look the flag is set: ``Aborted``, at once."""
    t0, delay = time.monotonic(), 5e-5
    while not work.is_completed():
        if flag is not None and flag.is_set():
            raise Aborted(f"gave up waiting for {what}: another rank raised the hang flag")
        if timeout is not None and time.monotonic() - t0 > timeout:
            raise WaitTimeout(f"{what} did not complete within {timeout:g} s")
        time.sleep(delay)
        delay = min(2 * delay, 1e-3)
    work.wait()  # complete: returns at once, or raises the backend's error


class _Waiter:
    """A daemon thread that runs ``work.wait()`` for ``finish`` (see there), one work at a time.

    ``watch(work)`` hands the work to an idle thread of the pool (or a new one) and returns
    ``(done, errors, thread)``: ``done`` is set once the wait returned, ``errors`` holds what it
    raised. Each work has its own thread while it waits, so a receive that completes late never
    holds up one that completed early. A thread goes back to the pool after its wait; one whose
    wait was abandoned on a flag or timeout stays blocked in it and is never reused (after a
    hang the pipeline runs no further steps).
    """

    _idle: list[_Waiter] = []
    _lock = threading.Lock()

    def __init__(self):
        import queue

        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # (work, done event, errors) to wait on
        self.abandoned = False
        threading.Thread(target=self._loop, daemon=True, name="colab_kit comm waiter").start()

    @classmethod
    def watch(cls, work) -> tuple:
        with cls._lock:
            waiter = cls._idle.pop() if cls._idle else cls()
        done = threading.Event()
        errors: list[BaseException] = []
        waiter.queue.put((work, done, errors))
        return done, errors, waiter

    def abandon(self) -> None:
        self.abandoned = True

    def _loop(self) -> None:
        while True:
            work, done, errors = self.queue.get()
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which raises it
                errors.append(exc)
            done.set()
            work = None  # not kept while idle: a send's Work holds its tensor (NCCL's does)
            if self.abandoned:
                return
            with _Waiter._lock:
                _Waiter._idle.append(self)


class Pending:
    """An async collective in flight; ``wait()`` finishes it and records its time (once)."""

    def __init__(self, work, log: CommLog, op: str, axis: str, nbytes: int, tag: str, then=None, n: int = 1,
                 flag: threading.Event | None = None):
        self.work, self.log, self.op, self.axis, self.nbytes, self.tag = work, log, op, axis, nbytes, tag
        self.flag = flag
        self.n = n
        self.then = then
        self.t0 = time.perf_counter()
        self.done = False
        self.record: CommRecord | None = None

    def wait(self) -> CommRecord | None:
        if self.done:
            return self.record
        if self.work is not None:  # None: a no-op on a size-1 axis, nothing ran, nothing recorded
            called = time.perf_counter()
            finish(self.work, self.flag, f"{self.op} over {self.axis}")
            now = time.perf_counter()
            self.record = record = self.log.add(self.op, self.axis, self.nbytes, now - self.t0, self.tag, self.n,
                                                end=now)
            record.waited = called
        self.done = True
        if self.then is not None:
            self.then()
        return self.record
