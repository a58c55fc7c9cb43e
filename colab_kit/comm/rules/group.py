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

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as c10d

from .pairs import Batch, Channel, Op, RuleBroken, describe_tensor

__all__ = ["RulesGroup", "LIVE"]

LIVE: weakref.WeakSet = weakref.WeakSet()
"""Every rules group of this process (``pending()`` reads their queues)."""

_OPS = ["all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_coalesced",
        "all_gather_single", "reduce_scatter", "reduce_scatter_single", "all_to_all_single", "all_to_all",
        "gather", "scatter", "barrier"]
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool, torch.int16, torch.complex64, torch.complex128]
_REDUCE = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"]
_WIDTH = 12  # fingerprint: op, dtype, extra, ndim, 8 dims


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
        super().__init__(rank, size)
        self._inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._ranks = list(ranks) if ranks else list(range(size))
        self.device_type, self.label = device_type, name
        self._seq = 0
        self._channels: dict[int, Channel] = {}
        self._inflight: dict[int, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._waiter: queue.SimpleQueue | None = None
        LIVE.add(self)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "nccl_rules"

    def size(self) -> int:
        return len(self._ranks)

    @property
    def group_name(self) -> str:  # what torch registered the group under (functional collectives look it up)
        return self.label

    def shutdown(self) -> None:
        for ch in self._channels.values():
            ch.close()
        if self._waiter is not None:
            self._waiter.put(None)
        self._inner.shutdown()

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
    def _fingerprint(self, op: str, t: torch.Tensor | None, extra: int = 0, shape=None) -> torch.Tensor:
        dims = list(shape if shape is not None else (t.shape if t is not None else ()))
        dtype = _DTYPES.index(t.dtype) if t is not None and t.dtype in _DTYPES else -1
        row = [_OPS.index(op), dtype, extra, len(dims)] + (dims + [0] * 8)[:8]
        return torch.tensor(row, dtype=torch.int64)

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

    def _collective(self, op: str, tensors, fingerprint: torch.Tensor, launch, result):
        """Check the device, all-gather the fingerprint, run ``launch()`` on gloo; one Work for both."""
        self._on_device(op, tensors)
        with self._lock:
            seq = self._seq
            self._seq += 1
        gathered = torch.empty(self.size() * _WIDTH, dtype=torch.int64)
        fp_work = self._inner._allgather_base(gathered, fingerprint, c10d.AllgatherOptions())
        self._inflight[seq] = (self._describe(fingerprint.tolist()), time.monotonic())
        out: torch.futures.Future = torch.futures.Future()
        state = {"fp": None, "real": None}
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
                verdict = True if not bad else RuleBroken(
                    f"nccl-rules: collective {seq} of the group of ranks {self._ranks} differs between ranks: "
                    + "; ".join(f"rank {self._ranks[r]} called {self._describe(rows[r])}" for r in range(len(rows)))
                    + ". Every rank of a group must call the same collectives in the same order with the same "
                    "shapes and dtypes; NCCL would hang or mix up the data")
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
        return c10d._create_work_from_future(out)

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
    def allreduce(self, tensors, opts=None):
        opts = opts or c10d.AllreduceOptions()
        fp = self._fingerprint("all_reduce", tensors[0], _reduce_code(opts.reduceOp))
        return self._collective("all_reduce", tensors, fp, lambda: self._inner.allreduce(tensors, opts), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or c10d.AllreduceCoalescedOptions()
        fp = self._fingerprint("all_reduce_coalesced", tensors[0], _reduce_code(opts.reduceOp),
                               shape=[len(tensors), sum(t.numel() for t in tensors)])
        return self._collective("all_reduce_coalesced", tensors, fp,
                                lambda: self._inner.allreduce_coalesced(tensors, opts), tensors)

    def broadcast(self, tensors, opts=None):
        opts = opts or c10d.BroadcastOptions()
        fp = self._fingerprint("broadcast", tensors[0], opts.rootRank)
        return self._collective("broadcast", tensors, fp, lambda: self._inner.broadcast(tensors, opts), tensors)

    def reduce(self, tensors, opts=None):
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

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's names
        opts = opts or c10d.AllgatherOptions()
        fp = self._fingerprint("all_gather_single", input)
        return self._collective("all_gather_single", [output, input], fp,
                                lambda: self._inner._allgather_base(output, input, opts), [output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _last_of(works)

    def reduce_scatter(self, outputs, inputs, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        fp = self._fingerprint("reduce_scatter", outputs[0], _reduce_code(opts.reduceOp))
        return self._collective("reduce_scatter", [outputs, inputs], fp,
                                lambda: self._inner.reduce_scatter(outputs, inputs, opts), outputs)

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002 - torch's names
        opts = opts or c10d.ReduceScatterOptions()
        fp = self._fingerprint("reduce_scatter_single", input, _reduce_code(opts.reduceOp))
        return self._collective("reduce_scatter_single", [output, input], fp,
                                lambda: self._inner._reduce_scatter_base(output, input, opts), [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _last_of(works)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):  # noqa: A002
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

    def gather(self, outputs, inputs, opts=None):
        opts = opts or c10d.GatherOptions()
        fp = self._fingerprint("gather", inputs[0], opts.rootRank)
        return self._collective("gather", [outputs, inputs], fp,
                                lambda: self._inner.gather(outputs, inputs, opts), outputs)

    def scatter(self, outputs, inputs, opts=None):
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
        return c10d._create_work_from_future(op.future)

    def recv(self, tensors, src: int, tag: int = 0):
        op = self._op("recv", tensors, src)
        self._channel(src).submit(op)
        return c10d._create_work_from_future(op.future)

    def recv_anysource(self, tensors, tag: int = 0):
        raise RuleBroken("nccl-rules: NCCL has no receive from any source: name the rank the message comes from")

    def batch(self, ops: list[tuple[str, torch.Tensor, int]]) -> list:
        """``(kind, tensor, group peer)`` ops run as one NCCL group (``batch_isend_irecv``); their Works."""
        made = [self._op(kind, [t], peer) for kind, t, peer in ops]
        channels = [self._channel(p) for p in sorted({op.group_peer for op in made})]
        batch = Batch(made, channels)
        for ch in channels:
            ch.submit(batch)
        return [c10d._create_work_from_future(op.future) for op in made]

    def pending(self) -> list[str]:
        """What this rank issued on this group and is not complete: collectives, then each pair's queue."""
        now = time.monotonic()
        out = [f"collective {seq} {what} ({now - t:.1f} s)" for seq, (what, t) in sorted(self._inflight.items())]
        for ch in self._channels.values():
            out += ch.describe()
        return out


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


def _last_of(works):
    for w in works[:-1]:
        w.wait()
    return works[-1]
