"""``comm.finish`` where the backend's Work completes when queued (NCCL: its future is done and ``wait()`` returns
once the call is on the GPU's stream): completion is read from ``is_completed()`` (NCCL's CUDA events), so the
hang flag and a receive's timeout still fire. Played with a Work that behaves as NCCL's does for a collective
whose peer never comes."""
from __future__ import annotations

import threading

import pytest
import torch

from colab_kit.comm import waiting


class QueuedWork:
    """NCCL's Work for a collective a peer never joins: future done and wait() returning at once, never complete
    on the device; ``done_after`` looks at ``is_completed()`` it becomes complete (the peer came after all)."""

    def __init__(self, done_after: int | None = None):
        self.looks, self.done_after, self.waited = 0, done_after, False
        self.future = torch.futures.Future()
        self.future.set_result(None)

    def get_future(self):
        return self.future

    def wait(self, timeout=None):
        self.waited = True
        return True

    def is_completed(self):
        self.looks += 1
        return self.done_after is not None and self.looks > self.done_after


@pytest.fixture
def nccl():
    waiting.QUEUED_COMPLETES[0] = True  # what ProcessMesh sets on NCCL
    yield
    waiting.QUEUED_COMPLETES[0] = False


def test_the_hang_flag_stops_a_wait_the_future_called_done(nccl):
    flag = threading.Event()
    flag.set()
    with pytest.raises(waiting.Aborted, match="another rank raised the hang flag"):
        waiting.finish(QueuedWork(), flag, "a receive of 1F0")


def test_a_receive_times_out_on_the_device_s_completion(nccl):
    with pytest.raises(waiting.WaitTimeout, match="did not complete within 0.05 s"):
        waiting.finish(QueuedWork(), threading.Event(), "a receive of 1F0", timeout=0.05)


def test_a_late_peer_completes_the_wait(nccl):
    work = QueuedWork(done_after=5)
    waiting.finish(work, threading.Event(), "an all-reduce", timeout=30)
    assert work.looks == 6 and work.waited


def test_without_it_the_same_wait_returns_as_if_done():
    """What the wait did before (and does on backends whose future is real completion, gloo, the rules): the
    future says done, so the hang flag is never looked at."""
    flag = threading.Event()
    flag.set()
    waiting.finish(QueuedWork(), flag, "a receive of 1F0", timeout=0.05)  # returns: the hang goes unseen
