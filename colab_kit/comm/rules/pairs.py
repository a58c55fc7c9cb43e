"""Point-to-point messages as NCCL runs them: one ordered channel per (group, pair of ranks).

NCCL ignores message tags and runs a pair's unbatched sends and receives on one stream, in the
order the rank issued them: op k starts only when op k-1 has completed, and a send completes
only when its receive runs. A ``Channel`` plays that on gloo: a thread per peer takes the ops in
issue order, one at a time, each on gloo with tag 0 (so the n-th receive gets the n-th send, as
on NCCL), waiting for each before the next. gloo itself holds a send back until the peer posts the
matching receive, so a receive issued before a send on one pair holds that send back, as NCCL does.

A batch (``batch_isend_irecv``) is one NCCL group: its ops start together once every channel it
touches has finished what was issued before it, and later ops on those channels wait for all of
it. Worked example, pp=2, rank 0 issues ``irecv(B0 from 1)`` and then ``isend(F1 to 1)``; rank 1
issues ``isend(B0)`` only after its ``irecv(F1)`` returned::

    rank 0 channel to 1:  [recv B0] [send F1]      send F1 waits for recv B0
    rank 1 channel to 0:  [recv F1] ...            recv F1 waits for send F1: a hang, reported with
                                                   both queues (``Channel.describe``)
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque

import torch

__all__ = ["Channel", "Op", "Batch", "RuleBroken"]


class RuleBroken(RuntimeError):
    """A program that NCCL would hang on, corrupt data with, or refuse: the message names the rule."""


def describe_tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool, torch.int16, torch.complex64, torch.complex128]
_ENVELOPE = 9  # nbytes, dtype, ndim, 6 dims


def envelope(t: torch.Tensor) -> torch.Tensor:
    """What a message says about itself before its payload: bytes, dtype and shape, 9 int64s. The receiver
    checks it against its buffer, since gloo aborts the process on a message larger than the buffer."""
    dims = list(t.shape)[:6]
    code = DTYPES.index(t.dtype) if t.dtype in DTYPES else -1
    return torch.tensor([t.numel() * t.element_size(), code, t.dim()] + dims + [0] * (6 - len(dims)),
                        dtype=torch.int64)


def _unenvelope(e: list[int]) -> str:
    kind = str(DTYPES[e[1]]).removeprefix("torch.") if 0 <= e[1] < len(DTYPES) else "?"
    return f"{kind}{e[3:3 + min(e[2], 6)]} ({e[0]} bytes)"


class Op:
    """One send or receive in a channel: its future completes when gloo has moved the data."""

    def __init__(self, kind: str, tensor: torch.Tensor, group_peer: int, peer: int, what: str = ""):
        self.kind, self.tensor, self.group_peer, self.peer, self.what = kind, tensor, group_peer, peer, what
        self.index = -1  # this op's number among the pair's messages in its direction (set when it runs)
        self.future: torch.futures.Future = torch.futures.Future()
        self.issued, self.started = time.monotonic(), None  # type: float, float | None

    def label(self, now: float) -> str:
        to = "to" if self.kind == "send" else "from"
        state = (f"running {now - self.started:.1f} s" if self.started is not None
                 else f"queued {now - self.issued:.1f} s")
        return f"{self.kind} {describe_tensor(self.tensor)} {to} rank {self.peer}{self.what} ({state})"


class Batch:
    """Ops posted together (an NCCL group): they start when every channel they use has reached them."""

    def __init__(self, ops: list[Op], channels: list[Channel]):
        self.ops, self.channels = ops, channels
        self._arrived, self._lock = 0, threading.Lock()
        self.done = threading.Event()
        self.issued, self.started = time.monotonic(), None  # type: float, float | None

    counts: dict = {}  # the group's message counts per (direction, peer), handed in by the group

    def reached(self, inner) -> None:
        """Called by each channel's thread when the batch is at its head; the last to arrive runs it."""
        with self._lock:
            self._arrived += 1
            last = self._arrived == len(self.channels)
        if not last:
            self.done.wait()
            return
        self.started = time.monotonic()
        try:
            for op in self.ops:
                op.started = self.started
            _run_ops(inner, self.ops, self.counts)
        except BaseException as exc:  # noqa: BLE001 - every op of the batch fails with it
            for op in self.ops:
                if not op.future.done():
                    op.future.set_exception(exc)
        finally:
            self.done.set()

    def label(self, now: float) -> str:
        parts = ", ".join(f"{op.kind} {describe_tensor(op.tensor)} {'to' if op.kind == 'send' else 'from'} "
                          f"rank {op.peer}" for op in self.ops)
        state = (f"running {now - self.started:.1f} s" if self.started is not None
                 else f"queued {now - self.issued:.1f} s")
        return f"batch [{parts}] ({state})"


def _send(inner, op: Op) -> list:
    """Post the envelope and the payload of send ``op`` (tag 0: NCCL has no tags, the n-th receive of a pair gets
    the n-th send); their works."""
    return [inner.send([envelope(op.tensor)], op.group_peer, 0), inner.send([op.tensor], op.group_peer, 0)]


def _receive(inner, op: Op):
    """Take receive ``op``'s envelope, check it against the buffer, post the payload's receive; its work. A
    message that does not fit is taken into a scratch buffer (the pair stays in step) and raises ``RuleBroken``."""
    env = torch.empty(_ENVELOPE, dtype=torch.int64)
    inner.recv([env], op.group_peer, 0).wait()
    got, want = env.tolist(), envelope(op.tensor).tolist()
    if got[:2] != want[:2]:
        inner.recv([torch.empty(got[0], dtype=torch.uint8)], op.group_peer, 0).wait()
        raise RuleBroken(
            f"nccl-rules: message {op.index} from rank {op.peer} is {_unenvelope(got)}, but the receive it met is "
            f"{_unenvelope(want)}: NCCL matches a pair's messages by order alone (tags are ignored), so the n-th "
            "receive must take the n-th send, of the same size and dtype")
    return inner.recv([op.tensor], op.group_peer, 0)


def _run_ops(inner, ops: list[Op], counts: dict) -> None:
    """Post ``ops`` together (sends first, then each peer's receives in order) and wait for all of them."""
    works = []
    for op in ops:
        if op.kind == "send":
            op.index = counts.setdefault(("send", op.group_peer), 0)
            counts["send", op.group_peer] += 1
            works += [(op, w) for w in _send(inner, op)]
    for op in ops:
        if op.kind == "recv":
            op.index = counts.setdefault(("recv", op.group_peer), 0)
            counts["recv", op.group_peer] += 1
            works.append((op, _receive(inner, op)))
    for _, w in works:
        w.wait()
    for op in ops:
        op.future.set_result(None)


class Channel:
    """This rank's ops with one peer of one group, run one at a time in issue order (a thread)."""

    def __init__(self, inner, group_peer: int, global_peer: int):
        self.inner, self.group_peer, self.global_peer = inner, group_peer, global_peer
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: deque = deque()  # what is issued and not completed, oldest first (for reports)
        self.broken: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.counts: dict = {}  # messages so far per (direction, peer): names a message in a mismatch

    def submit(self, item) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"colab_kit nccl-rules channel to rank {self.global_peer}")
            self._thread.start()
        self.pending.append(item)
        self._queue.put(item)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)

    def describe(self) -> list[str]:
        now = time.monotonic()
        return [item.label(now) for item in list(self.pending)]

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if self.broken is not None:  # NCCL aborts the communicator: nothing after an error runs
                    raise RuntimeError(f"an earlier operation with rank {self.global_peer} failed: {self.broken}")
                if isinstance(item, Batch):
                    item.reached(self.inner)
                else:
                    item.started = time.monotonic()
                    _run_ops(self.inner, [item], self.counts)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the op
                if not isinstance(exc, RuleBroken):  # a message that did not fit was taken whole: still in step
                    self.broken = self.broken or exc
                ops = item.ops if isinstance(item, Batch) else [item]
                for op in ops:
                    if not op.future.done():
                        op.future.set_exception(exc)
                if isinstance(item, Batch):
                    item.done.set()
            finally:
                if self.pending:
                    self.pending.popleft()
                item = None  # the op's tensor lives as long as its Work, not until the next op arrives
