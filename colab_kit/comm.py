"""Collectives that record themselves: every call lands in the mesh's ``CommLog``.

Each record is one collective on one rank: the op, the mesh axis it ran on,
the bytes this rank contributed and the seconds from launch until the result
was ready (for async calls, until ``wait()`` returned)::

    >>> from colab_kit import comm
    >>> comm.all_reduce(grad_bucket, mesh, "dp")          # on every rank of the dp group
    >>> mesh.log.records[-1]
    CommRecord(op='all_reduce', axis='dp', bytes=4096, seconds=0.0003, tag='', wire=6144)

Two byte counts per record, because they answer different questions:

``bytes`` (payload)
    what this rank hands to the collective: the tensor it passes in. This is the unit
    of the paper's per-layer formulas (``tensor.linear_comm_bytes``) and it does not
    depend on how the backend moves data. all_reduce, broadcast, reduce, send, recv:
    the tensor (on every rank, the receivers of a broadcast too); all_gather: this
    rank's piece ``s``; reduce_scatter: the whole input ``S`` before it is split.
``wire`` (bytes this rank sends, ring / pipelined-chain model, group of n ranks)
    all_reduce ``2 (n-1)/n * S``, reduce_scatter ``(n-1)/n * S``, all_gather
    ``(n-1) * s`` (= ``(n-1)/n`` of the gathered result), broadcast and reduce
    ``(n-1)/n * S`` (a chain forwards S n-1 times; averaged per rank), send ``S``,
    recv ``0``. This is what a link carries, so it compares across ops and modes.

Worked example, a 4 KiB tensor on a dp group of 4 ranks::

    all_reduce      bytes 4096   wire 6144     (2 * 3/4 * 4096)
    all_gather      bytes 4096   wire 12288    (3 pieces sent; result 16 KiB)
    reduce_scatter  bytes 4096   wire 3072     (3/4 of the input)
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CommRecord", "CommLog", "wire_bytes", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "Pending",
           "copy_to_group", "reduce_from_group", "gather_from_group", "split_to_group", "P2PPending", "isend",
           "irecv"]


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
    return (n - 1) * payload // n  # reduce_scatter, broadcast, reduce


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

    def __init__(self, work, log: CommLog, op: str, axis: str, nbytes: int, tag: str, then=None, n: int = 1):
        self.work, self.log, self.op, self.axis, self.nbytes, self.tag = work, log, op, axis, nbytes, tag
        self.n = n
        self.then = then
        self.t0 = time.perf_counter()
        self.done, self.record = False, None

    def wait(self) -> CommRecord | None:
        if self.done:
            return self.record
        if self.work is not None:  # None: a no-op on a size-1 axis, nothing ran, nothing recorded
            self.work.wait()
            self.record = self.log.add(self.op, self.axis, self.nbytes, time.perf_counter() - self.t0, self.tag,
                                       self.n)
        self.done = True
        if self.then is not None:
            self.then()
        return self.record


def _run(mesh, op: str, axis: str, tensor: torch.Tensor, launch, async_op: bool, tag: str, then=None):
    nbytes = tensor.numel() * tensor.element_size()
    if async_op:
        return Pending(launch(True), mesh.log, op, axis, nbytes, tag, then, mesh.size(axis))
    t0 = time.perf_counter()
    work = launch(False)
    if work is not None:
        work.wait()
    mesh.log.add(op, axis, nbytes, time.perf_counter() - t0, tag, mesh.size(axis))
    if then is not None:
        then()
    return tensor


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
    return _run(mesh, "all_reduce", axis, tensor,
                lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op, tag, then)


def broadcast(tensor: torch.Tensor, mesh, axis: str, src: int = 0, *, tag: str = "") -> torch.Tensor:
    """In-place broadcast from the rank whose ``axis`` coordinate is ``src``."""
    if mesh.size(axis) == 1:
        return tensor
    group = mesh.group(axis)
    src_global = mesh.ranks(axis)[src]
    return _run(mesh, "broadcast", axis, tensor,
                lambda a: dist.broadcast(tensor, src=src_global, group=group, async_op=a), False, tag)


def all_gather(tensor: torch.Tensor, mesh, axis: str, dim: int = 0, *, tag: str = "") -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in the order of the ``axis`` coordinate."""
    n = mesh.size(axis)
    if n == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(n)]
    tensor = tensor.contiguous()
    _run(mesh, "all_gather", axis, tensor,
         lambda a: dist.all_gather(parts, tensor, group=mesh.group(axis), async_op=a), False, tag)
    return torch.cat(parts, dim=dim)


def reduce_scatter(tensor: torch.Tensor, mesh, axis: str, dim: int = 0, *, tag: str = "") -> torch.Tensor:
    """Sum ``tensor`` over the ``axis`` group and keep this rank's slice of ``dim`` (n equal slices)."""
    n = mesh.size(axis)
    if n == 1:
        return tensor
    if tensor.shape[dim] % n:
        raise ValueError(f"reduce_scatter over {axis} (size {n}) needs dim {dim} of size {tensor.shape[dim]} "
                         f"to be divisible by {n}")
    parts = [p.contiguous() for p in tensor.chunk(n, dim=dim)]
    out = torch.empty_like(parts[0])
    _run(mesh, "reduce_scatter", axis, tensor,
         lambda a: dist.reduce_scatter(out, parts, group=mesh.group(axis), async_op=a), False, tag)
    return out


def reduce(tensor: torch.Tensor, mesh, axis: str, dst: int = 0, *, tag: str = "") -> torch.Tensor:
    """In-place sum onto the rank whose ``axis`` coordinate is ``dst`` (others keep garbage)."""
    if mesh.size(axis) == 1:
        return tensor
    dst_global = mesh.ranks(axis)[dst]
    return _run(mesh, "reduce", axis, tensor,
                lambda a: dist.reduce(tensor, dst=dst_global, group=mesh.group(axis), async_op=a), False, tag)


# --------------------------------------------------------------------------- point-to-point
# The pipeline's sends and receives between neighbouring stages. Recorded like the
# collectives (op "send" / "recv", the axis, the payload bytes, seconds from posting
# until ``wait()`` returned), so ``mesh.log.summary()`` shows them as ``send@pp``.

class P2PPending(Pending):
    """A point-to-point send or receive in flight; ``wait(timeout)`` finishes and records it.

    With a ``timeout`` (seconds) a wait that runs out raises the backend's RuntimeError
    (gloo then closes the connection to that peer: the job cannot go on after it).
    """

    def wait(self, timeout: float | None = None) -> CommRecord:
        from datetime import timedelta

        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timedelta(seconds=timeout))
        rec = self.log.add(self.op, self.axis, self.nbytes, time.perf_counter() - self.t0, self.tag)
        if self.then is not None:
            self.then()
        return rec


def _p2p(op, tensor, mesh, axis, peer, msg_tag, tag):
    if not 0 <= peer < mesh.size(axis) or peer == mesh.rank(axis):
        raise ValueError(f"{op} over {axis} needs a peer coordinate other than this rank's "
                         f"({mesh.rank(axis)}) in 0..{mesh.size(axis) - 1}, got {peer}")
    other = mesh.ranks(axis)[peer]
    fn = dist.isend if op == "send" else dist.irecv
    kw = {"dst": other} if op == "send" else {"src": other}
    work = fn(tensor, group=mesh.group(axis), tag=msg_tag, **kw)
    return P2PPending(work, mesh.log, op, axis, tensor.numel() * tensor.element_size(), tag)


def isend(tensor: torch.Tensor, mesh, axis: str, peer: int, *, msg_tag: int = 0, tag: str = "") -> P2PPending:
    """Start sending ``tensor`` to the rank whose ``axis`` coordinate is ``peer`` (same other coordinates).

    ``msg_tag`` is the backend's message tag (the receive must use the same one); ``tag``
    labels the record. Keep ``tensor`` unchanged until ``wait()`` returns.
    """
    return _p2p("send", tensor.contiguous(), mesh, axis, peer, msg_tag, tag)


def irecv(tensor: torch.Tensor, mesh, axis: str, peer: int, *, msg_tag: int = 0, tag: str = "") -> P2PPending:
    """Start receiving into ``tensor`` (contiguous, of the sent shape) from the ``axis`` coordinate ``peer``."""
    return _p2p("recv", tensor, mesh, axis, peer, msg_tag, tag)


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
