"""Waiting for a CPU collective by polling it for a moment before sleeping on it: ``spin``.

A collective between CPU ranks is a relay of small wake-ups: the rank's thread hands the op to gloo's worker,
each hop of the ring wakes the next rank's socket thread and then its worker, and the result finally wakes the
thread that waits. On a machine where the ranks share a few cores (a laptop, Colab, CI: 4 ranks on 2 cores)
each wake-up of a sleeping thread costs tens of microseconds, more when its core has gone idle. A rank that
instead polls ``is_completed()`` for up to ``SPIN_SECONDS``, yielding its core between looks
(``os.sched_yield``, which also releases the GIL), skips its own wake-up and keeps its core awake for the
next hop. Past that it sleeps on the work as before, so a rank that waits long (a pipeline bubble, a rank
that never comes) spends one millisecond polling, given away to any other runnable thread of its core.

Who polls: the wait of a collective on an ``nccl_rules`` group (``rules.works.Checked``, blocking or through
``comm.finish``), which gloo's C++ threads complete without Python. A message's wait does not: a channel's
Python thread completes it (``rules.pairs``), and a poller would hold the GIL that thread needs. Only a rank's
main thread polls (where ``ck.launch``'s ranks and an engine's cells run); a helper thread sleeps at once.

``python bench/spin.py`` measures both ways in one spawn per round, 4 ranks on 2 cores
(``bench/results/spin.json``, and its rows in docs/benchmarks.md): a 1-element and a 4,096-element all-reduce
took 0.52 and 0.40 of the time, and training steps of the test GPT 0.87-0.98, the same losses to the bit.
``COLAB_KIT_SPIN_US`` sets the budget in microseconds (0: never poll, every wait sleeps at once), read when
``colab_kit`` is imported (``ck.launch``'s ranks fork from a server that imported it earlier).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

__all__ = ["SPIN_SECONDS", "spin"]

_yield = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))  # sleep(0) where the OS has no sched_yield

SPIN_SECONDS = float(os.environ.get("COLAB_KIT_SPIN_US", "1000")) * 1e-6
"""How long a wait polls its work before it sleeps on it (``COLAB_KIT_SPIN_US``, microseconds; default 1000)."""


def spin(done: Callable[[], bool], budget: float | None = None) -> bool:
    """Poll ``done()`` for up to ``budget`` seconds (``SPIN_SECONDS``), yielding the core between looks; whether
    it returned True. Worked example, rank 0 of a pair waiting for an all-reduce its peer joins 0.2 ms later::

        work = group.allreduce([t])
        spin(work.is_completed)     # True after ~0.3 ms: no sleep, no wake-up
        work.wait()                 # returns at once
    """
    if done():
        return True
    budget = SPIN_SECONDS if budget is None else budget
    if budget <= 0 or threading.current_thread() is not threading.main_thread():
        return False  # a helper thread (a waiter, a channel) sleeps: its polls would take the GIL from the rank's
    end = time.perf_counter() + budget
    while time.perf_counter() < end:
        _yield()
        if done():
            return True
    return False
