"""Point-to-point messages where the backend's Work completes when queued (NCCL: ``comm.QUEUED_COMPLETES``), read
without a GPU: what ``comm.p2p`` does is checked against a stand-in Work, not NCCL itself (the GPU check runs that).

- No waiter thread is armed: NCCL's ``Work.wait()`` makes the calling thread's current stream, the device's default
  stream that every thread shares, wait for the message, so a thread waiting from the moment a receive is posted
  ahead would hold all later compute behind it. ``ready()`` reads the Work's CUDA event (``is_completed()``).
- Elsewhere (gloo, the rules) a posted message is armed and ``ready()`` is the waiter's event.
- ``sendrecv``: NCCL returns one Work for a batch; both the send and the receive are recorded (ring attention's
  receives went unrecorded on NCCL before).
"""
from __future__ import annotations

import threading

import pytest
import torch

from colab_kit.comm import CommLog, p2p
from colab_kit.comm.waiting import QUEUED_COMPLETES


class Work:
    def __init__(self):
        self.completed, self.waits = False, 0

    def is_completed(self):
        return self.completed

    def wait(self, timeout=None):
        self.waits += 1
        return True


class Mesh:
    def __init__(self):
        self.log, self.abort_flag = CommLog(), None

    def size(self, axis):
        return 2

    def rank(self, axis):
        return 0

    def ranks(self, axis):
        return [0, 1]

    def group(self, axis):
        return None


@pytest.fixture
def queued():
    """``QUEUED_COMPLETES`` (a one-item list the mesh sets), put back afterwards."""
    saved = QUEUED_COMPLETES[0]
    yield QUEUED_COMPLETES
    QUEUED_COMPLETES[0] = saved


@pytest.fixture
def nccl(monkeypatch, queued):
    queued[0] = True
    monkeypatch.setattr(p2p.dist, "irecv", lambda *a, **k: Work())
    monkeypatch.setattr(p2p.dist, "isend", lambda *a, **k: Work())


def test_on_nccl_a_posted_receive_is_not_armed_and_reads_its_event(nccl):
    before = threading.active_count()
    pending = p2p.irecv(torch.zeros(4), Mesh(), "pp", 1, tag="0RB0", arm=True)
    assert pending.armed is None and threading.active_count() == before and pending.work.waits == 0
    assert not pending.ready()
    pending.work.completed = True
    assert pending.ready()
    rec = pending.wait(timeout=5.0)
    assert rec.op == "recv" and pending.work.waits == 1


def test_elsewhere_a_posted_message_is_armed(monkeypatch, queued):
    queued[0] = False
    monkeypatch.setattr(p2p.dist, "isend", lambda *a, **k: Work())
    pending = p2p.isend(torch.zeros(4), Mesh(), "pp", 1, tag="0SF0", arm=True)
    assert pending.armed is not None
    assert pending.armed[0].wait(5.0) and pending.ready() and pending.work.waits == 1


def test_sendrecv_records_both_ends_of_one_nccl_group(monkeypatch):
    work = Work()
    monkeypatch.setattr(p2p.rules, "batch_isend_irecv", lambda ops: [work])
    monkeypatch.setattr(p2p.dist, "P2POp", lambda *args: args)  # no process group here
    mesh = Mesh()
    pendings = p2p.sendrecv(torch.zeros(4), torch.zeros(4), mesh, "sp", to=1, source=1, tag="ring kv")
    assert [p.op for p in pendings] == ["send", "recv"] and all(p.work is work for p in pendings)
    for p in pendings:
        p.wait()
    assert [r.op for r in mesh.log.records] == ["send", "recv"]
