"""2D (SUMMA / Optimus) and 2.5D (Tesseract) tensor parallelism: one plan, ``Plan2D``.

Optimus (Xu et al., arXiv 2104.05343) arranges the tp = q*q ranks as a q x q grid and
splits every activation and every weight into q x q blocks; matrix products are SUMMA
(van de Geijn & Watts). Tesseract (Wang et al., arXiv 2105.14500) stacks d such grids
(tp = d*q*q): the batch is split d*q ways, the weights are the same on every depth
layer, and each layer runs the same SUMMA on its own rows. 2D is 2.5D with d = 1 and
no ``tp_dep`` axis, and shares every line of code.

Layout on the rank at depth ``dep``, grid row ``i`` (tp_row) and column ``j`` (tp_col):

- activation [b, t, h]: batch block ``dep*q + i`` (``batch_axes``, slowest first),
  hidden block ``j``;
- Linear (``Linear2D``): block (i, j) of W = dense.weight.T [in, out]; bias block j;
- LayerNorm (``LayerNorm2D``): weight and bias block j; statistics summed over the row;
- token table (``VocabEmbedding2D``): block (i, j) of table [V, h] (vocabulary over
  tp_row, hidden over tp_col: the paper's V/q x h/q; the ids go round the grid column);
- position table (``Embedding2D``): table[:, block j] (split by hidden column, no forward
  communication);
- LM head: a ``Linear2D`` over the vocabulary, so the logits come out split by
  vocabulary over tp_col, which is what ``vocab_parallel_cross_entropy`` takes.

Where gradients are summed: SUMMA's backward sums dW over the grid column (the
reduces of ``summa_atb``) and dA over the grid row; everything else is summed after
backward by ``sync_grads`` from the layers' ``Partial()`` declarations (``colab_kit.placement``): a Linear's W over
tp_dep, and every parameter that is the same on every grid row (biases, LayerNorm, embeddings) over the
batch axes (tp_dep, tp_row).

Worked example, tp=4 (2D, q=2), batch of 4 rows, d_model=8, fc1 8 -> 32::

    rank  row col  batch rows  hidden cols  fc1 W block (W = fc1.weight.T)  logits vocab (V=64)
     0     0   0     0..1        0..3       W[0:4, 0:16]                     0..31
     1     0   1     0..1        4..7       W[0:4, 16:32]                    32..63
     2     1   0     2..3        0..3       W[4:8, 0:16]                     0..31
     3     1   1     2..3        4..7       W[4:8, 16:32]                    32..63

    rank 1's fc1 forward: gets x[0:2, 0:4] from rank 0 (tp_col) and sends its W[0:4, 16:32]
    to rank 3 (tp_row); sends x[0:2, 4:8] to rank 0 and gets W[4:8, 16:32] from rank 3;
    adds the two products: h[0:2, 16:32].

With 2.5D, tp=8, depth 2, the ranks 4..7 form a second grid on batch rows 4..7 of 8
(rank 4 + r holds the same weight blocks as rank r); rank 5 = (dep 1, row 0, col 1)
works on rows 4..5 and hidden cols 4..7.
"""
from __future__ import annotations

from ..config import Axis
from ..policy import set_module
from .plan import TensorPlan, require_divisible
from .tp2d_layers import (SUMMA_AB, SUMMA_ABT, SUMMA_ATB, Embedding2D, InputLinear2D, LayerNorm2D, Linear2D,
                          RMSNorm2D,
                          TiedHead2D, VocabEmbedding2D, batch_axes_of, summa_ab, summa_abt, summa_atb)

__all__ = ["Plan2D", "linear_comm_bytes", "Linear2D", "LayerNorm2D", "Embedding2D", "VocabEmbedding2D",
           "SUMMA_AB", "SUMMA_ABT", "SUMMA_ATB", "summa_ab", "summa_abt", "summa_atb"]


def linear_comm_bytes(rows: int, d_in: int, d_out: int, q: int, depth: int = 1, bias: bool = True,
                      bytes_per_elem: int = 4) -> dict[str, int]:
    """Bytes one rank hands to collectives for one ``Linear2D`` of ``d_in -> d_out``.

    ``rows`` is the number of token rows the whole tensor block works on (b*t of the
    dp-local batch); a rank holds the input block ``A`` of ``rows/(d q) x d_in/q`` and
    the weight block ``W`` of ``d_in/q x d_out/q``. Counting as the SUMMA analysis of
    Optimus (arXiv 2104.05343) and Tesseract (arXiv 2105.14500) does, q steps each::

        forward   = q (|A| + |W|)           C = A W: broadcast A[i,k] (row), W[k,j] (column)
        backward  = 2 q (|A| + |W|)         dA = dC W^T: broadcast W, reduce a dA block;
                                            dW = A^T dC: broadcast A, reduce a dW block
        grad_sync = |W| [d > 1]             W's gradient summed over tp_dep (sync_grads)
                  + d_out/q ([q > 1] + [d > 1])   the bias block over tp_row and tp_dep

    with |A| = rows d_in / (d q^2) elements, |W| = d_in d_out / q^2, so the forward is
    ``rows d_in / (d q) + d_in d_out / q``: Tesseract's depth d divides the activation
    traffic, not the weight traffic. ``grad_sync`` runs once per step (after gradient
    accumulation), not once per microbatch.

    >>> linear_comm_bytes(rows=64, d_in=32, d_out=128, q=2, depth=2)
    {'forward': 10240, 'backward': 20480, 'grad_sync': 4608}
    """
    for name, n, by in (("rows", rows, depth * q), ("d_in", d_in, q), ("d_out", d_out, q)):
        if n % by:
            raise ValueError(f"{name}={n} is not divisible by {by}")
    a = rows // (depth * q) * (d_in // q)
    w = (d_in // q) * (d_out // q)
    sync = w * (depth > 1) + (d_out // q) * ((q > 1) + (depth > 1)) * bias
    return {"forward": q * (a + w) * bytes_per_elem, "backward": 2 * q * (a + w) * bytes_per_elem,
            "grad_sync": sync * bytes_per_elem}


class Plan2D(TensorPlan):
    """The plan of tp_mode '2d' and '2.5d' (see the module docstring)."""

    mode = "2d"  # "2.5d" on a 2.5d mesh (set per instance)
    head_axes = (Axis.TP_COL,)
    vocab_axis = Axis.TP_COL  # logits: rows by grid row, vocabulary by grid column
    hidden_axes = (Axis.TP_COL,)

    def __init__(self, mesh):
        super().__init__(mesh)
        self.mode = mesh.config.tp_mode
        self.batch_axes = batch_axes_of(mesh)

    @classmethod
    def check(cls, cfg, layout) -> None:
        q = layout.size(Axis.TP_COL)
        mode = layout.config.tp_mode
        grid = f"tp={layout.config.tp}" + (f" with depth {layout.size(Axis.TP_DEP)}" if mode == "2.5d" else "")
        require_divisible({"d_model": cfg.d_model, "n_heads": cfg.n_heads, **cfg.kv, "d_ff": cfg.d_ff,
                           **cfg.outputs, **cfg.tables, **cfg.inputs}, q,
                          f"tp_mode={mode!r} ({grid}, a {q} x {q} grid) splits the hidden size, the attention "
                          f"heads, the MLP's inner size and the vocabulary over the q={q} grid columns: "
                          f"choose sizes that are multiples of {q}")

    def layer(self, role, path, dense):
        mesh = self.mesh
        if role == "vocab":
            return VocabEmbedding2D.from_dense(dense, mesh)
        if role in ("positions", "table"):
            return Embedding2D.from_dense(dense, mesh)
        if role == "norm":
            return LayerNorm2D.from_dense(dense, mesh)
        if role == "rmsnorm":
            return RMSNorm2D.from_dense(dense, mesh)
        if role == "rotary":  # no parameters: the same on every rank
            return None
        if role == "input":  # the raw input, whole: this rank's feature block, then SUMMA
            return InputLinear2D.from_dense(dense, mesh)
        return Linear2D.from_dense(dense, mesh)  # column, row, dense, head: one SUMMA each (q/k/v fused)

    def tie(self, model, table, head, table_path, head_path):
        """The head's logits from the token table's own blocks: ``x table^T`` by SUMMA (``TiedHead2D``)."""
        set_module(model, head_path, TiedHead2D(table, head.bias, self.mesh))
