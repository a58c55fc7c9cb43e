"""3D tensor parallelism (Bian et al. 2021, "Maximizing Parallelism in Distributed Training
for Huge Neural Networks", arXiv 2105.14450), as Colossal-AI runs it.

The tensor block of ``tp = q**3`` ranks is a cube with axes ``tp_in``, ``tp_wt``,
``tp_out`` (``tp_i = (in * q + wt) * q + out``, see ``colab_kit.mesh``). Each
Linear (``tp3d_layers.Matmul3D``) all-gathers its input along one axis, its weight
along ``tp_wt``, multiplies, and reduce-scatters the product along the third axis;
the output's layout is the input's with ``tp_in`` and ``tp_out`` swapped, so the
two Linears of a pair (q/k/v then proj, fc1 then fc2) bring the layout back.

Layout of an activation ``[b, t, h]`` (no piece is held twice inside the cube):

==================  =======================  ===============  ========================
tensor              batch rows split over    features over    produced by
==================  =======================  ===============  ========================
tokens, targets     (tp_wt, tp_out)          --               ``shard_batch``
logits              (tp_wt, tp_out)          tp_in (vocab)    ``head``
residual stream x   (tp_wt, tp_in)           tp_out           embeddings, proj, fc2
inside attn / MLP   (tp_wt, tp_out)          tp_in (heads,    q, k, v, fc1
                                             d_ff)
==================  =======================  ===============  ========================

Parameters: a Linear's weight is split q**3 ways (see ``Linear3D``); the token table
q**3 ways too, vocabulary over (tp_in, tp_wt) and features over tp_out (the paper's
V/q^2 x h/q, ``VocabEmbedding3D``); Linear biases, LayerNorm
weights and biases and the position table q ways, over features. Copies held by
several row blocks sum their gradients after backward (``Partial()`` in ``colab_kit.placement``).

Why this one: the residual add ``x + attn(ln1(x))`` needs attention to give back
x's layout, and attention needs whole sequences and whole heads, so batch rows (not
tokens) are split and q/k/v split their output features, which are contiguous heads.
The first Linear of each pair gathers over ``tp_in`` and reduce-scatters over
``tp_out``, as the axes' names say; the LM head is such a first Linear, so the logits
come out with rows over (tp_wt, tp_out) and the vocabulary over tp_in. The targets
must be split the same way, and the engine splits inputs and targets alike, so
``batch_axes = ("tp_wt", "tp_out")`` and the token embedding moves its tokens to
the residual rows (an all-gather of integers over tp_out, the only reshuffle).
``batch_shards = q*q``: every rank backpropagates its mean loss / q**2.

Worked example, tp=8 (q=2), batch 8, d_model 32, 4 heads, vocab 64::

    rank (in,wt,out)  tokens/logits   residual x          q/k/v out*  logits vocab
     0   (0,0,0)      rows 0-1        rows 0-1, h 0-15    heads 0-1   0-31
     1   (0,0,1)      rows 2-3        rows 0-1, h 16-31   heads 0-1   0-31
     2   (0,1,0)      rows 4-5        rows 4-5, h 0-15    heads 0-1   0-31
     3   (0,1,1)      rows 6-7        rows 4-5, h 16-31   heads 0-1   0-31
     4   (1,0,0)      rows 0-1        rows 2-3, h 0-15    heads 2-3   32-63
     5   (1,0,1)      rows 2-3        rows 2-3, h 16-31   heads 2-3   32-63
     6   (1,1,0)      rows 4-5        rows 6-7, h 0-15    heads 2-3   32-63
     7   (1,1,1)      rows 6-7        rows 6-7, h 16-31   heads 2-3   32-63
    * rows as tokens/logits

    q/k/v/fc1/head: Linear3D(in_axis=tp_in, out_axis=tp_out)  x (res.) -> inner / logits
    proj/fc2:       Linear3D(in_axis=tp_out, out_axis=tp_in)  inner    -> residual
    LayerNorms: features over tp_out, statistics all-reduced over tp_out
    per block forward: q, k, v, proj, fc1, fc2 each 2 all-gathers + 1 reduce-scatter,
    plus 2 all-reduces of [b/q^2, t, 1] per LayerNorm; backward the same count again.
"""
from __future__ import annotations

import torch

from ..config import Axis, ConfigError
from .plan import TensorPlan, require_divisible
from ..policy import set_module
from .tp3d_layers import (WT, DenseLinear3D, Embedding3D, InputLinear3D, LayerNorm3D, Linear3D, RMSNorm3D,
                          TiedHead3D, VocabEmbedding3D, local_block, other_axis)

__all__ = ["Plan3D", "linear_comm_bytes", "Linear3D", "LayerNorm3D", "VocabEmbedding3D", "Embedding3D",
           "local_block", "other_axis", "RESIDUAL", "INNER", "BATCH_AXES"]

BATCH_AXES = (WT, Axis.TP_OUT)
RESIDUAL = ((WT, Axis.TP_IN), Axis.TP_OUT)   # (row axes, feature axis) of the residual stream
INNER = ((WT, Axis.TP_OUT), Axis.TP_IN)      # ... of q/k/v and fc1 outputs, and of the logits


def linear_comm_bytes(rows: int, d_in: int, d_out: int, q: int, bytes_per_elem: int = 4) -> dict[str, int]:
    """Bytes one rank hands to the collectives of one ``Linear3D`` (the unit ``mesh.log`` records).

    ``rows`` counts the rows the whole cube works on (tokens of the dp-local batch, b*t);
    ``e = bytes_per_elem``. Forward and backward each run two all-gathers and one
    reduce-scatter; an all-gather is handed the local piece, a reduce-scatter the whole
    partial product::

        forward  = e * ( rows d_in / q^3        all_gather X over the input axis
                       + d_in d_out / q^3       all_gather W over tp_wt
                       + rows d_out / q^2 )     reduce_scatter X^ W^T over the output axis
        backward = e * ( rows d_out / q^3       all_gather dY over the output axis
                       + rows d_in / q^2        reduce_scatter dY^ W^ over the input axis
                       + d_in d_out / q^2 )     reduce_scatter dY^T X^ over tp_wt

    On the wire (ring collectives over q ranks) each of the six moves ``(q - 1) / q^3`` of
    the whole matrix it concerns (X, W or Y), the paper's cost per processor: with p = q^3
    ranks, O(p^(-2/3)) of the matrices, against O(1) for 1D tensor parallelism. The bias
    gradient's sum (``sync_grads``, d_out / q elements over tp_wt and the output axis) comes
    on top; an input that needs no gradient skips the backward's reduce-scatter over the
    input axis. Example: rows=64, d_in=32, d_out=128, q=2 -> forward 4 * (256 + 512 + 2048) =
    11264, backward 4 * (1024 + 512 + 1024) = 10240.
    """
    def part(n: int, d: int) -> int:
        if n % d:
            raise ValueError(f"{n} does not split into {d} equal parts: 3d needs rows, d_in and d_out "
                             f"that divide over the cube (q={q})")
        return n // d

    q2, q3 = q * q, q ** 3
    fwd = part(rows * d_in, q3) + part(d_in * d_out, q3) + part(rows * d_out, q2)
    bwd = part(rows * d_out, q3) + part(rows * d_in, q2) + part(d_in * d_out, q2)
    return {"forward": fwd * bytes_per_elem, "backward": bwd * bytes_per_elem}


class Plan3D(TensorPlan):
    """3D tensor parallelism over the cube (tp_in, tp_wt, tp_out); see the module docstring."""

    mode = "3d"
    batch_axes = BATCH_AXES
    head_axes = (INNER[1],)  # q/k/v outputs: heads over tp_in
    vocab_axis = INNER[1]
    hidden_axes = (RESIDUAL[1],)  # the residual stream's features over tp_out

    def dropout_rows(self, dp_rows, microbatches, i):
        """Microbatch ``i``'s rows in the cube: the token rows of every (tp_wt, tp_out) pair in that order
        (what the embedding's all-gathers put together), then chunked over tp_wt and tp_out (inner layout,
        attention's) or tp_wt and tp_in (the residual stream's).

        q=2, 8 dp rows, 1 microbatch: rank (in 1, wt 0, out 0) has tokens rows 0-1, residual rows 2-3."""
        q, mesh = self.mesh.size(WT), self.mesh
        every = torch.cat([r.chunk(microbatches)[i] for w in dp_rows.chunk(q) for r in w.chunk(q)])
        mine = every.chunk(q)[mesh.rank(WT)]
        return mine.chunk(q)[mesh.rank(RESIDUAL[0][1])], mine.chunk(q)[mesh.rank(INNER[0][1])]

    @classmethod
    def check(cls, cfg, layout) -> None:
        q = layout.size(WT)
        where = f"tp_mode='3d' with tp={q ** 3} (q={q})"
        require_divisible({"d_model": cfg.d_model, "d_ff": cfg.d_ff}, q * q,
                          f"{where} splits each Linear's input features over q*q={q * q} ranks "
                          f"(tp_wt and one of tp_in/tp_out): choose multiples of {q * q}")
        require_divisible({"n_heads": cfg.n_heads, **cfg.kv}, q,
                          f"{where} splits attention heads over q={q} ranks: choose multiples of {q}")
        require_divisible({k: v for k, v in cfg.outputs.items() if k not in cfg.tables}, q,
                          f"{where} splits the head's outputs over q={q} ranks: choose multiples of {q}")
        require_divisible({**cfg.inputs}, q * q, f"{where} splits an input Linear's features over q*q={q * q} ranks: "
                          f"choose multiples of {q * q}")
        require_divisible(dict(cfg.tables), q * q,
                          f"{where} splits the token table's vocabulary over q*q={q * q} ranks (tp_wt and "
                          f"tp_in, the paper's V/q^2 x h/q): choose multiples of {q * q}")

    def layer(self, role, path, dense):
        mesh = self.mesh
        (_, res_h), (_, inner_h) = RESIDUAL, INNER
        first = dict(in_axis=inner_h, out_axis=res_h)   # residual -> inner
        second = dict(in_axis=res_h, out_axis=inner_h)  # inner -> residual
        if role == "vocab":
            return VocabEmbedding3D.from_dense(dense, mesh, vocab_axis=other_axis(res_h))
        if role in ("positions", "table"):
            return Embedding3D.from_dense(dense, mesh, axis=res_h)
        if role == "norm":
            return LayerNorm3D.from_dense(dense, mesh, axis=res_h)
        if role == "rmsnorm":
            return RMSNorm3D.from_dense(dense, mesh, axis=res_h)
        if role in ("column", "head"):
            return Linear3D.from_dense(dense, mesh, **first)  # q/k/v fused: the input gathered once
        if role == "row":
            return Linear3D.from_dense(dense, mesh, **second)
        if role == "rotary":  # no parameters: the same on every rank
            return None
        # an input's rows arrive as the batch's (the inner layout): this rank's features, then inner -> residual
        if role == "input":
            return InputLinear3D.from_dense(dense, mesh, **second)
        if role == "dense":  # width-keeping, on the residual: residual -> inner, then swapped back
            return DenseLinear3D.from_dense(dense, mesh, **first)
        raise ConfigError(f"tp_mode='3d' has no layer for {path} (role {role!r}): use tp_mode '1d' or '2d' "
                          f"for this model")

    def tie(self, model, table, head, table_path, head_path):
        """The head's logits from the token table's own piece (``TiedHead3D``): one parameter, two uses."""
        set_module(model, head_path, TiedHead3D(table, head.bias, self.mesh))
