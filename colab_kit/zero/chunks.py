"""Chunks: the parameters of one unit of a model in one flat buffer, sharded over the dp axis (dp x sp under
sequence parallelism).

Gemini (Colossal-AI's heterogeneous memory manager) keeps parameters in chunks: flat buffers
that are gathered, freed, reduced and moved as one. Here a chunk holds one unit of the model
(a transformer block, or the parameters outside the blocks: embeddings, final LayerNorm, head),
in the order the forward pass uses them, so "gather the next chunk" is "gather the next block".

A chunk of ``numel`` elements is padded to ``size``, a multiple of n (its axis's size: dp, dp x sp), and cut into n
pieces of ``size / n``; rank r keeps piece r as ``shard`` (an fp32 tensor of its own, what the
optimizer steps) with its ``shard.grad``. The unit's parameters are views into ``full``, a
buffer of ``size`` elements whose storage exists only while the chunk is gathered: ``free()``
resizes the storage to zero bytes, ``gather()`` allocates it again and all-gathers every
rank's piece into it. The parameters stay the same ``nn.Parameter`` objects throughout (autograd
saved them in forward; their data is there again when the chunk is gathered for backward).
In DTensor's words, per chunk over dp: ``shard`` Shard(0); ``full`` Replicate while gathered. With expert
parallelism a block's expert tensors are a chunk of their own over edp (``colab_kit.zero.split.chunk_units``).

Worked example, dp=2, a chunk with a weight [3, 2] and a bias [3] (9 elements, padded to 10)::

    full (gathered)   [w00 w01 w10 w11 w20 w21 b0 b1 b2 pad]
    rank 0 shard      [w00 w01 w10 w11 w20]             rank 1 shard  [w21 b0 b1 b2 pad]
    backward          p.grad are views into grad_full (zeros at the chunk's backward gather); or,
                      for a chunk that collects (ZeRO-3's rest), autograd's own tensors, copied
                      into a fresh grad_full by collect_grads() when the last has arrived
    reduce_grads()    grad_full / 2, reduce-scatter in place -> rank r adds its 5 summed
                      elements into shard.grad; grad_full is dropped once that finished

Mixed precision (``colab_kit.precision``): ``full``, ``shard`` and ``shard.grad`` are 16-bit;
the gradient is reduce-scattered in fp32 (a copy of ``grad_full``) and added into the 16-bit
``shard.grad``; the fp32 masters the optimizer steps belong to ``ZeroStage3``.

Every step of a chunk's life is a state: "free" -> "gathering" (all-gather in flight) ->
"full" -> "free". Gathering a chunk that is gathering waits for it; gathering a full one does
nothing; so a prefetch and a use in either order cost one all-gather.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..config import Axis
from .. import comm
from .. import sharded_init

__all__ = ["Chunk", "padded"]


def padded(numel: int, n: int) -> int:
    """``numel`` rounded up to a multiple of ``n``."""
    return -(-numel // n) * n


class Chunk:
    """The parameters ``params`` of unit ``name`` in one flat buffer, sharded over ``axis``."""

    def __init__(self, index: int, name: str, params: list[nn.Parameter], mesh, axis: str = Axis.DP):
        self.index, self.name, self.params, self.mesh, self.axis = index, name, params, mesh, axis
        n, r = mesh.size(axis), mesh.rank(axis)
        self.n, self.rank = n, r
        self.divisor = mesh.size(Axis.DP)
        """What the summed gradient is divided by: dp (the mean over the data-parallel replicas; over ``dp_sp``
        the sp ranks' token shares are summed, and an expert chunk's sum over edp already holds every dp rank's
        tokens: ``colab_kit.zero.split``)."""
        self.numel = sum(p.numel() for p in params)
        self.size = padded(max(self.numel, 1), n)
        self.piece = self.size // n
        dtype = params[0].dtype if params else torch.float32
        device = params[0].device if params else mesh.device
        self.full = torch.empty(self.size, dtype=dtype, device=device)  # written where it is read
        self.offsets: dict[int, int] = {}  # id(param) -> its offset in the flat space
        lo, hi, off = r * self.piece, (r + 1) * self.piece, 0
        with torch.no_grad():
            self.full[self.numel:].zero_()  # the padding
            for p in params:
                view = self.full[off:off + p.numel()]
                if sharded_init.unmade(p):  # a meta model's parameter: only this rank's piece of it is made
                    a, b = max(off, lo), min(off + p.numel(), hi)
                    if a < b:
                        self.full[a:b].copy_(sharded_init.dense_value(p).reshape(-1)[a - off:b - off])
                    sharded_init.forget(p)
                else:
                    view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
                self.offsets[id(p)] = off
                off += p.numel()
        self.shard = nn.Parameter(self.full[r * self.piece:(r + 1) * self.piece].clone())
        self.shard.grad = torch.zeros_like(self.shard)
        self.grad_full: torch.Tensor | None = None
        self.state, self.ready = "full", 0
        self.pending: Any = None  # the all-gather in flight
        # (pending reduce-scatter, grad_full) until its piece is added
        self._reducing: tuple[Any, torch.Tensor] | None = None
        self.fresh = True  # shard.grad is zero (no reduction since the last step): the next is copied in
        self.free()

    # ------------------------------------------------------------------ parameters
    @property
    def nbytes(self) -> int:
        """Bytes of the whole chunk when gathered."""
        return self.size * self.full.element_size()

    def gather(self, async_op: bool = False, source: torch.Tensor | None = None) -> None:
        """Make the parameters whole: all-gather every rank's piece (async: ``wait()`` later);
        ``source``: this rank's piece where the collective can read it (a staged copy of a shard on the host)."""
        if self.state == "full":
            return
        if self.state == "gathering":
            if not async_op:
                self.wait()
            return
        self.full.untyped_storage().resize_(self.nbytes)
        self.state = "gathering"
        piece = self.shard.detach() if source is None else source
        self.pending = comm.all_gather_into(self.full, piece, self.mesh, self.axis, async_op=True,
                                            tag=f"zero3 gather {self.name}")
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self.state == "gathering":
            self.pending.wait()
            self.pending, self.state = None, "full"

    def free(self) -> None:
        """Drop the gathered parameters (their storage goes to zero bytes); this rank's shard stays."""
        if self.state == "gathering":
            self.wait()
        if self.state == "full":
            self.full.untyped_storage().resize_(0)
            self.state = "free"

    @property
    def reducing(self) -> bool:
        """A reduce-scatter of this chunk's gradient is in flight (``finish_reduce`` adds its piece)."""
        return self._reducing is not None

    def storage_ptr(self) -> int:
        return self.full.untyped_storage().data_ptr()

    # ------------------------------------------------------------------ gradients
    def prepare_grads(self) -> None:
        """Give every parameter a zero ``.grad`` view into one flat buffer (before its backward)."""
        if self.grad_full is not None:
            return  # still accumulating (an earlier microbatch left it unreduced)
        self.grad_full = torch.zeros(self.size, dtype=self.full.dtype, device=self.full.device)
        for p in self.params:
            off = self.offsets[id(p)]
            p.grad = self.grad_full[off:off + p.numel()].view_as(p)

    def has_grads(self) -> bool:
        """Some gradient of this microbatch or an earlier one waits to be reduced."""
        return self.grad_full is not None or any(p.grad is not None for p in self.params)

    def collect_grads(self) -> None:
        """A chunk whose gradients autograd made as its own tensors (no ``prepare_grads``): copy them
        into a fresh zero ``grad_full`` (zeros where a parameter got none), each dropped once copied."""
        self.grad_full = torch.zeros(self.size, dtype=self.full.dtype, device=self.full.device)
        for p in self.params:
            if p.grad is not None:
                off = self.offsets[id(p)]
                self.grad_full[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None

    def reduce_grads(self) -> None:
        """Average ``grad_full`` over the axis, reduce-scatter it in place (async) and drop the
        parameters' gradient views; ``finish_reduce()`` adds the reduced piece into ``shard.grad``."""
        if self._reducing is not None:  # ZeRO-3 settles a chunk (through its copies, when on the host) first
            raise RuntimeError(f"chunk {self.name}: its previous reduce-scatter was never settled")
        if self.grad_full is None:  # autograd's own tensors (or none: a gradient of zeros everywhere)
            self.collect_grads()
        assert self.grad_full is not None  # prepare_grads or collect_grads made it
        flat, r, k = self.grad_full.float(), self.rank, self.piece  # reduced in fp32 (a copy of 16-bit gradients)
        for p in self.params:
            p.grad = None
        self.grad_full = None
        if self.divisor != 1:
            flat.div_(self.divisor)
        pending = comm.reduce_scatter_into(flat[r * k:(r + 1) * k], flat, self.mesh, self.axis, async_op=True,
                                           tag=f"zero3 grads {self.name}")
        self._reducing = (pending, flat)

    def finish_reduce(self, copies=None) -> None:
        """Add the reduced piece into the shard's gradient. ``copies`` (``colab_kit.zero.copies.Copies``):
        the gradient lives on the host; the piece goes there through them (on a GPU, a side stream), and
        the gradient is read only after ``copies.drain()``."""
        if self._reducing is not None:
            pending, flat = self._reducing
            pending.wait()
            piece = flat[self.rank * self.piece:(self.rank + 1) * self.piece]  # fp32; the shard's gradient may be
            grad = self.shard_grad()
            if copies is not None:  # rounded on the device, as below, then copied or added on the host
                copies.to_host(piece if piece.dtype == grad.dtype else piece.to(grad.dtype), grad, add=not self.fresh)
            elif self.fresh:  # 16-bit. The step's first reduction: a converting copy (0 + x is x)
                grad.copy_(piece)
            else:  # later microbatches: rounded first, then added, as one process accumulates 16-bit gradients
                grad.add_(piece.to(grad.device, grad.dtype))
            self._reducing, self.fresh = None, False

    def shard_grad(self) -> torch.Tensor:
        """The shard's gradient: made with the shard, never set to None (released as zero bytes instead)."""
        grad = self.shard.grad
        assert grad is not None
        return grad

    def grad_bytes(self) -> int:
        """Gradient bytes held now: this rank's reduced piece (unless released for the step), plus the
        whole-chunk buffer while it exists, plus autograd's own gradients of a chunk that collects them."""
        held = self.shard_grad().untyped_storage().nbytes()
        for t in (self.grad_full, self._reducing[1] if self._reducing else None):
            if t is not None:
                held += t.numel() * t.element_size()
        if self.grad_full is None:
            held += sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        return held

    def __repr__(self) -> str:
        return f"Chunk({self.index}, {self.name!r}, {self.numel} elements, piece {self.piece}, {self.state})"
