"""``RulesGroup``: a process group that runs on gloo and refuses what NCCL would not forgive.

Every call is checked against four rules, then handed to a gloo group of the same ranks:

1. **tags are ignored**: a point-to-point message is matched by order alone (``pairs.Channel``);
2. **one pair, one stream**: a pair's unbatched sends and receives run one at a time in issue order,
   a send completing only when its receive runs; ``batch_isend_irecv`` ops run as one group;
3. **one collective sequence**: the k-th collective of a group is the same op, dtype and shape (and
   reduce op, root) on every rank: a fingerprint of each call is all-gathered beside it (as
   ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does) and a mismatch fails the call on every rank, naming
   what each rank called;
4. **tensors on the device**: every tensor handed to a collective or message is on the job's device
   (``COLAB_KIT_RULES_DEVICE``: ``cpu``, or ``cuda`` for several ranks sharing one GPU, whose tensors
   then travel through pinned host buffers).

Worked example, a dp group of ranks [0, 1] where rank 1 reduces a tensor of another shape::

    rank 0: dist.all_reduce(torch.ones(4), group=dp)        both calls fail with RuleBroken:
    rank 1: dist.all_reduce(torch.ones(2, 2), group=dp)     "collective 7 of group [0, 1]: rank 0
                                                            all_reduce(sum) float32[4], rank 1
                                                            all_reduce(sum) float32[2, 2]"

On plain gloo the same program completes (it sums 4 floats either way), which is the point.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as c10d

from .board import Board, same_host
from .pairs import Batch, Channel, Op, RuleBroken, describe_tensor

__all__ = ["RulesGroup", "LIVE"]

_STUCK: list = []
"""gloo groups whose shutdown did not finish (a collective stuck on a mismatch): kept, never destroyed."""

LIVE: weakref.WeakSet = weakref.WeakSet()
"""Every rules group of this process (``pending()`` reads their queues)."""

_OPS = ["all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_coalesced",
        "all_gather_single", "reduce_scatter", "reduce_scatter_single", "all_to_all_single", "all_to_all",
        "gather", "scatter", "barrier"]
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool, torch.int16, torch.complex64, torch.complex128]
_REDUCE = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"]
_WIDTH = 12  # fingerprint: op, dtype, extra, ndim, 8 dims
_OP_CODE = {op: i for i, op in enumerate(_OPS)}
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
STALL = 0.5
"""Seconds a collective may run before the watchdog compares it with the other ranks' (see ``board``)."""


def _reduce_code(op) -> int:
    for i, name in enumerate(_REDUCE):
        if op == getattr(dist.ReduceOp, name.upper()):
            return i
    return len(_REDUCE)


def _flat(args) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += _flat(a)
    return out


class RulesGroup(dist.ProcessGroup):
    """A group of the ``nccl_rules`` backend (see the module docstring); made by ``torch.distributed``."""

    def __init__(self, store, rank: int, size: int, timeout, ranks: list[int] | None, device_type: str,
                 name: str = ""):
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's stub names only the store overload
        self._inner: Any = dist.ProcessGroupGloo(store, rank, size, timeout)  # None after shutdown()
        self._ranks = list(ranks) if ranks else list(range(size))
        self.device_type, self.label = device_type, name
        self._seq = 0
        self._channels: dict[int, Channel] = {}
        self._counts: dict = {}  # messages so far per (direction, peer): names one in a mismatch
        self._inflight: dict[int, tuple] = {}  # seq -> (what, since, fingerprint, future) of running collectives
        self._settle = threading.Lock()  # one of a call's completion and the watchdog settles its future
        self._lock = threading.Lock()
        self._waiter: queue.SimpleQueue | None = None
        self._stuck = False  # a collective of this group differed and hangs in gloo (see ``stalled``)
        self._board = Board(store, rank, size, _WIDTH) if size > 1 and same_host(store, rank, size) else None
        LIVE.add(self)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return "nccl_rules"

    def size(self) -> int:
        return len(self._ranks)

    @property
    def group_name(self) -> str:  # type: ignore[override]  # what torch registered the group under (functional collectives look it up)
        return self.label

    def _get_sequence_number_for_group(self) -> int:
        """How many collectives this rank has issued on the group (the health check compares the ranks')."""
        return self._seq

    def shutdown(self) -> None:
        """Close gloo's connections and let go of everything that refers back to this group (channels, works in
        flight), so that the group, and gloo's listening socket with it, goes when torch drops it."""
        for ch in self._channels.values():
            ch.close()
        if self._waiter is not None:
            self._waiter.put(None)
        if self._inner is not None:  # gloo's shutdown waits for a collective stuck on another rank's different
            closing = threading.Thread(target=self._inner.shutdown, daemon=True,  # call: never past 2 s here
                                       name="colab_kit nccl-rules shutdown")
            closing.start()
            closing.join(2.0)
            running = [w for _, _, _, w in self._inflight.values() if isinstance(w, Checked)
                       and not w.inner.is_completed()]
            if closing.is_alive() or self._stuck or running:  # its destructor would wait for that collective too
                _STUCK.append(self._inner)
        if self._board is not None:
            self._board.close()
        self._channels, self._inflight, self._board, self._waiter = {}, {}, None, None
        self._inner = None

    def abort(self) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ rule 4: the device
    def _on_device(self, what: str, tensors) -> None:
        for t in _flat(tensors):
            if t.device.type != self.device_type:
                raise RuleBroken(
                    f"nccl-rules: {what} over ranks {self._ranks} was handed a {t.device.type} tensor "
                    f"{describe_tensor(t)}, but this job's collectives run on {self.device_type} (NCCL takes only "
                    f"tensors on the device): move it there first (tensor.to(mesh.device))")

    # ------------------------------------------------------------------ rule 3: one collective sequence
    def _fingerprint(self, op: str, t: torch.Tensor | None, extra: int = 0, shape=None) -> list[int]:
        dims = list(shape if shape is not None else (t.shape if t is not None else ()))
        dtype = _DTYPE_CODE.get(t.dtype, -1) if t is not None else -1
        return [_OP_CODE[op], dtype, extra, len(dims)] + (dims + [0] * 8)[:8]

    def _describe(self, row: list[int]) -> str:
        op, dtype, extra, nd = row[:4]
        name = _OPS[op] if 0 <= op < len(_OPS) else f"op {op}"
        if name in ("all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_single"):
            name += f"({_REDUCE[extra] if extra < len(_REDUCE) else extra})"
        elif name in ("broadcast", "gather", "scatter"):
            name += f"(root {extra})"
        elif name == "reduce":
            name += f"(root {extra >> 4}, {_REDUCE[extra & 15] if (extra & 15) < len(_REDUCE) else extra & 15})"
        if name == "barrier":
            return name
        kind = str(_DTYPES[dtype]).removeprefix("torch.") if 0 <= dtype < len(_DTYPES) else "?"
        dims = ["*" if d < 0 else str(d) for d in row[4:4 + nd]]
        return f"{name} {kind}[{', '.join(dims)}]"

    def _collective(self, op: str, tensors, fingerprint: list[int], launch, result):
        """Check the device, all-gather the fingerprint, run ``launch()`` on gloo; one Work for both."""
        self._on_device(op, tensors)
        with self._lock:
            seq = self._seq
            self._seq += 1
        if self._board is not None:
            return self._on_board(seq, op, fingerprint, launch, result)
        gathered = torch.empty(self.size() * _WIDTH, dtype=torch.int64)
        fp_work = self._inner._allgather_base(gathered, torch.tensor(fingerprint, dtype=torch.int64),
                                              c10d.AllgatherOptions())
        self._inflight[seq] = (op, time.monotonic(), None, None)
        out: torch.futures.Future = torch.futures.Future()
        state: dict[str, Any] = {"fp": None, "real": None}
        lock = threading.Lock()

        def settle():  # under lock: the two parts finish in either order, on gloo's threads
            if out.done() or state["fp"] is None:
                return
            if state["fp"] is not True:
                out.set_exception(state["fp"])
            elif state["real"] is not None:
                self._inflight.pop(seq, None)
                if state["real"] is True:
                    out.set_result(result)
                else:
                    out.set_exception(state["real"])

        def on_fp(fut):
            try:
                fut.wait()
                rows = gathered.view(self.size(), _WIDTH).tolist()
                bad = [r for r in range(len(rows)) if rows[r] != rows[0]]
                verdict: bool | BaseException = True if not bad else self._differs(seq, rows)
            except BaseException as exc:  # noqa: BLE001 - the group is broken: the call fails with it
                verdict = exc
            with lock:
                state["fp"] = verdict
                settle()

        def on_real(error):
            with lock:
                state["real"] = True if error is None else error
                settle()

        real = launch()
        fp_work.get_future().add_done_callback(on_fp)
        self._when_done(real, on_real)
        return FutureWork(out)

    def _differs(self, seq: int, rows: list) -> RuleBroken:
        return RuleBroken(
            f"nccl-rules: collective {seq} of the group of ranks {self._ranks} differs between ranks: "
            + "; ".join(f"rank {self._ranks[r]} " + ("has not called it yet" if row is None else
                                                    f"called {self._describe(row)}") for r, row in enumerate(rows))
            + ". Every rank of a group must call the same collectives in the same order with the same "
            "shapes and dtypes; NCCL would hang or mix up the data")

    def _on_board(self, seq: int, op: str, fingerprint: list[int], launch, result):
        """Rule 3 on one host: the fingerprint on the shared board, compared when the call is waited (and by
        the watchdog while it runs). The caller waits on gloo's own work: no thread hand-off."""
        assert self._board is not None
        self._board.write(seq, fingerprint)
        mine = fingerprint
        work = Checked(self, seq, mine, launch(), result)
        self._inflight[seq] = (op, time.monotonic(), mine, work)
        _start_watchdog()
        return work

    def compare(self, seq: int, mine: list[int]) -> RuleBroken | None:
        """The rule broken if another rank's collective ``seq`` differs from ``mine`` (read twice, so that a
        slot being written is never taken for a difference), else None."""
        assert self._board is not None
        for attempt in range(2):
            rows = self._board.read(seq)
            if all(row is None or row == mine for row in rows):
                return None
            if attempt == 0:
                time.sleep(0.005)
        rows[self.rank()] = mine
        return self._differs(seq, rows)

    def stalled(self, now: float) -> None:
        """The watchdog's look at collectives older than ``STALL`` s: one that differs from another rank's
        is failed (its gloo group aborted, so that a wait blocked in it returns); completed ones are let go."""
        for seq, (_, t0, mine, work) in list(self._inflight.items()):
            if not isinstance(work, Checked) or now - t0 < STALL:
                continue
            done = work.inner.is_completed()
            verdict = work.verdict() if done else self.compare(seq, mine)
            if done:
                self._inflight.pop(seq, None)
            elif verdict is not None:  # wake the wait (gloo's own wait cannot be interrupted: its op stays stuck)
                work.broken = verdict
                self._stuck = True
                self._inflight.pop(seq, None)
                if work.woken is not None:
                    work.woken.set()

    def _when_done(self, work, callback) -> None:
        """``callback(None or the error)`` once gloo's ``work`` completes: from its future, or (gloo's
        reduce-scatter has none) from this group's waiter thread, which waits on such works in issue order."""
        try:
            fut = work.get_future()
        except RuntimeError:
            if self._waiter is None:
                self._waiter = queue.SimpleQueue()
                threading.Thread(target=_wait_loop, args=(self._waiter,), daemon=True,
                                 name="colab_kit nccl-rules waiter").start()
            self._waiter.put((work, callback))
            return

        def done(f):
            try:
                f.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's wait
                callback(exc)
                return
            callback(None)
        fut.add_done_callback(done)

    # ------------------------------------------------------------------ collectives (torch's signatures)
    def allreduce(self, tensors, opts=None):  # type: ignore[override]
        opts = opts or c10d.AllreduceOptions()
        fp = self._fingerprint("all_reduce", tensors[0], _reduce_code(opts.reduceOp))
        return self._collective("all_reduce", tensors, fp, lambda: self._inner.allreduce(tensors, opts), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or c10d.AllreduceCoalescedOptions()
        fp = self._fingerprint("all_reduce_coalesced", tensors[0], _reduce_code(opts.reduceOp),
                               shape=[len(tensors), sum(t.numel() for t in tensors)])
        return self._collective("all_reduce_coalesced", tensors, fp,
                                lambda: self._inner.allreduce_coalesced(tensors, opts), tensors)

    def broadcast(self, tensors, opts=None):  # type: ignore[override]
        opts = opts or c10d.BroadcastOptions()
        fp = self._fingerprint("broadcast", tensors[0], opts.rootRank)
        return self._collective("broadcast", tensors, fp, lambda: self._inner.broadcast(tensors, opts), tensors)

    def reduce(self, tensors, opts=None):  # type: ignore[override]
        opts = opts or c10d.ReduceOptions()
        fp = self._fingerprint("reduce", tensors[0], (opts.rootRank << 4) | _reduce_code(opts.reduceOp))
        return self._collective("reduce", tensors, fp, lambda: self._inner.reduce(tensors, opts), tensors)

    def allgather(self, outputs, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        fp = self._fingerprint("all_gather", inputs[0])
        return self._collective("all_gather", [outputs, inputs], fp,
                                lambda: self._inner.allgather(outputs, inputs, opts), outputs)

    def allgather_coalesced(self, outputs, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        fp = self._fingerprint("all_gather_coalesced", inputs[0],
                               shape=[len(inputs), sum(t.numel() for t in inputs)])
        return self._collective("all_gather_coalesced", [outputs, inputs], fp,
                                lambda: self._inner.allgather_coalesced(outputs, inputs, opts), outputs)

    def all_gather_single(self, output, input, opts=None):
        opts = opts or c10d.AllgatherOptions()
        fp = self._fingerprint("all_gather_single", input)
        return self._collective("all_gather_single", [output, input], fp,
                                lambda: self._inner._allgather_base(output, input, opts), [output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _last_of(works)

    def reduce_scatter(self, outputs, inputs, opts=None):  # type: ignore[override]
        opts = opts or c10d.ReduceScatterOptions()
        fp = self._fingerprint("reduce_scatter", outputs[0], _reduce_code(opts.reduceOp))
        return self._collective("reduce_scatter", [outputs, inputs], fp,
                                lambda: self._inner.reduce_scatter(outputs, inputs, opts), outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        fp = self._fingerprint("reduce_scatter_single", input, _reduce_code(opts.reduceOp))
        return self._collective("reduce_scatter_single", [output, input], fp,
                                lambda: self._inner._reduce_scatter_base(output, input, opts), [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _last_of(works)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        opts = opts or c10d.AllToAllOptions()
        even = not output_splits and not input_splits
        fp = self._fingerprint("all_to_all_single", input, shape=None if even else [-1, *input.shape[1:]])
        return self._collective("all_to_all_single", [output, input], fp,
                                lambda: self._inner.alltoall_base(output, input, output_splits, input_splits, opts),
                                [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts or c10d.AllToAllOptions()
        fp = self._fingerprint("all_to_all", inputs[0], shape=[len(inputs)])
        return self._collective("all_to_all", [outputs, inputs], fp,
                                lambda: self._inner.alltoall(outputs, inputs, opts), outputs)

    def gather(self, outputs, inputs, opts=None):  # type: ignore[override]
        opts = opts or c10d.GatherOptions()
        fp = self._fingerprint("gather", inputs[0], opts.rootRank)
        return self._collective("gather", [outputs, inputs], fp,
                                lambda: self._inner.gather(outputs, inputs, opts), outputs)

    def scatter(self, outputs, inputs, opts=None):  # type: ignore[override]
        opts = opts or c10d.ScatterOptions()
        fp = self._fingerprint("scatter", outputs[0], opts.rootRank)
        return self._collective("scatter", [outputs, inputs], fp,
                                lambda: self._inner.scatter(outputs, inputs, opts), outputs)

    def barrier(self, opts=None):
        opts = opts or c10d.BarrierOptions()
        return self._collective("barrier", [], self._fingerprint("barrier", None),
                                lambda: self._inner.barrier(opts), [])

    # ------------------------------------------------------------------ rules 1 and 2: messages
    def _channel(self, peer: int) -> Channel:
        ch = self._channels.get(peer)
        if ch is None:
            ch = self._channels[peer] = Channel(self._inner, peer, self._ranks[peer])
            ch.counts = self._counts
        return ch

    def _op(self, kind: str, tensors, peer: int) -> Op:
        if len(tensors) != 1:
            raise RuleBroken(f"nccl-rules: a {kind} moves one tensor, got {len(tensors)}")
        self._on_device(kind, tensors)
        if not 0 <= peer < self.size() or peer == self.rank():
            raise RuleBroken(f"nccl-rules: a {kind} needs a peer of the group other than this rank "
                             f"({self.rank()} of {self.size()}), got {peer}")
        return Op(kind, tensors[0], peer, self._ranks[peer])

    def send(self, tensors, dst: int, tag: int = 0):
        op = self._op("send", tensors, dst)
        self._channel(dst).submit(op)
        return FutureWork(op.future)

    def recv(self, tensors, src: int, tag: int = 0):
        op = self._op("recv", tensors, src)
        self._channel(src).submit(op)
        return FutureWork(op.future)

    def recv_anysource(self, tensors, tag: int = 0):
        raise RuleBroken("nccl-rules: NCCL has no receive from any source: name the rank the message comes from")

    def batch(self, ops: list[tuple[str, torch.Tensor, int]]) -> list:
        """``(kind, tensor, group peer)`` ops run as one NCCL group (``batch_isend_irecv``); their Works."""
        made = [self._op(kind, [t], peer) for kind, t, peer in ops]
        channels = [self._channel(p) for p in sorted({op.group_peer for op in made})]
        batch = Batch(made, channels)
        batch.counts = self._counts
        for ch in channels:
            ch.submit(batch)
        return [FutureWork(op.future) for op in made]

    def pending(self) -> list[str]:
        """What this rank issued on this group and is not complete: collectives, then each pair's queue."""
        now = time.monotonic()
        out = [f"collective {seq} {what} ({now - t:.1f} s)" for seq, (what, t, _, _) in sorted(self._inflight.items())]
        for ch in self._channels.values():
            out += ch.describe()
        return out


_WATCHDOG: list[threading.Thread] = []


def _start_watchdog() -> None:
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


def _wait_loop(q: queue.SimpleQueue) -> None:
    while True:
        item = q.get()
        if item is None:
            return
        work, callback = item
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's wait
            callback(exc)
            continue
        callback(None)


class FutureWork(c10d.Work):
    """A Work that is done when its future is, and raises the future's error in ``wait()`` (torch's
    ``_create_work_from_future`` returns a Work whose wait swallows the error)."""

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self.future = future

    def wait(self, timeout=None) -> bool:
        self.future.wait()
        return True

    def is_completed(self) -> bool:
        return self.future.done()

    def get_future(self):
        return self.future


class Checked(c10d.Work):
    """gloo's work for collective ``seq``, compared with the other ranks' on the board when waited."""

    def __init__(self, group: RulesGroup, seq: int, mine: list[int], inner, result):
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
        if not self.inner.is_completed() and not self.everyone_called_it():
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
        try:
            self.inner.wait()
        except BaseException as exc:
            bad = self.broken or self.verdict()
            if bad is not None:
                raise bad from exc
            raise
        self.group._inflight.pop(self.seq, None)
        bad = self.broken or self.verdict()
        if bad is not None:
            raise bad
        return True

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def result(self):
        return self._result

    def get_future(self):
        def check(fut):  # on gloo's thread, as the work completes (its wait() would block here)
            try:
                fut.wait()
            except BaseException as exc:
                bad = self.broken or self.verdict()
                if bad is not None:
                    raise bad from exc
                raise
            self.group._inflight.pop(self.seq, None)
            bad = self.broken or self.verdict()
            if bad is not None:
                raise bad
            return self._result
        return self.inner.get_future().then(check)


def _last_of(works):
    for w in works[:-1]:
        w.wait()
    return works[-1]
