"""Layers of 3D tensor parallelism (Bian et al. 2021, arXiv 2105.14450); see ``tp3d`` for the layout.

The ``q**3`` ranks of the tensor block form a cube with axes ``tp_in``, ``tp_wt``
and ``tp_out``. An activation ``[b, t, h]`` is never replicated inside the cube:
its batch rows are split over ``tp_wt`` and one of ``tp_in`` / ``tp_out``, its
hidden features over the other one. ``local_block`` names the piece a rank holds::

    local_block(x, mesh, rows=("tp_wt", "tp_in"), hidden="tp_out")
    # rows chunk tp_wt, then chunk tp_in; hidden chunk tp_out  ->  [b/q^2, t, h/q]

Every collective goes through ``colab_kit.comm`` with its axis name, so the log
shows which side of the cube each one ran on.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..config import Axis
from ..sharded_init import cut
from ..placement import declare
from .tp1d import local_lookup

__all__ = ["WT", "other_axis", "local_block", "Matmul3D", "AllReduce3D", "ReduceScatter3D", "SwapInOut3D",
           "Linear3D", "DenseLinear3D", "TiedHead3D", "LayerNorm3D", "RMSNorm3D", "VocabEmbedding3D", "Embedding3D"]

WT = Axis.TP_WT  # the weight axis: it never changes role


def other_axis(axis: str) -> str:
    """``tp_in`` <-> ``tp_out``: consecutive layers swap the two (Colossal-AI's swap of in/out groups)."""
    swap: dict[str, str] = {Axis.TP_IN: Axis.TP_OUT, Axis.TP_OUT: Axis.TP_IN}
    return swap[axis]


def _chunk(t: torch.Tensor, mesh, axis: str, dim: int) -> torch.Tensor:
    return t.chunk(mesh.size(axis), dim=dim)[mesh.rank(axis)]


def local_block(full: torch.Tensor, mesh, rows: tuple[str, ...], hidden: str | None) -> torch.Tensor:
    """This rank's piece of a whole activation (no communication): dim 0 split over ``rows``
    (slowest axis first), the last dim over ``hidden`` (None: kept whole)."""
    for axis in rows:
        full = _chunk(full, mesh, axis, 0)
    if hidden is not None:
        full = _chunk(full, mesh, hidden, -1)
    return full.contiguous()


# --------------------------------------------------------------------------- autograd functions

class Matmul3D(torch.autograd.Function):
    """The paper's 3-D matrix multiplication ``Y = X W^T`` on the cube.

    With ``a`` = ``in_axis`` and ``c`` = ``out_axis`` (``tp_in``/``tp_out`` in either order)
    and ``W [out_f, in_f]`` in PyTorch's order, rank (a, w, c) holds::

        X  [b/q^2, t, in_f/q]   rows block (w, a), features block c
        W  [out_f/q, in_f/q^2]  rows block a, columns block (c, w)

    forward:   X^ = all_gather(X, a)          [b/q, t, in_f/q]     rows block w
               W^ = all_gather(W, tp_wt)      [out_f/q, in_f/q]
               Y  = reduce_scatter(X^ W^T, c) [b/q^2, t, out_f/q]  rows block (w, c), features block a
    backward:  dY^ = all_gather(dY, c)
               dX  = reduce_scatter(dY^ W^, a)
               dW  = reduce_scatter(dY^T X^, tp_wt)   (sums the row blocks w that shared W^)

    The output's layout is the input's with ``a`` and ``c`` swapped, which is what the next
    layer (built with the axes swapped) takes. X^ and W^ are kept for backward.
    """

    @staticmethod
    def forward(ctx, x, weight, mesh, in_axis, out_axis, weight_dim=1):
        """``weight_dim``: the dim of ``weight`` split over tp_wt (1: a Linear's input features; 0: the
        token table's vocabulary, for a head tied to it, ``TiedHead3D``)."""
        ctx.mesh, ctx.in_axis, ctx.out_axis, ctx.weight_dim = mesh, in_axis, out_axis, weight_dim
        x_hat = comm.all_gather(x, mesh, in_axis, 0, tag="3d input")
        w_hat = comm.all_gather(weight, mesh, WT, weight_dim, tag="3d weight")
        ctx.save_for_backward(x_hat, w_hat)
        return comm.reduce_scatter(F.linear(x_hat, w_hat), mesh, out_axis, 0, tag="3d output")

    @staticmethod
    def backward(ctx, grad):
        x_hat, w_hat = ctx.saved_tensors
        mesh = ctx.mesh
        g_hat = comm.all_gather(grad.contiguous(), mesh, ctx.out_axis, 0, tag="3d output grad")
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = comm.reduce_scatter(g_hat @ w_hat, mesh, ctx.in_axis, 0, tag="3d input grad")
        if ctx.needs_input_grad[1]:
            dw_hat = g_hat.reshape(-1, g_hat.shape[-1]).t() @ x_hat.reshape(-1, x_hat.shape[-1])
            dw = comm.reduce_scatter(dw_hat, mesh, WT, ctx.weight_dim, tag="3d weight grad")
        return dx, dw, None, None, None, None


class AllReduce3D(torch.autograd.Function):
    """Sum over ``axis`` forward, and sum of the gradients backward: every rank of the group
    uses the total, so each partial's gradient is the sum of theirs (LayerNorm statistics)."""

    @staticmethod
    def forward(ctx, x, mesh, axis):
        ctx.mesh, ctx.axis = mesh, axis
        return comm.all_reduce(x.contiguous().clone(), mesh, axis, tag="3d stats")

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous().clone(), ctx.mesh, ctx.axis, tag="3d stats grad"), None, None


class ReduceScatter3D(torch.autograd.Function):
    """Sum over ``axis`` keeping this rank's rows (dim 0) forward; all-gather of the rows backward."""

    @staticmethod
    def forward(ctx, x, mesh, axis):
        ctx.mesh, ctx.axis = mesh, axis
        return comm.reduce_scatter(x.contiguous(), mesh, axis, 0, tag="3d rows")

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad.contiguous(), ctx.mesh, ctx.axis, 0, tag="3d rows grad"), None, None


# --------------------------------------------------------------------------- layers

class Linear3D(nn.Module):
    """``nn.Linear`` on the cube: ``Matmul3D`` plus a bias split like the output features.

    Takes rows over (tp_wt, ``in_axis``) and features over ``out_axis``; gives rows over
    (tp_wt, ``out_axis``) and features over ``in_axis``. The bias ``[out_f/q]`` (block
    ``in_axis``) is shared by the q*q row blocks of (tp_wt, ``out_axis``), so its gradient
    is summed over those axes (``Partial()`` there, ``colab_kit.placement``); the weight's is complete after backward.

    tp=8 (q=2), ``Linear(32, 128)`` with in_axis=tp_in, out_axis=tp_out; rank 6 is
    (in 1, wt 1, out 0)::

        weight [64, 8]: dense rows 64..127 (in 1), columns 8..15 (block out*q + wt = 1)
        bias   [64]:    dense 64..127
        x [2, t, 16] rows 6..7 of 8, features 0..15  ->  y [2, t, 64] rows 4..5, features 64..127
    """

    def __init__(self, weight, bias, mesh, in_axis: str = Axis.TP_IN, out_axis: str = Axis.TP_OUT):
        super().__init__()
        self.mesh, self.in_axis, self.out_axis = mesh, in_axis, out_axis
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        declare(self, "weight", {0: in_axis, 1: (out_axis, WT)})
        declare(self, "bias", {0: in_axis}, (WT, out_axis))

    @classmethod
    def from_dense(cls, dense: nn.Linear, mesh, in_axis: str = Axis.TP_IN, out_axis: str = Axis.TP_OUT) -> Linear3D:
        q = mesh.size(WT)
        # a meta weight is made here (colab_kit.sharded_init)
        a, b_ = mesh.rank(in_axis), mesh.rank(out_axis) * q + mesh.rank(WT)
        w = cut(dense.weight, lambda d: d.chunk(q, 0)[a].chunk(q * q, 1)[b_])
        b = cut(dense.bias, lambda d: _chunk(d, mesh, in_axis, 0)) if dense.bias is not None else None
        return cls(w, b, mesh, in_axis, out_axis)

    def forward(self, x):
        y = Matmul3D.apply(x, self.weight, self.mesh, self.in_axis, self.out_axis)
        return y + self.bias if self.bias is not None else y

    def to_dense(self) -> nn.Linear:
        """Collective over the cube: the whole ``nn.Linear``."""
        mesh, tag = self.mesh, "to_dense"
        w = comm.all_gather(self.weight.detach(), mesh, WT, 1, tag=tag)
        w = comm.all_gather(w, mesh, self.out_axis, 1, tag=tag)
        w = comm.all_gather(w, mesh, self.in_axis, 0, tag=tag)
        dense = nn.Linear(w.shape[1], w.shape[0], bias=self.bias is not None)
        with torch.no_grad():
            dense.weight.copy_(w)
            if self.bias is not None:
                dense.bias.copy_(comm.all_gather(self.bias.detach(), mesh, self.in_axis, 0, tag=tag))
        return dense


class LayerNorm3D(nn.Module):
    """LayerNorm over hidden features split over ``axis``: mean and variance from two all-reduces.

    Rows are split over (tp_wt, the other of tp_in/tp_out), which share the ``[h/q]`` slices of
    weight and bias: their gradients are summed over those two axes. tp=8 (q=2), h=32,
    axis=tp_out: rank 6 (out 0) holds weight[0:16]; ``sum x`` and ``sum (x - mean)^2`` of
    its 16 features are all-reduced with rank 7's (out 1), then divided by 32.
    """

    def __init__(self, weight, bias, eps: float, hidden: int, mesh, axis: str = Axis.TP_OUT):
        super().__init__()
        self.mesh, self.axis, self.eps, self.hidden = mesh, axis, eps, hidden
        self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)
        declare(self, "weight", {0: axis}, (WT, other_axis(axis)))
        declare(self, "bias", {0: axis}, (WT, other_axis(axis)))

    @classmethod
    def from_dense(cls, dense: nn.LayerNorm, mesh, axis: str = Axis.TP_OUT) -> LayerNorm3D:
        if dense.weight is None or dense.bias is None or len(dense.normalized_shape) != 1:
            raise ValueError("LayerNorm3D shards a LayerNorm over the last dim with weight and bias")

        def part(t):
            return cut(t, lambda d: _chunk(d, mesh, axis, 0))

        return cls(part(dense.weight), part(dense.bias), dense.eps, dense.normalized_shape[0], mesh, axis)

    def forward(self, x):
        mean = AllReduce3D.apply(x.sum(-1, keepdim=True), self.mesh, self.axis) / self.hidden
        centred = x - mean
        var = AllReduce3D.apply(centred.pow(2).sum(-1, keepdim=True), self.mesh, self.axis) / self.hidden
        return centred * torch.rsqrt(var + self.eps) * self.weight + self.bias

    def to_dense(self) -> nn.LayerNorm:
        dense = nn.LayerNorm(self.hidden, eps=self.eps)
        with torch.no_grad():
            dense.weight.copy_(comm.all_gather(self.weight.detach(), self.mesh, self.axis, 0, tag="to_dense"))
            dense.bias.copy_(comm.all_gather(self.bias.detach(), self.mesh, self.axis, 0, tag="to_dense"))
        return dense


class VocabEmbedding3D(nn.Module):
    """Token embedding the paper's way: table ``[V/q^2, h/q]``, the vocabulary split over
    (``vocab_axis``, tp_wt), the hidden size over the other cube axis (``hidden_axis``).

    Tokens arrive with rows over (tp_wt, ``hidden_axis``) and leave as activations with rows
    over (tp_wt, ``vocab_axis``), features over ``hidden_axis``. Every vocabulary slice is
    needed by every row, so the token ids (integers, cheap) are all-gathered over
    ``hidden_axis`` and then tp_wt: each rank looks the whole local batch up in its slice
    (zeros elsewhere), and two reduce-scatters, over tp_wt and then ``vocab_axis``, sum the
    q^2 slices and hand each rank its rows. Backward: the two all-gathers, then a local
    embedding gradient (no copies to sum: each rank owns its slice alone).

    tp=8 (q=2), V=64, h=32, vocab_axis=tp_in, hidden_axis=tp_out; rank 6 (in 1, wt 1, out 0),
    vocabulary slice in*q + wt = 3::

        table [16, 16]: tokens 48..63, features 0..15
        tokens rows 4..5 -> gathered over tp_out (rows 4..7), then tp_wt (rows 0..7)
        partial [8, t, 16] -> reduce-scatter over tp_wt: rows 4..7 -> over tp_in: rows 6..7
    """

    def __init__(self, weight, vocab_start: int, mesh, vocab_axis: str = Axis.TP_IN, padding_idx: int | None = None):
        super().__init__()
        self.mesh, self.vocab_axis, self.hidden_axis = mesh, vocab_axis, other_axis(vocab_axis)
        self.vocab_start, self.padding_idx = vocab_start, padding_idx
        self.weight = nn.Parameter(weight)
        declare(self, "weight", {0: (vocab_axis, WT), 1: self.hidden_axis})

    @classmethod
    def from_dense(cls, dense: nn.Embedding, mesh, vocab_axis: str = Axis.TP_IN) -> VocabEmbedding3D:
        q = mesh.size(WT)
        slice_ = mesh.rank(vocab_axis) * q + mesh.rank(WT)
        part = cut(dense.weight, lambda d: _chunk(d.chunk(q * q, 0)[slice_], mesh, other_axis(vocab_axis), 1))
        return cls(part, slice_ * part.shape[0], mesh, vocab_axis, dense.padding_idx)

    def forward(self, tokens):
        tokens = comm.all_gather(tokens, self.mesh, self.hidden_axis, 0, tag="3d tokens")
        tokens = comm.all_gather(tokens, self.mesh, WT, 0, tag="3d tokens")
        rows = local_lookup(tokens, self.weight, self.vocab_start, self.padding_idx)
        return ReduceScatter3D.apply(ReduceScatter3D.apply(rows, self.mesh, WT), self.mesh, self.vocab_axis)

    def to_dense(self) -> nn.Embedding:
        w = comm.all_gather(self.weight.detach(), self.mesh, self.hidden_axis, 1, tag="to_dense")
        w = comm.all_gather(w, self.mesh, WT, 0, tag="to_dense")
        w = comm.all_gather(w, self.mesh, self.vocab_axis, 0, tag="to_dense")
        dense = nn.Embedding(*w.shape)
        with torch.no_grad():
            dense.weight.copy_(w)
        return dense


class Embedding3D(nn.Module):
    """Embedding for ids every rank holds whole (positions): table ``[n, h/q]`` split over
    ``axis``; the output ``[..., h/q]`` broadcasts onto activations whose rows are split over
    (tp_wt, the other axis), which sum the gradient of the shared slice.

    tp=8 (q=2), seq 16, h=32, axis=tp_out: rank 6 (out 0) holds table[:, 0:16].
    """

    def __init__(self, weight, mesh, axis: str = Axis.TP_OUT):
        super().__init__()
        self.mesh, self.axis = mesh, axis
        self.weight = nn.Parameter(weight)
        declare(self, "weight", {1: axis}, (WT, other_axis(axis)))

    @classmethod
    def from_dense(cls, dense: nn.Embedding, mesh, axis: str = Axis.TP_OUT) -> Embedding3D:
        return cls(cut(dense.weight, lambda d: _chunk(d, mesh, axis, 1)), mesh, axis)

    def forward(self, ids):
        return F.embedding(ids, self.weight)

    def to_dense(self) -> nn.Embedding:
        w = comm.all_gather(self.weight.detach(), self.mesh, self.axis, 1, tag="to_dense")
        dense = nn.Embedding(*w.shape)
        with torch.no_grad():
            dense.weight.copy_(w)
        return dense


class InputLinear3D(Linear3D):
    """A Linear on the raw input (ViT's patch embedding). The input's rows arrive split as the batch's
    (over tp_wt and ``in_axis``) and its features whole: each rank takes its block of the features over
    ``out_axis`` (the layout ``Linear3D`` takes) and runs its matmul. No gradient flows to the input.

    tp=8 (q=2), patches of 4 values, in_axis=tp_out, out_axis=tp_in: rank (in 1, wt 0, out 1) takes
    features 2..3 of rows 2..3 and returns rows of the residual layout, features over tp_out.
    """

    def forward(self, x):
        q = self.mesh.size(WT)
        return super().forward(x.chunk(q, dim=-1)[self.mesh.rank(self.out_axis)].contiguous())


class SwapInOut3D(torch.autograd.Function):
    """The inner layout back to the residual one: rank (in a, wt w, out c) holds ``X[rows (w, c), features
    a]`` and returns ``X[rows (w, a), features c]`` (rank (c, w, a)'s block). Done the simple way: all-gather
    the features over tp_in and the rows over tp_out, keep the block; backward the two reduce-scatters of
    the gradient placed in a zero tensor. q^2 blocks on the wire each way, for a layer a BERT has one of.

    tp=8 (q=2), rank (1, 0, 0) of x [b=8 rows, h=32]: holds rows 0-1, features 16-31 -> returns rows 2-3,
    features 0-15."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        whole = comm.all_gather(x.contiguous(), mesh, Axis.TP_IN, x.dim() - 1, tag="3d swap")
        whole = comm.all_gather(whole, mesh, Axis.TP_OUT, 0, tag="3d swap")
        ctx.shape = whole.shape
        q = mesh.size(WT)
        return whole.chunk(q, 0)[mesh.rank(Axis.TP_IN)].chunk(q, -1)[mesh.rank(Axis.TP_OUT)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        mesh, q = ctx.mesh, ctx.mesh.size(WT)
        full = grad.new_zeros(ctx.shape)
        r, c = mesh.rank(Axis.TP_IN), mesh.rank(Axis.TP_OUT)
        rows, cols = ctx.shape[0] // q, ctx.shape[-1] // q
        full[r * rows:(r + 1) * rows, ..., c * cols:(c + 1) * cols] = grad
        g = comm.reduce_scatter(full, mesh, Axis.TP_OUT, 0, tag="3d swap grad")
        return comm.reduce_scatter(g, mesh, Axis.TP_IN, g.dim() - 1, tag="3d swap grad"), None


class DenseLinear3D(Linear3D):
    """A width-keeping Linear on the residual stream (BERT's MLM ``dense``): ``Linear3D`` from the residual
    layout to the inner one, then ``SwapInOut3D`` back, so the LayerNorm after it reads the residual layout."""

    def forward(self, x):
        return SwapInOut3D.apply(super().forward(x), self.mesh)


class TiedHead3D(nn.Module):
    """The LM head whose weight is the token table (``VocabEmbedding3D``'s ``[V/q^2, h/q]`` piece: vocabulary
    over (tp_in, tp_wt), features over tp_out): ``Matmul3D`` gathering the table's vocabulary over tp_wt.
    Takes the residual layout, gives the logits' (rows over (tp_wt, tp_out), vocabulary over tp_in), as the
    untied head does. The bias ``[V/q]`` (block tp_in) is shared by those row blocks: Partial over them."""

    def __init__(self, table: VocabEmbedding3D, bias, mesh):
        super().__init__()
        self.mesh = mesh
        self.weight = table.weight  # the table's own parameter, registered here too (a pipeline's last stage)
        declare(self, "weight", {0: (table.vocab_axis, WT), 1: table.hidden_axis})
        self.bias = None
        if bias is not None:
            self.bias = nn.Parameter(cut(bias, lambda d: _chunk(d, mesh, table.vocab_axis, 0)))
            declare(self, "bias", {0: table.vocab_axis}, (WT, table.hidden_axis))
        self.in_axis, self.out_axis = table.vocab_axis, table.hidden_axis

    def forward(self, x):
        y = Matmul3D.apply(x, self.weight, self.mesh, self.in_axis, self.out_axis, 0)
        return y + self.bias if self.bias is not None else y


class RMSNorm3D(nn.Module):
    """RMSNorm (Llama's, statistics in fp32) over hidden features split over ``axis``: the mean square is one
    all-reduce over ``axis``. The weight ``[h/q]`` is shared by the row blocks of (tp_wt, the other axis):
    Partial over them. tp=8 (q=2), h=32, axis=tp_out: rank 6 (out 0) holds weight[0:16]."""

    def __init__(self, weight, eps: float, hidden: int, mesh, axis: str = Axis.TP_OUT):
        super().__init__()
        self.mesh, self.axis, self.eps, self.hidden = mesh, axis, eps, hidden
        self.weight = nn.Parameter(weight)
        declare(self, "weight", {0: axis}, (WT, other_axis(axis)))

    @classmethod
    def from_dense(cls, dense: nn.Module, mesh, axis: str = Axis.TP_OUT) -> RMSNorm3D:
        eps = getattr(dense, "variance_epsilon", None)
        eps = getattr(dense, "eps", None) if eps is None else eps
        weight = dense.weight
        assert isinstance(weight, torch.Tensor)  # an RMSNorm's weight
        w = cut(weight, lambda d: _chunk(d, mesh, axis, 0))
        return cls(w, 1e-6 if eps is None else eps, weight.shape[0], mesh, axis)

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        mean_sq = AllReduce3D.apply(x.pow(2).sum(-1, keepdim=True), self.mesh, self.axis) / self.hidden
        return self.weight * (x * torch.rsqrt(mean_sq + self.eps)).to(dtype)
