"""The recorded collectives over a mesh axis: all_reduce, broadcast, reduce, all_gather,
reduce_scatter (and their fused single-buffer ``*_into`` forms), all_to_all. Part of
``colab_kit.comm``; see its docstring."""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from .waiting import Pending, finish

__all__ = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "reduce_scatter_into",
           "all_gather_into", "all_to_all", "all_to_all_v"]


# The fused, single-buffer forms (NCCL's native allgather / reduce-scatter): one contiguous
# input and one contiguous output, no list of per-rank tensors. torch 2.13 renamed them
# (``*_single``; the old ``*_into_tensor`` / ``*_tensor`` names warn); older torch has only those.
torch_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch's own all-gather into one tensor, unrecorded (torch 2.13 renamed ``all_gather_into_tensor``)."""
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _run(mesh, op: str, axis: str, tensor: torch.Tensor, launch, async_op: bool, tag: str, then=None, wire=None):
    nbytes = tensor.numel() * tensor.element_size()
    flag = mesh.abort_flag  # the hang flag, set during a pipeline step (see pipeline.hang)
    if async_op:
        return Pending(launch(True), mesh.log, op, axis, nbytes, tag, then, mesh.size(axis), flag)
    t0 = time.perf_counter()
    work = launch(flag is not None)  # async while a flag is set, so that the wait can look at it
    if work is not None:
        finish(work, flag, f"{op} over {axis}")
    now = time.perf_counter()
    mesh.log.add(op, axis, nbytes, now - t0, tag, mesh.size(axis), end=now, wire=wire)
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


ONE_SHOT_BYTES = 64 << 10
"""Largest sum (max, min) of a pair of CPU ranks that ``all_reduce`` runs one-shot (0: never); see ``all_reduce``."""

_COMBINE = ((dist.ReduceOp.SUM, torch.add), (dist.ReduceOp.MAX, torch.maximum), (dist.ReduceOp.MIN, torch.minimum))


def _combine_of(op):
    """The local op that one-shot uses for ``op`` (a ``ReduceOp`` or its member; ``op == member`` holds for
    both, the reverse not for the object), or None."""
    return next((f for member, f in _COMBINE if op == member), None)


def all_reduce(tensor: torch.Tensor, mesh, axis: str, op=dist.ReduceOp.SUM, *, async_op: bool = False,
               tag: str = "", then=None):
    """In-place all-reduce of ``tensor`` over this rank's ``axis`` group (size 1: no-op, no record).

    With ``async_op=True`` it returns a ``Pending``; ``then`` is called once the result is ready.
    On a size-1 axis nothing runs and nothing is recorded; ``async_op=True`` still returns a
    ``Pending`` whose ``wait()`` returns None.

    A blocking sum, max or min of 2 or more elements and at most ``ONE_SHOT_BYTES`` bytes over a pair of CPU
    ranks runs one-shot: one exchange of the whole tensor (an all-gather) and a local add (maximum,
    minimum), where gloo's ring takes two rounds of half of it; each rank sends the same bytes either way
    (``wire``), both ranks combine the two pieces in rank order, so they hold the same bits, the ring's
    (a max or min with a NaN is NaN on both ranks; gloo's keeps whichever its comparison order keeps).
    The pairs of tp=2 take it for 1D's all-reduces of a block's activations (64 KiB for 8 rows of 32
    tokens at d=64) and the vocab-parallel cross-entropy's max and sums; a one-element tensor (the
    engine's loss, a norm) goes gloo's own short way, and so do async calls (gradient buckets), groups
    of 3 or more (one-shot would send ``n - 1`` times the tensor there, the ring ``2 (n - 1) / n``) and GPU
    tensors (NCCL picks its own algorithm). The record's seconds end when the exchange does (the add,
    microseconds, is the caller's compute). Measured: raw gloo on 2 ranks (by hand, ``dist.all_reduce``
    against ``all_gather`` + add, 100 calls, best of 3) 16 elements 490 / 289 us, 1,024 599 / 350,
    16,384 749 / 363, 65,536 938 / 1,192 (the ring wins there); in ``bench/one_shot.py`` a dp=2 x tp=2 step of
    the 4-block test GPT at 0.88 of the ring's (the collective alone within that VM's noise)::

        rank 0: x0 = [1., 2.]    all_reduce(x0, mesh, "tp")  ->  both pieces [1., 2., 10., 20.]
        rank 1: x1 = [10., 20.]                                  x0 = x1 = [1. + 10., 2. + 20.]
    """
    if mesh.size(axis) == 1:
        if async_op:
            return Pending(None, mesh.log, "all_reduce", axis, 0, tag, then)
        return tensor
    group = mesh.group(axis)
    buf, then = _in_place(tensor, then)
    combine = None if async_op else _one_shot(buf, mesh.size(axis), op)
    if combine is not None:
        # outside autograd, as gloo's all_reduce is: a tensor that requires grad is written in place
        flat = buf.detach().view(-1)
        pieces = torch.empty(2 * flat.numel(), dtype=flat.dtype, device=flat.device)
        done = then

        def combined():  # after the exchange: rank 0's piece with rank 1's, on both ranks
            with torch.inference_mode() if flat.is_inference() else torch.no_grad():
                combine(pieces[:flat.numel()], pieces[flat.numel():], out=flat)
            if done is not None:
                done()
        _run(mesh, "all_reduce", axis, buf,
             lambda a: torch_all_gather_single(pieces, flat, group=group, async_op=a), False, tag, combined)
        return tensor
    out = _run(mesh, "all_reduce", axis, buf,
               lambda a: dist.all_reduce(buf, op=op, group=group, async_op=a), async_op, tag, then)
    return out if async_op else tensor


def _one_shot(buf: torch.Tensor, n: int, op):
    """The local combine ``all_reduce`` runs one-shot with, or None where it keeps the backend's: a pair of
    CPU ranks, a sum (max, min: not of complex numbers), 2 or more elements, ``ONE_SHOT_BYTES`` or fewer bytes."""
    if n != 2 or buf.device.type != "cpu" or not 1 < buf.numel() <= ONE_SHOT_BYTES // buf.element_size():
        return None
    combine = _combine_of(op)
    return None if buf.is_complex() and combine is not torch.add else combine


def one_shot_record(record) -> bool:
    """Whether a blocking all-reduce ``record`` (``CommRecord``) may have run one-shot: 2 or more elements
    of at most ``ONE_SHOT_BYTES`` on a pair (its wire bytes are its payload). ``observe.profile`` lets such a
    record take the backend's all-gather."""
    return (record.op == "all_reduce" and record.waited is None and record.wire == record.bytes > 1
            and record.bytes <= ONE_SHOT_BYTES)


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
         lambda a: torch_all_gather_single(out, flat, group=mesh.group(axis), async_op=a), False, tag)
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
    return _fused("reduce_scatter", out, tensor, tensor, out, mesh, axis, _reduce_scatter_single, async_op, tag, then)


def all_gather_into(out: torch.Tensor, piece: torch.Tensor, mesh, axis: str, *, async_op: bool = False,
                    tag: str = "", then=None):
    """Every rank's flat ``piece`` over ``axis``, back to back in rank order, into the flat ``out``.

    ``out.numel() == n * piece.numel()``; ``piece`` may be this rank's own block of ``out``
    (in place: ZeRO's updated shard inside the bucket of parameters). With ``async_op=True``
    a ``Pending``. Recorded bytes: this rank's piece, as ``all_gather``.
    """
    return _fused("all_gather", out, piece, out, piece, mesh, axis, torch_all_gather_single, async_op, tag, then)


def _fused(op: str, out, src, whole, block, mesh, axis: str, single, async_op: bool, tag: str, then):
    """The single-buffer ``op`` of ``src`` into ``out`` (``whole`` holds n of ``block``): the
    size check, a copy on a size-1 axis (nothing recorded), else ``single`` recorded as ``op``
    with ``src``'s bytes."""
    n = mesh.size(axis)
    if whole.numel() != n * block.numel():
        side = "an input" if whole is src else "an output"
        raise ValueError(f"{op}_into over {axis} (size {n}) needs {side} of {n} x {block.numel()} elements, "
                         f"got {whole.numel()}")
    if n == 1:
        if out.data_ptr() != src.data_ptr():
            out.copy_(src.view_as(out))
        return Pending(None, mesh.log, op, axis, 0, tag, then) if async_op else out
    result = _run(mesh, op, axis, src, lambda a: single(out, src, group=mesh.group(axis), async_op=a), async_op, tag,
                  then)
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


def all_to_all_v(tensor: torch.Tensor, send: list[int], recv: list[int], mesh, axis: str, *,
                 tag: str = "") -> torch.Tensor:
    """Uneven all-to-all of rows: the first ``send[0]`` rows of ``tensor`` go to ``axis`` coordinate 0, the next
    ``send[1]`` to 1, ...; the result holds ``recv[j]`` rows from coordinate j, in coordinate order (``recv`` is
    what the others send here: the caller exchanged the counts). Recorded as op ``all_to_all``: payload the
    whole input, wire the rows sent to other ranks (this rank's own block stays). Size-1 axis: ``tensor``.

    GShard's dispatch, ep=2, rank 0 sends 3 rows to itself and 1 to rank 1, rank 1 sends 2 and 2::

        rank 0: all_to_all_v(x0, [3, 1], [3, 2], mesh, "ep")   # -> its own 3 rows, then rank 1's first 2
        rank 1: all_to_all_v(x1, [2, 2], [1, 2], mesh, "ep")   # -> rank 0's last row, then its own last 2
    """
    if mesh.size(axis) == 1:
        return tensor
    src = tensor.contiguous()
    out = src.new_empty((sum(recv),) + tuple(src.shape[1:]))
    row = math.prod(src.shape[1:]) * src.element_size()  # a rank may send no row
    wire = (sum(send) - send[mesh.rank(axis)]) * row
    _run(mesh, "all_to_all", axis, src, lambda a: dist.all_to_all_single(out, src, list(recv), list(send),
                                                                         group=mesh.group(axis), async_op=a),
         False, tag, wire=wire)
    return out


# --------------------------------------------------------------------------- point-to-point
# The pipeline's sends and receives between neighbouring stages. Recorded like the
# collectives (op "send" / "recv", the axis, the payload bytes, seconds from posting
# until ``wait()`` returned), so ``mesh.log.summary()`` shows them as ``send@pp``.
