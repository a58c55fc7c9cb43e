"""``RulesGroup``: a process group that runs on gloo and refuses what NCCL would not forgive.

Every call is checked against five rules, then handed to a gloo group of the same ranks:

1. **tags are ignored**: a point-to-point message is matched by order alone (``pairs.Channel``);
2. **one pair, one stream**: a pair's unbatched sends and receives run one at a time in issue order,
   a send completing only when its receive runs; ``batch_isend_irecv`` ops run as one group;
3. **one collective sequence**: the k-th collective of a group is the same op, dtype and shape (and
   reduce op, root) on every rank: a fingerprint of each call is all-gathered beside it (as
   ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does) and a mismatch fails the call on every rank, naming
   what each rank called;
4. **tensors on the device**: every tensor handed to a collective or message is on the job's device
   (``COLAB_KIT_RULES_DEVICE``: ``cpu``, or ``cuda`` for several ranks sharing one GPU, whose tensors
   then travel through pinned host buffers);
5. **contiguous tensors**: every tensor handed to a collective or message is contiguous (in its memory
   format), as ProcessGroupNCCL demands; gloo all-reduces and broadcasts a strided view as it is.

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
from typing import Any

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as c10d

from .board import Board, same_host
from .fingerprint import WIDTH, differs, fingerprint, reduce_code
from .pairs import Batch, Channel, Op, RuleBroken, describe_tensor
from .staging import Staged, as_list, first, nothing, root_only, staged, staging, to_host
from .works import LIVE, STALL, Checked, FutureWork, last_of, report, start_watchdog, wait_loop

__all__ = ["RulesGroup", "LIVE"]

_STUCK: list = []
"""gloo groups whose shutdown did not finish (a collective stuck on a mismatch): kept, never destroyed."""



def _contiguous(t: torch.Tensor) -> bool:
    """Contiguous in some memory format, as ProcessGroupNCCL asks (``suggest_memory_format``: channels-last
    4D and 5D tensors pass too)."""
    if t.is_contiguous():
        return True
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    return fmt is not None and t.is_contiguous(memory_format=fmt)


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
        self.staging = staging(device_type)  # calls run on host copies (several ranks on one GPU: staging.py)
        self._carried = "cpu" if self.staging else device_type  # the device of what reaches gloo
        self._seq = 0
        self._channels: dict[int, Channel] = {}
        self._counts: dict = {}  # messages so far per (direction, peer): names one in a mismatch
        self._inflight: dict[int, tuple] = {}  # seq -> (what, since, fingerprint, future) of running collectives
        self._settle = threading.Lock()  # one of a call's completion and the watchdog settles its future
        self._lock = threading.Lock()
        self._waiter: queue.SimpleQueue | None = None
        self._stuck = False  # a collective of this group differed and hangs in gloo (see ``stalled``)
        self._board = Board(store, rank, size, WIDTH) if size > 1 and same_host(store, rank, size) else None
        LIVE.add(self)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return "nccl_rules"

    @property
    def _device_types(self) -> list:  # torch's object collectives read it
        """The one device this group's tensors live on, as NCCL's group answers ``[cuda]``: torch's object
        collectives (``all_gather_object``, ``broadcast_object_list``: checkpoints, ``engine.fit``) put their
        bytes there. A Python group registers no backend, so torch would read ``[]`` and pick the CPU, which
        the device rule refuses on a job whose ranks share a GPU (``COLAB_KIT_RULES_DEVICE=cuda``)."""
        return [torch.device(self.device_type)]

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

    # ------------------------------------------------------------------ rules 4 and 5: the device, contiguous
    def _on_device(self, what: str, tensors, device: str | None = None) -> None:
        """Rules 4 and 5 on ``tensors`` (nested), against ``device`` (the job's, ``self.device_type``, for what a caller
        hands in; by default what reaches gloo: host copies where the group stages)."""
        device = device or self._carried
        for t in _flat(tensors):
            if t.device.type != device:
                raise RuleBroken(
                    f"nccl-rules: {what} over ranks {self._ranks} was handed a {t.device.type} tensor "
                    f"{describe_tensor(t)}, but this job's collectives run on {self.device_type} (NCCL takes only "
                    f"tensors on the device): move it there first (tensor.to(mesh.device))")
            if not _contiguous(t):  # rule 5
                raise RuleBroken(
                    f"nccl-rules: {what} over ranks {self._ranks} was handed a non-contiguous tensor "
                    f"{describe_tensor(t)} (strides {tuple(t.stride())}); NCCL takes only contiguous tensors "
                    f"(\"Tensors must be contiguous\"), where gloo reduces or broadcasts a strided view as it is: "
                    f"hand it t.contiguous() and copy the result back into t")

    # ------------------------------------------------------------------ rule 3: one collective sequence
    def _collective(self, op: str, tensors, fingerprint: list[int], launch, result):
        """Check the device, all-gather the fingerprint, run ``launch()`` on gloo; one Work for both."""
        self._on_device(op, tensors)
        with self._lock:
            seq = self._seq
            self._seq += 1
        if self._board is not None:
            return self._on_board(seq, op, fingerprint, launch, result)
        gathered = torch.empty(self.size() * WIDTH, dtype=torch.int64)
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
                rows = gathered.view(self.size(), WIDTH).tolist()
                bad = [r for r in range(len(rows)) if rows[r] != rows[0]]
                verdict: bool | BaseException = True if not bad else differs(self._ranks, seq, rows)
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

    def _on_board(self, seq: int, op: str, fingerprint: list[int], launch, result):
        """Rule 3 on one host: the fingerprint on the shared board, compared when the call is waited (and by
        the watchdog while it runs). The caller waits on gloo's own work: no thread hand-off."""
        assert self._board is not None
        self._board.write(seq, fingerprint)
        mine = fingerprint
        work = Checked(self, seq, mine, launch(), result)
        self._inflight[seq] = (op, time.monotonic(), mine, work)
        start_watchdog()
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
        return differs(self._ranks, seq, rows)

    def stalled(self, now: float) -> None:
        """The watchdog's look at collectives older than ``STALL`` s: one that differs from another rank's
        is failed (its wait woken; gloo's op stays stuck, so the group is kept, never destroyed); completed ones
        are let go."""
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
                threading.Thread(target=wait_loop, args=(self._waiter,), daemon=True,
                                 name="colab_kit nccl-rules waiter").start()
            self._waiter.put((work, callback))
            return

        fut.add_done_callback(lambda f: report(f.wait, callback))

    # ------------------------------------------------------------------ collectives (torch's signatures)
    @staged("all_reduce", first)
    def allreduce(self, tensors, opts=None):
        opts = opts or c10d.AllreduceOptions()
        fp = fingerprint("all_reduce", tensors[0], reduce_code(opts.reduceOp))
        return self._collective("all_reduce", tensors, fp, lambda: self._inner.allreduce(tensors, opts), tensors)

    @staged("all_reduce_coalesced", first)
    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or c10d.AllreduceCoalescedOptions()
        fp = fingerprint("all_reduce_coalesced", tensors[0], reduce_code(opts.reduceOp),
                               shape=[len(tensors), sum(t.numel() for t in tensors)])
        return self._collective("all_reduce_coalesced", tensors, fp,
                                lambda: self._inner.allreduce_coalesced(tensors, opts), tensors)

    @staged("broadcast", first)
    def broadcast(self, tensors, opts=None):
        opts = opts or c10d.BroadcastOptions()
        fp = fingerprint("broadcast", tensors[0], opts.rootRank)
        return self._collective("broadcast", tensors, fp, lambda: self._inner.broadcast(tensors, opts), tensors)

    @staged("reduce", root_only)
    def reduce(self, tensors, opts=None):
        opts = opts or c10d.ReduceOptions()
        fp = fingerprint("reduce", tensors[0], (opts.rootRank << 4) | reduce_code(opts.reduceOp))
        return self._collective("reduce", tensors, fp, lambda: self._inner.reduce(tensors, opts), tensors)

    @staged("all_gather", first, written=True)
    def allgather(self, outputs, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        fp = fingerprint("all_gather", inputs[0])
        return self._collective("all_gather", [outputs, inputs], fp,
                                lambda: self._inner.allgather(outputs, inputs, opts), outputs)

    @staged("all_gather_coalesced", first, written=True)
    def allgather_coalesced(self, outputs, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        fp = fingerprint("all_gather_coalesced", inputs[0],
                               shape=[len(inputs), sum(t.numel() for t in inputs)])
        return self._collective("all_gather_coalesced", [outputs, inputs], fp,
                                lambda: self._inner.allgather_coalesced(outputs, inputs, opts), outputs)

    @staged("all_gather_single", first, as_list, written=True)
    def all_gather_single(self, output, input, opts=None):
        opts = opts or c10d.AllgatherOptions()
        fp = fingerprint("all_gather_single", input)
        return self._collective("all_gather_single", [output, input], fp,
                                lambda: self._inner._allgather_base(output, input, opts), [output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return last_of(works)

    @staged("reduce_scatter", first, written=True)
    def reduce_scatter(self, outputs, inputs, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        fp = fingerprint("reduce_scatter", outputs[0], reduce_code(opts.reduceOp))
        return self._collective("reduce_scatter", [outputs, inputs], fp,
                                lambda: self._inner.reduce_scatter(outputs, inputs, opts), outputs)

    @staged("reduce_scatter_single", first, as_list, written=True)
    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        fp = fingerprint("reduce_scatter_single", input, reduce_code(opts.reduceOp))
        return self._collective("reduce_scatter_single", [output, input], fp,
                                lambda: self._inner._reduce_scatter_base(output, input, opts), [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return last_of(works)

    @staged("all_to_all_single", first, as_list, written=True)
    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        opts = opts or c10d.AllToAllOptions()
        even = not output_splits and not input_splits
        fp = fingerprint("all_to_all_single", input, shape=None if even else [-1, *input.shape[1:]])
        return self._collective("all_to_all_single", [output, input], fp,
                                lambda: self._inner.alltoall_base(output, input, output_splits, input_splits, opts),
                                [output])

    alltoall_base = all_to_all_single

    @staged("all_to_all", first, written=True)
    def alltoall(self, outputs, inputs, opts=None):
        opts = opts or c10d.AllToAllOptions()
        fp = fingerprint("all_to_all", inputs[0], shape=[len(inputs)])
        return self._collective("all_to_all", [outputs, inputs], fp,
                                lambda: self._inner.alltoall(outputs, inputs, opts), outputs)

    @staged("gather", first, written=True)
    def gather(self, outputs, inputs, opts=None):
        opts = opts or c10d.GatherOptions()
        fp = fingerprint("gather", inputs[0], opts.rootRank)
        return self._collective("gather", [outputs, inputs], fp,
                                lambda: self._inner.gather(outputs, inputs, opts), outputs)

    @staged("scatter", first, written=True)
    def scatter(self, outputs, inputs, opts=None):
        opts = opts or c10d.ScatterOptions()
        fp = fingerprint("scatter", outputs[0], opts.rootRank)
        return self._collective("scatter", [outputs, inputs], fp,
                                lambda: self._inner.scatter(outputs, inputs, opts), outputs)

    def barrier(self, opts=None):
        opts = opts or c10d.BarrierOptions()
        return self._collective("barrier", [], fingerprint("barrier", None),
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

    @staged("send", nothing)
    def send(self, tensors, dst: int, tag: int = 0):
        op = self._op("send", tensors, dst)
        self._channel(dst).submit(op)
        return FutureWork(op.future, op.tensor)

    @staged("recv", first, written=True)
    def recv(self, tensors, src: int, tag: int = 0):
        op = self._op("recv", tensors, src)
        self._channel(src).submit(op)
        return FutureWork(op.future, op.tensor)

    def recv_anysource(self, tensors, tag: int = 0):
        raise RuleBroken("nccl-rules: NCCL has no receive from any source: name the rank the message comes from")

    def batch(self, ops: list[tuple[str, torch.Tensor, int]]) -> list:
        """``(kind, tensor, group peer)`` ops run as one NCCL group (``batch_isend_irecv``); their Works."""
        if not self.staging:
            return self._batch(ops)
        self._on_device("batch_isend_irecv", [t for _, t, _ in ops], self.device_type)
        staged = [(kind, *to_host(t, t if kind == "recv" else [], written=True), peer) for kind, t, peer in ops]
        works = self._batch([(kind, host, peer) for kind, host, _, peer in staged])
        return [Staged(w, back, [t], kept=t) for w, (_, _, back, _), (_, t, _) in zip(works, staged, ops)]

    def _batch(self, ops: list[tuple[str, torch.Tensor, int]]) -> list:
        made = [self._op(kind, [t], peer) for kind, t, peer in ops]
        channels = [self._channel(p) for p in sorted({op.group_peer for op in made})]
        batch = Batch(made, channels)
        batch.counts = self._counts
        for ch in channels:
            ch.submit(batch)
        return [FutureWork(op.future, op.tensor) for op in made]

    def pending(self) -> list[str]:
        """What this rank issued on this group and is not complete: collectives, then each pair's queue."""
        now = time.monotonic()
        out = [f"collective {seq} {what} ({now - t:.1f} s)" for seq, (what, t, _, _) in sorted(self._inflight.items())]
        for ch in self._channels.values():
            out += ch.describe()
        return out
