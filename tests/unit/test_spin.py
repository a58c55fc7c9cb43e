"""``comm.spin``: a wait polls its work for a moment (yielding the core) before it sleeps on it; only a rank's main
thread polls, and a budget of 0 never does (``COLAB_KIT_SPIN_US=0``)."""
from __future__ import annotations

import threading

from colab_kit.comm import spin as spin_mod
from colab_kit.comm.spin import spin


class Flips:
    """A ``done()`` that turns True at its ``at``-th look (never, with ``at=None``); counts the looks."""

    def __init__(self, at):
        self.at, self.looks = at, 0

    def __call__(self) -> bool:
        self.looks += 1
        return self.at is not None and self.looks >= self.at


def test_a_done_work_costs_one_look():
    done = Flips(1)
    assert spin(done) and done.looks == 1


def test_it_polls_until_the_work_completes():
    done = Flips(5)
    assert spin(done, budget=60.0)  # returns at the 5th look, long before the budget
    assert done.looks == 5


def test_past_the_budget_it_gives_up_having_polled():
    done = Flips(None)
    assert not spin(done, budget=0.005)
    assert done.looks > 1  # it looked again at least once before the budget ran out


def test_a_budget_of_zero_never_polls(monkeypatch):
    done = Flips(2)
    assert not spin(done, budget=0.0) and done.looks == 1
    monkeypatch.setattr(spin_mod, "SPIN_SECONDS", 0.0)  # what COLAB_KIT_SPIN_US=0 sets
    done = Flips(2)
    assert not spin(done) and done.looks == 1


def test_a_helper_thread_never_polls():
    done, out = Flips(2), []
    t = threading.Thread(target=lambda: out.append(spin(done, budget=60.0)))
    t.start()
    t.join()
    assert out == [False] and done.looks == 1  # it looked once and went to sleep on the work instead
