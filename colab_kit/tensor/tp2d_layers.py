"""SUMMA matrix products and the 2D / 2.5D layers built on them (see ``tp2d`` for the plan).

Every product works on one q x q grid of the mesh (one depth layer in 2.5D): the
rank at grid row ``i`` (its ``tp_row`` coordinate) and column ``j`` (``tp_col``)
holds block ``(i, j)`` of each matrix. ``groups("tp_col")`` of rank (i, j) is its
grid row {(i, *)}, ``groups("tp_row")`` its grid column {(*, j)}. Three products,
as in Optimus (Xu et al., arXiv 2104.05343, Algorithms 1-3), each a loop of q steps:

==========  ==================  ===============================  ==============================
product     block computed      step k broadcasts                then
==========  ==================  ===============================  ==============================
C = A B     C[i,j] on (i,j)     A[i,k] over tp_col (from (i,k)),  add A[i,k] B[k,j]
                                B[k,j] over tp_row (from (k,j))
C = A B^T   C[i,k] on (i,k)     B[k,j] over tp_row (from (k,j))   reduce A[i,j] B[k,j]^T over
                                                                  tp_col onto (i,k)
C = A^T B   C[k,j] on (k,j)     A[i,k] over tp_col (from (i,k))   reduce A[i,k]^T B[i,j] over
                                                                  tp_row onto (k,j)
==========  ==================  ===============================  ==============================

Worked example, q=2, C = A B on rank 1 = (row 0, col 1)::

    k=0: gets A[0,0] from rank 0 (tp_col); B[0,1] is its own block, so it sends it to
         rank 3 (tp_row); adds A[0,0] B[0,1]
    k=1: sends A[0,1] to rank 0 (tp_col); gets B[1,1] from rank 3 (tp_row);
         adds A[0,1] B[1,1]
    -> C[0,1] = A[0,0] B[0,1] + A[0,1] B[1,1]

The backward of each product is two of the others (the ``SUMMA_*`` autograd functions).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import Axis
from .. import comm
from ..sharded_init import cut
from ..placement import declare
from .tp1d import local_lookup
from .tp3d_layers import ReduceScatter3D

__all__ = ["summa_ab", "summa_abt", "summa_atb", "SUMMA_AB", "SUMMA_ABT", "SUMMA_ATB",
           "Linear2D", "LayerNorm2D", "Embedding2D", "VocabEmbedding2D", "batch_axes_of", "depth_axes_of"]


def batch_axes_of(mesh) -> tuple[str, ...]:
    """Axes that split the batch: ("tp_dep", "tp_row") in 2.5D, ("tp_row",) in 2D."""
    return (Axis.TP_DEP, Axis.TP_ROW) if mesh.config.tp_mode == "2.5d" else (Axis.TP_ROW,)


def depth_axes_of(mesh) -> tuple[str, ...]:
    """Axes over which weights are replicated: ("tp_dep",) in 2.5D, none in 2D."""
    return (Axis.TP_DEP,) if mesh.config.tp_mode == "2.5d" else ()


def _from(block: torch.Tensor, mesh, axis: str, src: int, tag: str) -> torch.Tensor:
    """``block`` of the rank at ``src`` on ``axis``, broadcast to the whole group."""
    buf = block if mesh.rank(axis) == src else torch.empty_like(block)
    return comm.broadcast(buf, mesh, axis, src, tag=tag)


# --------------------------------------------------------------------------- the three products
def summa_ab(a: torch.Tensor, b: torch.Tensor, mesh) -> torch.Tensor:
    """C = A B: A [m, n] and B [n, p] in blocks; returns this rank's block of C [m, p]."""
    a, b = a.detach().contiguous(), b.detach().contiguous()
    c = None
    for k in range(mesh.size(Axis.TP_COL)):
        a_k = _from(a, mesh, Axis.TP_COL, k, "SUMMA A")
        b_k = _from(b, mesh, Axis.TP_ROW, k, "SUMMA B")
        c = a_k @ b_k if c is None else c.addmm_(a_k, b_k)
    assert c is not None  # tp_col has at least one rank
    return c


def summa_abt(a: torch.Tensor, b: torch.Tensor, mesh) -> torch.Tensor:
    """C = A B^T: A [m, n] and B [p, n] in blocks; returns this rank's block of C [m, p]."""
    a, b = a.detach().contiguous(), b.detach().contiguous()
    c = None
    for k in range(mesh.size(Axis.TP_ROW)):
        part = a @ _from(b, mesh, Axis.TP_ROW, k, "SUMMA B").t()
        comm.reduce(part, mesh, Axis.TP_COL, dst=k, tag="SUMMA C")
        if mesh.rank(Axis.TP_COL) == k:
            c = part
    assert c is not None  # this rank's tp_col coordinate is one of the k
    return c


def summa_atb(a: torch.Tensor, b: torch.Tensor, mesh) -> torch.Tensor:
    """C = A^T B: A [m, n] and B [m, p] in blocks; returns this rank's block of C [n, p]."""
    a, b = a.detach().contiguous(), b.detach().contiguous()
    c = None
    for k in range(mesh.size(Axis.TP_COL)):
        part = _from(a, mesh, Axis.TP_COL, k, "SUMMA A").t() @ b
        comm.reduce(part, mesh, Axis.TP_ROW, dst=k, tag="SUMMA C")
        if mesh.rank(Axis.TP_ROW) == k:
            c = part
    assert c is not None  # this rank's tp_row coordinate is one of the k
    return c


class SUMMA_AB(torch.autograd.Function):
    """Optimus's C = A B; backward dA = dC B^T (``summa_abt``), dB = A^T dC (``summa_atb``)."""

    @staticmethod
    def forward(ctx, a, b, mesh):
        ctx.save_for_backward(a, b)
        ctx.mesh = mesh
        return summa_ab(a, b, mesh)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        da = summa_abt(grad, b, ctx.mesh) if ctx.needs_input_grad[0] else None
        db = summa_atb(a, grad, ctx.mesh) if ctx.needs_input_grad[1] else None
        return da, db, None


class SUMMA_ABT(torch.autograd.Function):
    """Optimus's C = A B^T; backward dA = dC B (``summa_ab``), dB = dC^T A (``summa_atb``)."""

    @staticmethod
    def forward(ctx, a, b, mesh):
        ctx.save_for_backward(a, b)
        ctx.mesh = mesh
        return summa_abt(a, b, mesh)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        da = summa_ab(grad, b, ctx.mesh) if ctx.needs_input_grad[0] else None
        db = summa_atb(grad, a, ctx.mesh) if ctx.needs_input_grad[1] else None
        return da, db, None


class SUMMA_ATB(torch.autograd.Function):
    """Optimus's C = A^T B; backward dA = B dC^T (``summa_abt``), dB = A dC (``summa_ab``)."""

    @staticmethod
    def forward(ctx, a, b, mesh):
        ctx.save_for_backward(a, b)
        ctx.mesh = mesh
        return summa_atb(a, b, mesh)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        da = summa_abt(b, grad, ctx.mesh) if ctx.needs_input_grad[0] else None
        db = summa_ab(a, grad, ctx.mesh) if ctx.needs_input_grad[1] else None
        return da, db, None


class RowSum(torch.autograd.Function):
    """Sum over the grid row (tp_col) both ways: every rank's output is the total, so each
    input's gradient is the sum of every rank's output gradient."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return comm.all_reduce(x.contiguous().clone(), mesh, Axis.TP_COL, tag="row sum forward")

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous().clone(), ctx.mesh, Axis.TP_COL, tag="row sum backward"), None


# --------------------------------------------------------------------------- layers
def _block(t: torch.Tensor, q: int, i: int, j: int | None = None, transposed: bool = False) -> torch.Tensor:
    """Block i of dim 0 (and j of dim 1) of ``t``'s dense value (``colab_kit.sharded_init``), as a fresh
    contiguous tensor (``sharded_init.cut``); ``transposed``: the blocks of ``t.T`` (a weight in ``[in, out]``)."""
    def block(d):
        d = (d.t() if transposed else d).chunk(q, 0)[i]
        return d if j is None else d.chunk(q, 1)[j]
    return cut(t, block)


def _gather_cols(t: torch.Tensor, mesh) -> torch.Tensor:
    return comm.all_gather(t.detach(), mesh, Axis.TP_COL, dim=t.dim() - 1, tag="to_dense")


class Linear2D(nn.Module):
    """``y = x W + b`` with SUMMA; W = dense.weight.T [in, out] in q x q blocks.

    ``weight`` is this rank's block W[i, j] (shape [in/q, out/q], the paper's
    orientation, not nn.Linear's), the same on every depth layer, so its gradient is
    summed over tp_dep in ``sync_grads``. ``bias`` is b's block j of the output
    columns, the same on every grid row and depth layer: each rank adds it to its own
    rows and its gradient is summed over the batch axes in ``sync_grads``.

    tp=4 (q=2), nn.Linear(8, 12): rank (i, j) takes x[rows of batch block i, 4j:4j+4],
    holds W[4i:4i+4, 6j:6j+6] = dense.weight[6j:6j+6, 4i:4i+4].T and b[6j:6j+6],
    returns y[rows of batch block i, 6j:6j+6].
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mesh):
        super().__init__()
        self.mesh = mesh
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        declare(self, "weight", {1: Axis.TP_ROW, 0: Axis.TP_COL}, depth_axes_of(mesh), transposed=True)
        declare(self, "bias", {0: Axis.TP_COL}, batch_axes_of(mesh))

    @classmethod
    def from_dense(cls, dense: nn.Linear, mesh) -> Linear2D:
        q, i, j = mesh.size(Axis.TP_COL), mesh.rank(Axis.TP_ROW), mesh.rank(Axis.TP_COL)
        bias = _block(dense.bias, q, j) if dense.bias is not None else None
        return cls(_block(dense.weight, q, i, j, transposed=True), bias, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = SUMMA_AB.apply(x.reshape(-1, x.shape[-1]), self.weight, self.mesh)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y + self.bias if self.bias is not None else y

    def to_dense(self) -> nn.Linear:
        w = comm.all_gather(_gather_cols(self.weight, self.mesh), self.mesh, Axis.TP_ROW, dim=0, tag="to_dense")
        dense = nn.Linear(w.shape[0], w.shape[1], bias=self.bias is not None)
        with torch.no_grad():
            dense.weight.copy_(w.t())
            if self.bias is not None:
                dense.bias.copy_(_gather_cols(self.bias, self.mesh))
        return dense


class LayerNorm2D(nn.Module):
    """LayerNorm over a hidden dim split by tp_col: mean and variance are sums over the grid row.

    tp=4 (q=2), nn.LayerNorm(8): rank (i, j) takes x[rows of block i, 4j:4j+4], all-reduces
    sum(x) and then sum((x - mean)^2) of its rows over {(i, 0), (i, 1)}, and holds
    weight[4j:4j+4], bias[4j:4j+4] (same on every grid row and depth layer: gradients
    summed over the batch axes in ``sync_grads``). Backward: the two sums, reversed.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float, mesh):
        super().__init__()
        self.mesh, self.eps = mesh, eps
        self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)
        declare(self, "weight", {0: Axis.TP_COL}, batch_axes_of(mesh))
        declare(self, "bias", {0: Axis.TP_COL}, batch_axes_of(mesh))

    @classmethod
    def from_dense(cls, dense: nn.LayerNorm, mesh) -> LayerNorm2D:
        if len(dense.normalized_shape) != 1 or dense.weight is None or dense.bias is None:
            raise ValueError("LayerNorm2D shards a LayerNorm over one dim with weight and bias")
        q, j = mesh.size(Axis.TP_COL), mesh.rank(Axis.TP_COL)
        return cls(_block(dense.weight, q, j), _block(dense.bias, q, j), dense.eps, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1] * self.mesh.size(Axis.TP_COL)
        mean = RowSum.apply(x.sum(-1, keepdim=True), self.mesh) / width
        centred = x - mean
        var = RowSum.apply((centred * centred).sum(-1, keepdim=True), self.mesh) / width
        return centred * torch.rsqrt(var + self.eps) * self.weight + self.bias

    def to_dense(self) -> nn.LayerNorm:
        w, b = _gather_cols(self.weight, self.mesh), _gather_cols(self.bias, self.mesh)
        dense = nn.LayerNorm(w.shape[0], eps=self.eps)
        with torch.no_grad():
            dense.weight.copy_(w)
            dense.bias.copy_(b)
        return dense


class Embedding2D(nn.Module):
    """Embedding table split by hidden column: rank (i, j) holds table[:, block j].

    The lookup needs no communication: each rank looks its own rows' ids up in its
    column block, giving the activation layout directly. The block is the same on every
    grid row and depth layer, so its gradient is summed over the batch axes in
    ``sync_grads``. (Colossal-AI's Embedding2D instead stores V x h/q^2 and all-gathers
    it over the grid column each step: less memory, more traffic.)

    tp=4 (q=2), nn.Embedding(64, 8): ranks (0, 0) and (1, 0) hold table[:, 0:4],
    ranks (0, 1) and (1, 1) hold table[:, 4:8]; rank (i, j) returns
    table[ids of batch block i, 4j:4j+4].
    """

    def __init__(self, weight: torch.Tensor, mesh):
        super().__init__()
        self.mesh = mesh
        self.weight = nn.Parameter(weight)
        declare(self, "weight", {1: Axis.TP_COL}, batch_axes_of(mesh))

    @classmethod
    def from_dense(cls, dense: nn.Embedding, mesh) -> Embedding2D:
        q, j = mesh.size(Axis.TP_COL), mesh.rank(Axis.TP_COL)
        return cls(cut(dense.weight, lambda d: d.t().chunk(q, 0)[j].t()), mesh)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def to_dense(self) -> nn.Embedding:
        w = _gather_cols(self.weight, self.mesh)
        dense = nn.Embedding(*w.shape)
        with torch.no_grad():
            dense.weight.copy_(w)
        return dense


class VocabEmbedding2D(nn.Module):
    """The token table the paper's way: vocabulary split over tp_row, hidden over tp_col, so rank
    (i, j) holds ``table[V/q block i, h/q block j]`` (``V/q x h/q``, a 1/q^2 share; the same on
    every 2.5D depth layer, whose gradients are summed over tp_dep).

    A grid row's batch rows need every vocabulary block, so the lookup goes round the grid
    column: all-gather the token ids over tp_row (integers, cheap), look them all up in this
    rank's vocabulary block (zero where a token lives elsewhere), and reduce-scatter the partial
    rows over tp_row, which sums the blocks and hands each grid row back its own batch rows.
    Backward: the reduce-scatter's all-gather, then a local embedding gradient.

    tp=4 (q=2), nn.Embedding(64, 8), 4 batch rows: rank (1, 0) holds table[32:64, 0:4];
    it gathers the ids of rows 0..3, fills the entries of ids >= 32 from its block, and after
    the reduce-scatter over {(0, 0), (1, 0)} returns table[ids of rows 2..3, 0:4].
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, mesh, padding_idx: int | None = None):
        super().__init__()
        self.mesh, self.vocab_start, self.padding_idx = mesh, vocab_start, padding_idx
        self.weight = nn.Parameter(weight)
        declare(self, "weight", {0: Axis.TP_ROW, 1: Axis.TP_COL}, depth_axes_of(mesh))

    @classmethod
    def from_dense(cls, dense: nn.Embedding, mesh) -> VocabEmbedding2D:
        q, i, j = mesh.size(Axis.TP_COL), mesh.rank(Axis.TP_ROW), mesh.rank(Axis.TP_COL)
        block = _block(dense.weight, q, i, j)
        return cls(block, i * block.shape[0], mesh, dense.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:

        every = comm.all_gather(ids.contiguous(), self.mesh, Axis.TP_ROW, dim=0, tag="2d token ids")
        partial = local_lookup(every, self.weight, self.vocab_start, self.padding_idx)
        return ReduceScatter3D.apply(partial, self.mesh, Axis.TP_ROW)

    def to_dense(self) -> nn.Embedding:
        w = comm.all_gather(_gather_cols(self.weight, self.mesh), self.mesh, Axis.TP_ROW, dim=0, tag="to_dense")
        dense = nn.Embedding(*w.shape)
        with torch.no_grad():
            dense.weight.copy_(w)
        return dense


class InputLinear2D(Linear2D):
    """A Linear on the raw input (ViT's patch embedding): the input arrives whole in its features
    (rows already split over the batch axes), so each rank takes its feature block j and runs the
    SUMMA of ``Linear2D``. The input needs no gradient, so the slice costs nothing backward.

    tp=4 (q=2), patches of 4 values, nn.Linear(4, 8): rank (i, j) takes patches[rows of block i,
    2j:2j+2] and returns y[rows of block i, 4j:4j+4].
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, j = self.mesh.size(Axis.TP_COL), self.mesh.rank(Axis.TP_COL)
        return super().forward(x.chunk(q, dim=-1)[j])


class TiedHead2D(nn.Module):
    """An output layer whose weight is the token table (``tied`` in the policy): ``x table^T + b``.

    The table is held as ``VocabEmbedding2D`` holds it, block (i, j) = ``table[V/q block i, h/q block
    j]``, which is B of ``C = A B^T`` with A = x (rows block i, hidden block j): SUMMA's A B^T gives
    rank (i, k) logits of rows block i and vocabulary block k, the layout the vocab-parallel loss
    reads. One parameter, two uses: its gradient gets both. The bias block k is shared by the grid
    rows (its gradient summed over the batch axes).
    """

    def __init__(self, table: nn.Module, bias: torch.Tensor | None, mesh):
        super().__init__()
        self.mesh = mesh
        self.weight = table.weight  # the table's own parameter, registered here too (a pipeline's last stage)
        q, j = mesh.size(Axis.TP_COL), mesh.rank(Axis.TP_COL)
        self.bias = nn.Parameter(_block(bias, q, j)) if bias is not None else None
        declare(self, "weight", {0: Axis.TP_ROW, 1: Axis.TP_COL}, depth_axes_of(mesh))  # the table's, as it declared
        declare(self, "bias", {0: Axis.TP_COL}, batch_axes_of(mesh))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = SUMMA_ABT.apply(x.reshape(-1, x.shape[-1]), self.weight, self.mesh)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y + self.bias if self.bias is not None else y


class RMSNorm2D(nn.Module):
    """RMSNorm over a hidden dim split by tp_col (Llama's, statistics in fp32): the mean square is a
    sum over the grid row. Rank (i, j) holds weight block j (the same on every grid row and depth
    layer: its gradient summed over the batch axes in ``sync_grads``).
    """

    def __init__(self, weight: torch.Tensor, eps: float, mesh):
        super().__init__()
        self.mesh, self.eps = mesh, eps
        self.weight = nn.Parameter(weight)
        declare(self, "weight", {0: Axis.TP_COL}, batch_axes_of(mesh))

    @classmethod
    def from_dense(cls, dense: nn.Module, mesh) -> RMSNorm2D:
        eps = getattr(dense, "variance_epsilon", None)
        eps = getattr(dense, "eps", None) if eps is None else eps
        q, j = mesh.size(Axis.TP_COL), mesh.rank(Axis.TP_COL)
        assert isinstance(dense.weight, torch.Tensor)  # an RMSNorm's weight
        return cls(_block(dense.weight, q, j), 1e-6 if eps is None else eps, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, width = x.dtype, x.shape[-1] * self.mesh.size(Axis.TP_COL)
        x = x.to(torch.float32)
        mean_sq = RowSum.apply(x.pow(2).sum(-1, keepdim=True), self.mesh) / width
        return self.weight * (x * torch.rsqrt(mean_sq + self.eps)).to(dtype)
