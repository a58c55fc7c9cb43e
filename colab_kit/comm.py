"""Collectives that record themselves: every call lands in the mesh's ``CommLog``.

Each record is one collective on one rank: the op, the mesh axis it ran on,
the bytes this rank contributed and the seconds from launch until the result
was ready (for async calls, until ``wait()`` returned). Inside each rank of a dp group of 4::

    comm.all_reduce(grad_bucket, mesh, "dp")   # a 4 KiB bucket
    mesh.log.records[-1]
    # CommRecord(op='all_reduce', axis='dp', bytes=4096, seconds=0.0003, tag='', wire=6144)

The record itself needs no ranks::

    >>> log = CommLog()
    >>> log.add("all_reduce", "dp", 4096, 0.0003, n=4)
    CommRecord(op='all_reduce', axis='dp', bytes=4096, seconds=0.0003, tag='', wire=6144)

Two byte counts per record, because they answer different questions:

``bytes`` (payload)
    what this rank hands to the collective: the tensor it passes in. This is the unit
    of the paper's per-layer formulas (``tensor.linear_comm_bytes``) and it does not
    depend on how the backend moves data. all_reduce, broadcast, reduce, send, recv:
    the tensor (on every rank, the receivers of a broadcast too); all_gather: this
    rank's piece ``s``; reduce_scatter and all_to_all: the whole input ``S`` before it
    is split.
``wire`` (bytes this rank sends, ring / pipelined-chain model, group of n ranks)
    all_reduce ``2 (n-1)/n * S``, reduce_scatter ``(n-1)/n * S``, all_gather
    ``(n-1) * s`` (= ``(n-1)/n`` of the gathered result), broadcast and reduce
    ``(n-1)/n * S`` (a chain forwards S n-1 times; averaged per rank), send ``S``,
    recv ``0``; all_to_all ``(n-1)/n * S`` (it keeps its own block). This is what a link
    carries, so it compares across ops and modes.

Worked example, a 4 KiB tensor on a dp group of 4 ranks::

    all_reduce      bytes 4096   wire 6144     (2 * 3/4 * 4096)
    all_gather      bytes 4096   wire 12288    (3 pieces sent; result 16 KiB)
    reduce_scatter  bytes 4096   wire 3072     (3/4 of the input)
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Aborted", "WaitTimeout", "ABORT_POLL", "CommRecord", "CommLog", "wire_bytes", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "Pending",
           "copy_to_group", "reduce_from_group", "gather_from_group", "split_to_group", "P2PPending", "isend",
           "irecv", "sendrecv", "reduce_scatter_into", "all_gather_into", "all_to_all"]


ABORT_POLL = 0.25
"""Seconds between looks at ``mesh.abort_flag`` while a wait is blocked (see ``finish``)."""


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
        stop = None
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


class _Waiter:
    """A daemon thread that runs ``work.wait()`` for ``finish`` (see there), one work at a time.

    ``watch(work)`` hands the work to an idle thread of the pool (or a new one) and returns
    ``(done, errors, thread)``: ``done`` is set once the wait returned, ``errors`` holds what it
    raised. Each work has its own thread while it waits, so a receive that completes late never
    holds up one that completed early. A thread goes back to the pool after its wait; one whose
    wait was abandoned on a flag or timeout stays blocked in it and is never reused (after a
    hang the pipeline runs no further steps).
    """

    _idle: list["_Waiter"] = []
    _lock = threading.Lock()

    def __init__(self):
        import queue

        self.queue, self.abandoned = queue.SimpleQueue(), False
        threading.Thread(target=self._loop, daemon=True, name="colab_kit comm waiter").start()

    @classmethod
    def watch(cls, work) -> tuple:
        with cls._lock:
            waiter = cls._idle.pop() if cls._idle else cls()
        done, errors = threading.Event(), []
        waiter.queue.put((work, done, errors))
        return done, errors, waiter

    def abandon(self) -> None:
        self.abandoned = True

    def _loop(self) -> None:
        while True:
            work, done, errors = self.queue.get()
            try:
                work.wait()
            except BaseException as exc:  # handed to the waiting thread
                errors.append(exc)
            done.set()
            if self.abandoned:
                return
            with _Waiter._lock:
                _Waiter._idle.append(self)


def wire_bytes(op: str, payload: int, n: int) -> int:
    """Bytes one rank sends for a collective of ``payload`` bytes (see the module docstring)."""
    if op in ("send",):
        return payload
    if op == "recv" or n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * payload // n
    if op == "all_gather":
        return (n - 1) * payload
    return (n - 1) * payload // n  # reduce_scatter, broadcast, reduce, all_to_all


@dataclass
class CommRecord:
    op: str
    axis: str
    bytes: int          # payload: what this rank handed to the collective (the papers' unit)
    seconds: float
    tag: str = ""
    wire: int = 0       # bytes this rank sent under the ring / chain model (``wire_bytes``)


@dataclass
class CommLog:
    """Per-rank list of collectives; ``step()`` marks where a training step begins."""

    records: list = field(default_factory=list)
    step_start: int = 0

    def add(self, op: str, axis: str, nbytes: int, seconds: float, tag: str = "", n: int = 1) -> CommRecord:
        """Record one call; ``n`` is the group's size (for the wire bytes)."""
        rec = CommRecord(op, axis, int(nbytes), float(seconds), tag, wire_bytes(op, int(nbytes), n))
        self.records.append(rec)
        return rec

    def begin_step(self) -> None:
        self.step_start = len(self.records)

    def last_step(self) -> list[CommRecord]:
        return self.records[self.step_start:]

    def summary(self, records=None) -> dict:
        """Totals by (op, axis): count, bytes (payload), wire, seconds."""
        out: dict = {}
        for r in self.records if records is None else records:
            s = out.setdefault(f"{r.op}@{r.axis}", {"count": 0, "bytes": 0, "wire": 0, "seconds": 0.0})
            s["count"] += 1
            s["bytes"] += r.bytes
            s["wire"] += r.wire
            s["seconds"] += r.seconds
        return out

    def as_dicts(self, records=None) -> list[dict]:
        return [asdict(r) for r in (self.records if records is None else records)]


class Pending:
    """An async collective in flight; ``wait()`` finishes it and records its time (once)."""

    def __init__(self, work, log: CommLog, op: str, axis: str, nbytes: int, tag: str, then=None, n: int = 1,
                 flag: threading.Event | None = None):
        self.work, self.log, self.op, self.axis, self.nbytes, self.tag = work, log, op, axis, nbytes, tag
        self.flag = flag
        self.n = n
        self.then = then
        self.t0 = time.perf_counter()
        self.done, self.record = False, None

    def wait(self) -> CommRecord | None:
        if self.done:
            return self.record
        if self.work is not None:  # None: a no-op on a size-1 axis, nothing ran, nothing recorded
            finish(self.work, self.flag, f"{self.op} over {self.axis}")
            self.record = self.log.add(self.op, self.axis, self.nbytes, time.perf_counter() - self.t0, self.tag,
                                       self.n)
        self.done = True
        if self.then is not None:
            self.then()
        return self.record


# The fused, single-buffer forms (NCCL's native allgather / reduce-scatter): one contiguous
# input and one contiguous output, no list of per-rank tensors. torch 2.13 renamed them
# (``*_single``; the old ``*_into_tensor`` / ``*_tensor`` names warn); older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _run(mesh, op: str, axis: str, tensor: torch.Tensor, launch, async_op: bool, tag: str, then=None):
    nbytes = tensor.numel() * tensor.element_size()
    flag = getattr(mesh, "abort_flag", None)  # set during a pipeline step (see pipeline.hang)
    if async_op:
        return Pending(launch(True), mesh.log, op, axis, nbytes, tag, then, mesh.size(axis), flag)
    t0 = time.perf_counter()
    work = launch(flag is not None)  # async while a flag is set, so that the wait can look at it
    if work is not None:
        finish(work, flag, f"{op} over {axis}")
    mesh.log.add(op, axis, nbytes, time.perf_counter() - t0, tag, mesh.size(axis))
    if then is not None:
        then()
    return tensor


def _in_place(tensor: torch.Tensor, then):
    """A contiguous buffer for an in-place collective on ``tensor``, and the ``then`` that copies it back.

    Backends want contiguous buffers (NCCL requires them): a non-contiguous ``tensor`` is
    run through a contiguous copy whose result is written back into it once ready.
    """
    if tensor.is_contiguous():
        return tensor, then
    buf = tensor.contiguous()

    def back():
        tensor.copy_(buf)
        if then is not None:
            then()
    return buf, back


def all_reduce(tensor: torch.Tensor, mesh, axis: str, op=dist.ReduceOp.SUM, *, async_op: bool = False,
               tag: str = "", then=None):
    """In-place all-reduce of ``tensor`` over this rank's ``axis`` group (size 1: no-op, no record).

    With ``async_op=True`` it returns a ``Pending``; ``then`` is called once the result is ready.
    On a size-1 axis nothing runs and nothing is recorded; ``async_op=True`` still returns a
    ``Pending`` whose ``wait()`` returns None.
    """
    if mesh.size(axis) == 1:
        if async_op:
            return Pending(None, mesh.log, "all_reduce", axis, 0, tag, then)
        return tensor
    group = mesh.group(axis)
    buf, then = _in_place(tensor, then)
    out = _run(mesh, "all_reduce", axis, buf,
               lambda a: dist.all_reduce(buf, op=op, group=group, async_op=a), async_op, tag, then)
    return out if async_op else tensor


def broadcast(tensor: torch.Tensor, mesh, axis: str, src: int = 0, *, tag: str = "") -> torch.Tensor:
    """In-place broadcast from the rank whose ``axis`` coordinate is ``src``."""
    if mesh.size(axis) == 1:
        return tensor
    group = mesh.group(axis)
    src_global = mesh.ranks(axis)[src]
    buf, then = _in_place(tensor, None)
    _run(mesh, "broadcast", axis, buf,
         lambda a: dist.broadcast(buf, src=src_global, group=group, async_op=a), False, tag, then)
    return tensor


def all_gather(tensor: torch.Tensor, mesh, axis: str, dim: int = 0, *, tag: str = "") -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in the order of the ``axis`` coordinate.

    One fused all-gather into one contiguous buffer ``[n * numel]`` (rank r's piece at
    ``r * numel``): along ``dim=0`` the result is a view of it, along another dim one
    reorder (the copy ``torch.cat`` would make). Recorded bytes: this rank's piece.
    """
    n = mesh.size(axis)
    if n == 1:
        return tensor
    piece = tensor.contiguous()
    shape = tuple(piece.shape)
    out = torch.empty(n * piece.numel(), dtype=piece.dtype, device=piece.device)
    flat = piece.view(-1)
    _run(mesh, "all_gather", axis, piece,
         lambda a: _all_gather_single(out, flat, group=mesh.group(axis), async_op=a), False, tag)
    dim = dim % max(len(shape), 1)
    stacked = out.view((n,) + shape)                    # [n, *shape]: rank r's piece at [r]
    if dim == 0:
        return stacked.view((n * shape[0],) + shape[1:]) if shape else stacked
    return stacked.movedim(0, dim).reshape(shape[:dim] + (n * shape[dim],) + shape[dim + 1:])


def reduce_scatter(tensor: torch.Tensor, mesh, axis: str, dim: int = 0, *, tag: str = "") -> torch.Tensor:
    """Sum ``tensor`` over the ``axis`` group and keep this rank's slice of ``dim`` (n equal slices).

    One fused reduce-scatter of one contiguous buffer whose ``n`` blocks are the slices in
    rank order: along ``dim=0`` a contiguous ``tensor`` is used as it is, along another dim
    ``dim`` is moved to the front first. Recorded bytes: the whole input.
    """
    n = mesh.size(axis)
    if n == 1:
        return tensor
    dim = dim % tensor.dim()
    if tensor.shape[dim] % n:
        raise ValueError(f"reduce_scatter over {axis} (size {n}) needs dim {dim} of size {tensor.shape[dim]} "
                         f"to be divisible by {n}")
    front = (tensor if dim == 0 else tensor.movedim(dim, 0)).contiguous()   # slices = row blocks
    out = torch.empty((front.shape[0] // n,) + tuple(front.shape[1:]), dtype=front.dtype, device=front.device)
    flat_in, flat_out = front.view(-1), out.view(-1)
    _run(mesh, "reduce_scatter", axis, front,
         lambda a: _reduce_scatter_single(flat_out, flat_in, group=mesh.group(axis), async_op=a), False, tag)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def reduce(tensor: torch.Tensor, mesh, axis: str, dst: int = 0, *, tag: str = "") -> torch.Tensor:
    """In-place sum onto the rank whose ``axis`` coordinate is ``dst`` (others keep garbage)."""
    if mesh.size(axis) == 1:
        return tensor
    dst_global = mesh.ranks(axis)[dst]
    buf, then = _in_place(tensor, None)
    _run(mesh, "reduce", axis, buf,
         lambda a: dist.reduce(buf, dst=dst_global, group=mesh.group(axis), async_op=a), False, tag, then)
    return tensor


def reduce_scatter_into(out: torch.Tensor, tensor: torch.Tensor, mesh, axis: str, *, async_op: bool = False,
                        tag: str = "", then=None):
    """Sum the flat ``tensor`` (n equal blocks, in rank order) over ``axis``; this rank's block lands in ``out``.

    The flat, in-place form that ZeRO runs on its gradient buckets: ``tensor`` and ``out`` are
    contiguous 1-D buffers, ``tensor.numel() == n * out.numel()``; ``out`` may be this rank's own
    block of ``tensor`` (the backends' in-place form). With ``async_op=True`` a ``Pending``. On a
    size-1 axis ``tensor`` is copied into ``out`` (unless it is ``out``), nothing recorded.
    Recorded bytes: the whole input, as ``reduce_scatter``::

        # dp=2, tensor = [a0 a1 a2 a3] on rank 0, [b0 b1 b2 b3] on rank 1
        reduce_scatter_into(out, tensor, mesh, "dp")  # out: [a0+b0, a1+b1] on rank 0, [a2+b2, a3+b3] on rank 1
    """
    n = mesh.size(axis)
    if tensor.numel() != n * out.numel():
        raise ValueError(f"reduce_scatter_into over {axis} (size {n}) needs an input of {n} x {out.numel()} "
                         f"elements, got {tensor.numel()}")
    if n == 1:
        if out.data_ptr() != tensor.data_ptr():
            out.copy_(tensor.view_as(out))
        if async_op:
            return Pending(None, mesh.log, "reduce_scatter", axis, 0, tag, then)
        return out
    result = _run(mesh, "reduce_scatter", axis, tensor,
                  lambda a: _reduce_scatter_single(out, tensor, group=mesh.group(axis), async_op=a), async_op, tag,
                  then)
    return result if async_op else out


def all_gather_into(out: torch.Tensor, piece: torch.Tensor, mesh, axis: str, *, async_op: bool = False,
                    tag: str = "", then=None):
    """Every rank's flat ``piece`` over ``axis``, back to back in rank order, into the flat ``out``.

    ``out.numel() == n * piece.numel()``; ``piece`` may be this rank's own block of ``out``
    (in place: ZeRO's updated shard inside the bucket of parameters). With ``async_op=True``
    a ``Pending``. Recorded bytes: this rank's piece, as ``all_gather``.
    """
    n = mesh.size(axis)
    if out.numel() != n * piece.numel():
        raise ValueError(f"all_gather_into over {axis} (size {n}) needs an output of {n} x {piece.numel()} "
                         f"elements, got {out.numel()}")
    if n == 1:
        if out.data_ptr() != piece.data_ptr():
            out.copy_(piece.view_as(out))
        if async_op:
            return Pending(None, mesh.log, "all_gather", axis, 0, tag, then)
        return out
    result = _run(mesh, "all_gather", axis, piece,
                  lambda a: _all_gather_single(out, piece, group=mesh.group(axis), async_op=a), async_op, tag, then)
    return result if async_op else out


def all_to_all(tensor: torch.Tensor, mesh, axis: str, split_dim: int, cat_dim: int, *,
               tag: str = "") -> torch.Tensor:
    """Cut ``tensor`` into n equal blocks along ``split_dim``, send block j to ``axis`` coordinate j,
    and concatenate the blocks received along ``cat_dim`` in rank order.

    One fused ``all_to_all_single`` of one contiguous buffer (``split_dim`` moved to the
    front). The reverse exchange is ``all_to_all(y, mesh, axis, cat_dim, split_dim)``. Size-1
    axis: ``tensor`` itself, nothing recorded. Recorded bytes: the whole input. DeepSpeed-Ulysses'
    sequence-to-heads exchange, sp=2, ``x`` of shape ``[heads=4, t/2=3]`` on each rank::

        all_to_all(x, mesh, "sp", split_dim=0, cat_dim=1)   # -> [heads 2, t 6]
        # rank 0: heads 0-1 of rank 0's tokens, then of rank 1's; rank 1: heads 2-3 likewise
    """
    n = mesh.size(axis)
    if n == 1:
        return tensor
    split_dim, cat_dim = split_dim % tensor.dim(), cat_dim % tensor.dim()
    if tensor.shape[split_dim] % n:
        raise ValueError(f"all_to_all over {axis} (size {n}) needs dim {split_dim} of size "
                         f"{tensor.shape[split_dim]} to be divisible by {n}")
    front = tensor.movedim(split_dim, 0).contiguous()  # block j (rows j*s/n ...) goes to rank j
    out = torch.empty_like(front)
    _run(mesh, "all_to_all", axis, front,
         lambda a: dist.all_to_all_single(out, front, group=mesh.group(axis), async_op=a), False, tag)
    pieces = out.view((n, front.shape[0] // n) + tuple(front.shape[1:])).movedim(1, split_dim + 1)
    shape = tuple(pieces.shape[1:])                      # one piece, split_dim already 1/n
    return pieces.movedim(0, cat_dim).reshape(shape[:cat_dim] + (n * shape[cat_dim],) + shape[cat_dim + 1:])


# --------------------------------------------------------------------------- point-to-point
# The pipeline's sends and receives between neighbouring stages. Recorded like the
# collectives (op "send" / "recv", the axis, the payload bytes, seconds from posting
# until ``wait()`` returned), so ``mesh.log.summary()`` shows them as ``send@pp``.

class P2PPending(Pending):
    """A point-to-point send or receive in flight; ``wait(timeout)`` finishes and records it.

    With a ``timeout`` (seconds) a wait that runs out raises ``WaitTimeout``; while the
    mesh's ``abort_flag`` is set up (a pipeline step) a raised flag ends it with ``Aborted``.
    ``armed``: a waiter thread waits on it from the moment it was posted (``arm=True``).
    """

    armed = None

    def wait(self, timeout: float | None = None) -> CommRecord:
        finish(self.work, self.flag, f"{self.op} over {self.axis} ({self.tag})", timeout, self.armed)
        rec = self.log.add(self.op, self.axis, self.nbytes, time.perf_counter() - self.t0, self.tag)
        if self.then is not None:
            self.then()
        return rec


def _p2p(op, tensor, mesh, axis, peer, msg_tag, tag, arm=False):
    if not 0 <= peer < mesh.size(axis) or peer == mesh.rank(axis):
        raise ValueError(f"{op} over {axis} needs a peer coordinate other than this rank's "
                         f"({mesh.rank(axis)}) in 0..{mesh.size(axis) - 1}, got {peer}")
    other = mesh.ranks(axis)[peer]
    fn = dist.isend if op == "send" else dist.irecv
    kw = {"dst": other} if op == "send" else {"src": other}
    work = fn(tensor, group=mesh.group(axis), tag=msg_tag, **kw)
    pending = P2PPending(work, mesh.log, op, axis, tensor.numel() * tensor.element_size(), tag,
                         flag=getattr(mesh, "abort_flag", None))
    if arm:
        pending.armed = _Waiter.watch(work)
    return pending


def isend(tensor: torch.Tensor, mesh, axis: str, peer: int, *, msg_tag: int = 0, tag: str = "",
          arm: bool = False) -> P2PPending:
    """Start sending ``tensor`` to the rank whose ``axis`` coordinate is ``peer`` (same other coordinates).

    ``msg_tag`` is the backend's message tag (the receive must use the same one); ``tag``
    labels the record. Keep ``tensor`` unchanged until ``wait()`` returns. ``arm=True``: a
    waiter thread starts waiting now, so ``wait()`` on a completed send returns at once
    (the pipeline's sends and receives are armed).
    """
    return _p2p("send", tensor.contiguous(), mesh, axis, peer, msg_tag, tag, arm)


def irecv(tensor: torch.Tensor, mesh, axis: str, peer: int, *, msg_tag: int = 0, tag: str = "",
          arm: bool = False) -> P2PPending:
    """Start receiving into ``tensor`` (contiguous, of the sent shape) from the ``axis`` coordinate ``peer``
    (``arm`` as for ``isend``)."""
    return _p2p("recv", tensor, mesh, axis, peer, msg_tag, tag, arm)


def sendrecv(send: torch.Tensor, recv: torch.Tensor, mesh, axis: str, to: int, source: int, *, msg_tag: int = 0,
             tag: str = "") -> list[P2PPending]:
    """Post a send of ``send`` to ``axis`` coordinate ``to`` and a receive into ``recv`` from ``source``, together.

    One ring step: every rank sends to its next and receives from its previous at once. Both
    go in one ``batch_isend_irecv``, so NCCL runs them as one group (posted one by one, the
    sends of a ring can wait on each other); gloo runs them as two messages. Returns the two
    ``P2PPending`` (send, recv), recorded as ``send`` / ``recv`` once waited. Keep ``send``
    unchanged until then. Ring attention's step on rank 1 of sp=4::

        sendrecv(kv, incoming, mesh, "sp", to=2, source=0, msg_tag=i, tag="ring kv")
    """
    n, me = mesh.size(axis), mesh.rank(axis)
    for op, peer in (("send", to), ("recv", source)):
        if not 0 <= peer < n or peer == me:
            raise ValueError(f"{op} over {axis} needs a peer coordinate other than this rank's ({me}) "
                             f"in 0..{n - 1}, got {peer}")
    send, group, ranks = send.contiguous(), mesh.group(axis), mesh.ranks(axis)
    ops = [dist.P2POp(dist.isend, send, ranks[to], group, msg_tag),
           dist.P2POp(dist.irecv, recv, ranks[source], group, msg_tag)]
    works = dist.batch_isend_irecv(ops)
    flag = getattr(mesh, "abort_flag", None)
    return [P2PPending(w, mesh.log, op, axis, t.numel() * t.element_size(), tag, flag=flag)
            for w, op, t in zip(works, ("send", "recv"), (send, recv))]


# --------------------------------------------------------------------------- autograd collectives
# Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053) names the pair of conjugate operators
# around a tensor-parallel MLP f and g: f is the identity forward and an all-reduce backward,
# g the reverse. Every collective they run is recorded like the plain ones above.

class CopyToGroup(torch.autograd.Function):
    """Megatron's f: forward identity; backward all-reduce (sum) of the gradient over ``axis``.

    Put in front of a column-parallel layer whose input is replicated: each rank's
    slice of the layer contributes part of the input gradient.
    """

    @staticmethod
    def forward(ctx, x, mesh, axis):
        ctx.mesh, ctx.axis = mesh, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.mesh, ctx.axis, tag="f backward"), None, None


class ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: forward all-reduce (sum) over ``axis``; backward identity.

    Put after a row-parallel layer: each rank holds a partial sum of the output.
    """

    @staticmethod
    def forward(ctx, x, mesh, axis):
        return all_reduce(x.contiguous().clone(), mesh, axis, tag="g forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherFromGroup(torch.autograd.Function):
    """Forward all-gather along ``dim`` over ``axis``; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, mesh, axis, dim):
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return all_gather(x, mesh, axis, dim, tag="gather forward")

    @staticmethod
    def backward(ctx, grad):
        n, i = ctx.mesh.size(ctx.axis), ctx.mesh.rank(ctx.axis)
        return grad.chunk(n, dim=ctx.dim)[i].contiguous(), None, None, None


class SplitToGroup(torch.autograd.Function):
    """Forward keeps this rank's slice of ``dim``; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, mesh, axis, dim):
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        n, i = mesh.size(axis), mesh.rank(axis)
        return x.chunk(n, dim=dim)[i].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.mesh, ctx.axis, ctx.dim, tag="split backward"), None, None, None


def copy_to_group(x, mesh, axis):
    return CopyToGroup.apply(x, mesh, axis) if mesh.size(axis) > 1 else x


def reduce_from_group(x, mesh, axis):
    return ReduceFromGroup.apply(x, mesh, axis) if mesh.size(axis) > 1 else x


def gather_from_group(x, mesh, axis, dim=-1):
    return GatherFromGroup.apply(x, mesh, axis, dim % x.dim()) if mesh.size(axis) > 1 else x


def split_to_group(x, mesh, axis, dim=-1):
    return SplitToGroup.apply(x, mesh, axis, dim % x.dim()) if mesh.size(axis) > 1 else x
