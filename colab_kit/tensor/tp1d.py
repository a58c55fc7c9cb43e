"""1D tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053).

Activations stay whole on every rank of the ``tp`` group; weights are split:

- ``ColumnLinear`` splits the output features (rows of ``W [out, in]``), after
  Megatron's f (identity forward, all-reduce of the input gradient backward);
- ``RowLinear`` splits the input features (columns of ``W``) and sums the partial
  outputs with Megatron's g (all-reduce forward, identity backward);
- ``VocabEmbedding`` splits the vocabulary: each rank looks up the tokens it owns,
  zeros the rest, and g sums the rows;
- the LM head is a ``ColumnLinear`` over the vocabulary whose logits stay split for
  the vocab-parallel cross-entropy.

Worked example, tp=2, d_model=4, n_heads=2, MLP 4 -> 16 -> 4::

    rank 0: qkv rows 0..5 (head 0's q, k, v)   fc1 rows 0..7    fc2 cols 0..7    vocab 0..V/2-1
    rank 1: qkv rows 6..11 (head 1's q, k, v)  fc1 rows 8..15   fc2 cols 8..15   vocab V/2..V-1
    per block forward: 2 all-reduces of [b, t, 4] (attention out, MLP out); backward: 2 more (f at
    the fused qkv's input and at fc1's): 4 per block and step, Megatron's count
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import Axis
from .. import comm
from .zero_bubble import split_linear
from ..sharded_init import cut
from ..placement import declare
from ..policy import get_module
from .plan import TensorPlan, require_divisible

__all__ = ["ColumnLinear", "RowLinear", "VocabEmbedding", "Plan1D", "local_lookup"]


def _slice(t: torch.Tensor, n: int, i: int, dim: int) -> torch.Tensor:
    """Block ``i`` of ``n`` along ``dim`` of ``t``'s dense value (made here if ``t`` is meta:
    ``colab_kit.sharded_init``)."""
    return cut(t, lambda d: d.chunk(n, dim=dim)[i])


class _SplitLinear(nn.Module):
    """A Linear whose weight ``[out, in]`` is split over ``axis`` along ``split_dim``:
    0 (output features, bias split too) or 1 (input features, bias kept whole)."""

    split_dim = 0

    def __init__(self, weight, bias, mesh, axis: str = Axis.TP):
        super().__init__()
        self.mesh, self.axis = mesh, axis
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        declare(self, "weight", {self.split_dim: axis})
        declare(self, "bias", {0: axis} if self.split_dim == 0 else {})

    @classmethod
    def from_dense(cls, dense: nn.Linear, mesh, axis: str = Axis.TP):
        n, i = mesh.size(axis), mesh.rank(axis)
        bias = None
        if dense.bias is not None:
            bias = _slice(dense.bias, n, i, 0) if cls.split_dim == 0 else cut(dense.bias, lambda d: d)
        return cls(_slice(dense.weight, n, i, cls.split_dim), bias, mesh, axis)

    def to_dense(self) -> nn.Linear:
        """The whole layer, gathered from every rank of the group (a collective)."""
        w = comm.all_gather(self.weight.detach(), self.mesh, self.axis, self.split_dim, tag="to_dense")
        dense = nn.Linear(w.shape[1], w.shape[0], bias=self.bias is not None)
        with torch.no_grad():
            dense.weight.copy_(w)
            if self.bias is not None:
                b = self.bias.detach()
                dense.bias.copy_(comm.all_gather(b, self.mesh, self.axis, 0, tag="to_dense")
                                 if self.split_dim == 0 else b)
        return dense


class ColumnLinear(_SplitLinear):
    """``y[..., out/n] = f(x) W_i^T + b_i``: this rank's block of output features."""

    split_dim = 0

    def forward(self, x):
        # split_linear: F.linear whose weight gradient a zero-bubble I pass defers to W
        return split_linear(comm.copy_to_group(x, self.mesh, self.axis), self.weight, self.bias)


class RowLinear(_SplitLinear):
    """``y = g(x[..., in/n] W_i^T) + b``: partial products summed over the group."""

    split_dim = 1

    def forward(self, x):
        y = comm.reduce_from_group(split_linear(x, self.weight), self.mesh, self.axis)
        return y + self.bias if self.bias is not None else y


def local_lookup(tokens: torch.Tensor, weight: torch.Tensor, vocab_start: int, padding_idx: int | None = None):
    """Rows of the tokens this vocabulary slice ``[vocab_start, vocab_start + len(weight))`` owns, zeros for
    the others (their gradient is zero too); the dense table's ``padding_idx`` row, where it falls in this
    slice, gets no gradient, as in ``nn.Embedding``."""
    local = tokens - vocab_start
    n = weight.shape[0]
    mine = (local >= 0) & (local < n)
    pad = None if padding_idx is None or not 0 <= padding_idx - vocab_start < n else padding_idx - vocab_start
    return F.embedding(local.clamp(0, n - 1), weight, padding_idx=pad) * mine.unsqueeze(-1)


class VocabEmbedding(nn.Module):
    """Embedding table split over the vocabulary; the looked-up rows are summed with g."""

    def __init__(self, weight, vocab_start: int, mesh, axis: str = Axis.TP, padding_idx: int | None = None):
        super().__init__()
        self.mesh, self.axis, self.vocab_start = mesh, axis, vocab_start
        self.weight = nn.Parameter(weight)
        declare(self, "weight", {0: axis})
        self.padding_idx = padding_idx
        """The dense table's ``padding_idx`` (its row gets no gradient), or None."""

    @classmethod
    def from_dense(cls, dense: nn.Embedding, mesh, axis: str = Axis.TP) -> VocabEmbedding:
        n, i = mesh.size(axis), mesh.rank(axis)
        part = _slice(dense.weight, n, i, 0)
        return cls(part, i * part.shape[0], mesh, axis, dense.padding_idx)

    def forward(self, tokens):
        return comm.reduce_from_group(self.partial_rows(tokens), self.mesh, self.axis)

    def partial_rows(self, tokens):
        """This rank's share of the looked-up rows: its vocabulary's rows, zeros for the other tokens."""
        return local_lookup(tokens, self.weight, self.vocab_start, self.padding_idx)

    def to_dense(self) -> nn.Embedding:
        w = comm.all_gather(self.weight.detach(), self.mesh, self.axis, 0, tag="to_dense")
        dense = nn.Embedding(*w.shape)
        with torch.no_grad():
            dense.weight.copy_(w)
        return dense


class Plan1D(TensorPlan):
    """Megatron's 1D plan, by role: the token table split by vocabulary, each pair's first Linear by
    output features and second by input features, the head by vocabulary (or classes); positions,
    tables, input and width-keeping Linears and norms stay whole (activations are whole here)."""

    mode = "1d"
    batch_axes = ()
    # the layer class of each role, each with from_dense(dense, mesh)
    LAYERS: dict[str, Any] = {"vocab": VocabEmbedding, "column": ColumnLinear, "row": RowLinear, "head": ColumnLinear}

    @classmethod
    def check(cls, cfg, layout) -> None:
        p = layout.size(Axis.TP)
        heads = (f"; tp={p} does not divide the model's {cfg.n_heads} attention heads: use a tp that divides "
                 f"{cfg.n_heads}") if cfg.n_heads % p else ""
        require_divisible({"n_heads": cfg.n_heads, **cfg.kv, "d_ff": cfg.d_ff, **cfg.outputs, **cfg.tables}, p,
                          f"tp_mode='1d' splits attention heads, the MLP's inner size and the vocabulary "
                          f"over tp={p}: choose sizes that are multiples of {p}, or a tp that divides them{heads}")

    def layer(self, role, path, dense):
        make = self.LAYERS.get(role)
        return make.from_dense(dense, self.mesh) if make is not None else None

    def tie(self, model, table, head, table_path, head_path):
        """The vocabulary-split table and the vocabulary-split head hold the same rows: one parameter."""
        get_module(model, head_path).weight = table.weight


def linear_comm_bytes(rows: int, d_in: int, d_out: int, kind: str, bytes_per_elem: int = 4) -> dict:
    """Payload bytes one rank hands to collectives for one 1D Linear (Megatron-LM, section 3).

    A column-parallel layer all-reduces the input gradient ``[rows, d_in]`` in backward
    (Megatron's f); a row-parallel layer all-reduces its output ``[rows, d_out]`` in
    forward (g). A ring all-reduce moves ``2 (P - 1) / P`` of that payload per rank.

    >>> linear_comm_bytes(rows=128, d_in=64, d_out=256, kind="column")
    {'forward': 0, 'backward': 32768}
    """
    if kind == "column":
        return {"forward": 0, "backward": rows * d_in * bytes_per_elem}
    if kind == "row":
        return {"forward": rows * d_out * bytes_per_elem, "backward": 0}
    raise ValueError(f"kind must be 'column' or 'row', got {kind!r}")
