"""Where the ranks of one host compare their collectives: a shared-memory board per group.

Rule 3 (the k-th collective of a group is the same call on every rank) needs every rank to see
the others' k-th call. An all-gather of a fingerprint beside every collective does that anywhere,
but doubles the collectives (the parity matrix ran 26 s on gloo, 37 s so). When every rank of a
group is on one host, each rank instead writes its k-th fingerprint into slot ``k % SLOTS`` of its
row on a shared board (``/dev/shm``) before it starts collective k, and reads the other rows:

* when collective k completes, every rank has started it, so every row holds its k-th call:
  a difference fails the call on every rank (each compares the same rows);
* a collective still running after ``STALL`` seconds is compared by the watchdog (``rules.watch``),
  so calls that differ and hang on gloo (an all-reduce against an all-gather) fail too, naming
  what each rank called, instead of waiting out the group's timeout.

A slot is written seq-last and read seq-first-and-last, so a half-written slot is never compared;
a slot already overwritten (a rank ``SLOTS`` collectives ahead) is skipped. Worked example, a
group of 2 ranks at collective 7 (slot 7), fingerprints as ``group._fingerprint`` makes them::

    row 0, slot 7: [7 | all_reduce sum float32 [4]]
    row 1, slot 7: [7 | all_reduce sum float32 [2, 2]]     -> RuleBroken on both ranks
"""
from __future__ import annotations

import mmap
import os
import socket
import tempfile
import uuid

import numpy as np

__all__ = ["Board", "SLOTS", "same_host"]

SLOTS = 1024
"""Collectives a rank may run ahead of another before its fingerprints are overwritten unchecked."""


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}/{os.getuid() if hasattr(os, 'getuid') else ''}"


def same_host(store, rank: int, size: int) -> bool:
    """Whether every rank of the group runs on this host (every rank asks the group's store alike)."""
    store.set(f"ck_rules_host/{rank}", _host_id())
    return all(store.get(f"ck_rules_host/{r}").decode() == _host_id() for r in range(size))


class Board:
    """This group's shared fingerprints: ``[size, SLOTS, 1 + width]`` int64 (seq, then the fingerprint)."""

    def __init__(self, store, rank: int, size: int, width: int):
        self.rank, self.size, self.width = rank, size, width
        nbytes = size * SLOTS * (1 + width) * 8
        if rank == 0:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            path = os.path.join(folder, f"colab_kit-rules-{uuid.uuid4().hex}")
            with open(path, "wb") as f:
                f.truncate(nbytes)
        else:
            path = store.get("ck_rules_board").decode()
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), nbytes)
        # numpy, not torch: a slot's read and write cost about a microsecond each (torch's views: ten times that)
        self.slots = np.frombuffer(self._map, dtype=np.int64).reshape(size, SLOTS, 1 + width)
        if rank == 0:
            # every row "not written" before any rank can see the board: a new file is zeros, and a zero row reads
            # as collective 0 with an all-zero fingerprint, so a rank that read a peer's row before that peer had
            # opened the board would compare its first collective against it ("float32[]") and fail
            self.slots[:, :, 0] = -1
            store.set("ck_rules_board", path)
        if store.add("ck_rules_board_opened", 1) == size:  # the last to open removes the name
            os.unlink(path)

    def write(self, seq: int, fingerprint: list[int]) -> None:
        slot = self.slots[self.rank, seq % SLOTS]
        slot[0] = -1
        slot[1:] = fingerprint
        slot[0] = seq

    def read(self, seq: int) -> list[list[int] | None]:
        """Every rank's fingerprint of collective ``seq``: None where not written yet or overwritten."""
        column = self.slots[:, seq % SLOTS]
        first = column[:, 0].tolist()
        rows = column[:, 1:].tolist()
        last = column[:, 0].tolist()
        return [row if a == seq and b == seq else None for row, a, b in zip(rows, first, last)]

    def close(self) -> None:
        del self.slots
        try:
            self._map.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with the process
            pass
