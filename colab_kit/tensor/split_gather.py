"""Megatron sequence parallelism inside the tensor group (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", arXiv 2205.05198, section 4.2.2).

``ParallelConfig(tp=N, tp_mode="1d", sp_mode="split_gather")``. The Linears are 1D's (weights
split as in ``tp1d``); what changes is the layout of the activations between them. 1D keeps the
LayerNorm, dropout and residual regions whole ``[b, t, h]`` on every tp rank, computing the same
thing N times; here they are split along the sequence, ``[b, t/N, h]`` per rank (contiguous
blocks: rank i holds tokens ``i t/N .. (i+1) t/N - 1``). The paper's two conjugate operators
(its g and g-bar; not the f and g of Megatron-LM's 1909.08053, which 1D runs) move between the
layouts and replace 1D's f and g:

- ``g`` = ``gather_from_sequence_parallel``: all-gather along the sequence forward, at the entry
  of each tensor-parallel region (the attention, the MLP, the LM head: ``gather_at_entry``), so
  their column-parallel Linears (the fused qkv, fc1, the head) see the whole sequence;
  reduce-scatter of the gradient backward (it replaces f's backward all-reduce);
- ``g-bar`` = ``reduce_scatter_to_sequence_parallel``: reduce-scatter along the sequence
  forward (after each row-parallel Linear: proj, fc2, and the vocab-parallel embedding's
  partial rows), all-gather of the gradient backward (it replaces g's forward all-reduce).

A ring all-reduce is a reduce-scatter then an all-gather, so each pair sends what the
all-reduce it replaces sent: per block and step 2 all-gathers + 2 reduce-scatters forward and
the mirror backward, instead of 4 all-reduces, with equal wire bytes (``block_collectives``).

Worked example, tp=2, a batch of b=1 sequence of t=4 tokens, d_model=h::

    embedding   each rank: its vocabulary's rows for all 4 tokens, partial [1, 4, h]
                g-bar -> rank 0 tokens 0-1 summed [1, 2, h], rank 1 tokens 2-3; + positions 0-1 / 2-3
    ln1         rank 0 normalises tokens 0-1, rank 1 tokens 2-3
    g           all-gather -> both ranks [1, 4, h]; qkv, attention, proj on their heads (as 1D)
    g-bar       proj's partial [1, 4, h] summed and split -> [1, 2, h]; + bias; + residual
    ln2, g, fc1, gelu, fc2, g-bar   likewise for the MLP
    ln_f, g     all-gather -> [1, 4, h]; the head's logits [1, 4, V/2]; vocab-parallel loss (as 1D)

Gradients. The parameters that stay whole on every rank and now see only this rank's tokens
(LayerNorm weights and biases, the row-parallel Linears' biases, the position table) get
partial gradients: each is summed over tp after backward (``placement.add_partial(module, name, "tp")``, added to
any axes already marked; one flat all-reduce per step, ``sync_grads``). The split weights'
gradients are complete, as in 1D: a column Linear's input is the whole sequence (after g), and
g-bar's backward all-gathers the whole sequence's gradient for the row Linear.

Memory. Per block 1D saves the residual stream twice (the inputs of ln1 and ln2) and each
LayerNorm's mean and rstd ``[b, t, 1]``, all whole; here each is 1/N of that; likewise ln_f.
The all-gathered inputs of qkv, fc1 and the head are still saved whole (their weight gradients
need them), so the paper's further step (keep the split input, all-gather it again in backward:
one more all-gather per column Linear) is not taken: that would send more than 1D does.

A sequence whose length does not divide by tp is refused before any collective, with the
multiple to use: the model's ``seq_len`` in ``check_model``, a batch's length at the start of
each step, the first included (``shard_batch``).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import Axis
from .. import comm
from ..policy.classes import derived_class, derived_from
from .zero_bubble import split_linear
from ..placement import add_partial
from .plan import require_divisible
from .tp1d import ColumnLinear, Plan1D, RowLinear, VocabEmbedding
from ..policy import policy_for

__all__ = ["gather_from_sequence_parallel", "reduce_scatter_to_sequence_parallel", "gathered_class",
           "gather_at_entry", "RegionColumnLinear", "SequenceRowLinear", "SequenceVocabEmbedding",
           "SequencePositions1D", "SplitGather1D"]

SEQ_DIM = 1
"""The sequence dim of the GPT's activations ``[b, t, h]``."""


class GatherFromSequenceParallel(torch.autograd.Function):
    """The paper's g: forward all-gather along the sequence; backward reduce-scatter (sum) of the gradient.

    tp=2, ``x`` of shape ``[b, t/2, h]``: rank 0 holds tokens 0..t/2-1, rank 1 the rest; both get
    ``[b, t, h]``. Backward, each rank's gradient ``[b, t, h]`` (partial: its heads' or its
    columns' share) is summed over the group and rank i keeps its tokens' block.
    """

    @staticmethod
    def forward(ctx, x, mesh, axis, dim):
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return comm.all_gather(x, mesh, axis, dim, tag="sp gather forward")

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter(grad, ctx.mesh, ctx.axis, ctx.dim, tag="sp gather backward"), None, None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """The paper's g-bar: forward reduce-scatter (sum) along the sequence; backward all-gather of the gradient.

    tp=2, ``x`` of shape ``[b, t, h]`` a partial sum on each rank (a row-parallel Linear's
    output): rank 0 gets tokens 0..t/2-1 of the sum, rank 1 the rest. Backward, the gradients
    of the two blocks are gathered so both ranks hold ``[b, t, h]``.
    """

    @staticmethod
    def forward(ctx, x, mesh, axis, dim):
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return comm.reduce_scatter(x, mesh, axis, dim, tag="sp reduce-scatter forward")

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.mesh, ctx.axis, ctx.dim, tag="sp reduce-scatter backward"), None, None, None


def gather_from_sequence_parallel(x, mesh, axis: str = Axis.TP, dim: int = SEQ_DIM):
    """g: ``[b, t/n, h]`` -> ``[b, t, h]`` (backward: reduce-scatter); identity on a size-1 axis."""
    return GatherFromSequenceParallel.apply(x, mesh, axis, dim % x.dim()) if mesh.size(axis) > 1 else x


def reduce_scatter_to_sequence_parallel(x, mesh, axis: str = Axis.TP, dim: int = SEQ_DIM):
    """g-bar: partial ``[b, t, h]`` -> summed ``[b, t/n, h]`` (backward: all-gather); identity on a size-1 axis."""
    return ReduceScatterToSequenceParallel.apply(x, mesh, axis, dim % x.dim()) if mesh.size(axis) > 1 else x



def gathered_class(cls: type) -> type:
    """The subclass of ``cls`` whose forward runs g on its input first (one per class, made once).

    It opens a tensor-parallel region (the attention, the MLP, the LM head): the module's own
    forward then sees the whole sequence ``[b, t, h]``, as under 1D (the GPT's attention reads
    ``t`` from its input), and the region ends in a ``SequenceRowLinear`` (g-bar) or the loss.
    """
    if derived_from(cls, "Gathered") is not None:
        return cls

    def make_forward(cls):
        def forward(self, x, *args, **kwargs):
            mesh, axis = _GATHERED[self]
            return cls.forward(self, gather_from_sequence_parallel(x, mesh, axis), *args, **kwargs)
        return forward

    return derived_class(cls, "Gathered", make_forward, __name__, f"``{cls.__name__}`` entered through g: its "
                         "input all-gathered along the sequence (colab_kit.tensor.split_gather).")


def gather_at_entry(module: nn.Module, mesh, axis: str = Axis.TP) -> nn.Module:
    """Make ``module`` (in place: same parameters and names, only the class changes) start with g."""
    module.__class__ = gathered_class(type(module))
    _GATHERED[module] = (mesh, axis)
    return module


_GATHERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per module ``gather_at_entry`` changed: ``(mesh, axis)`` its g gathers over (kept here, not on the module)."""
_SPLIT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per position table ``SequencePositions1D`` reads: ``(tp rank, tp size)``."""


class RegionColumnLinear(ColumnLinear):
    """1D's column-parallel Linear inside a region that g opened: its input is whole already, so no
    f (g's backward reduce-scatter sums the input gradient that f's all-reduce summed under 1D)."""

    def forward(self, x):
        return split_linear(x, self.weight, self.bias)


class SequenceRowLinear(RowLinear):
    """1D's row-parallel Linear summed through g-bar: ``[b, t, in/n]`` -> ``[b, t/n, out]``.

    The bias is added after the split, so it sees this rank's tokens only: its gradient is
    summed over the group.
    """

    def __init__(self, weight, bias, mesh, axis: str = Axis.TP):
        super().__init__(weight, bias, mesh, axis)
        if self.bias is not None:
            add_partial(self, "bias", axis)

    def forward(self, x):
        y = reduce_scatter_to_sequence_parallel(split_linear(x, self.weight), self.mesh, self.axis)
        return y + self.bias if self.bias is not None else y


class SequenceVocabEmbedding(VocabEmbedding):
    """1D's vocabulary-split table; its partial rows ``[b, t, h]`` summed through g-bar -> ``[b, t/n, h]``."""

    def forward(self, tokens):
        return reduce_scatter_to_sequence_parallel(self.partial_rows(tokens), self.mesh, self.axis)


class SequencePositions1D(nn.Embedding):
    """The position table, whole on every rank, looking up only this rank's block of positions.

    ``forward(torch.arange(t))`` (what ``GPT.embed`` passes) returns rows ``i t/n .. (i+1) t/n - 1``
    on rank i, to add to the embedding's ``[b, t/n, h]``. Same parameter as the ``nn.Embedding`` it
    was (only the class changes), its gradient summed over the group (each rank fills its rows).
    """

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        rank, size = _SPLIT.get(self, (0, 1))
        return F.embedding(positions.chunk(size, dim=-1)[rank], self.weight)


class SplitGather1D(Plan1D):
    """1D tensor parallelism with Megatron's sequence parallelism in the LayerNorm/dropout regions."""

    mode = "1d+split_gather"
    batch_axes = ()
    token_axes = (Axis.TP,)  # the LayerNorm/dropout regions hold t/tp tokens

    @classmethod
    def refused_layers(cls, cfg) -> str | None:
        """Its regions split the sequence of token and position tables, norms, column/row Linears and a head
        only: a model with other roles (a Llama's RMSNorms and rotary embedding) or tied weights is refused."""
        bad = sorted(set(getattr(cfg, "roles", {})) - {"vocab", "positions", "column", "row", "norm", "head"})
        if not bad and not getattr(cfg, "tied", None):
            return None
        what = " and ".join([", ".join(f"{r} ({cfg.roles[r]})" for r in bad)] * bool(bad)
                            + ["tied weights"] * bool(cfg.tied))
        return (f"sp_mode='split_gather' splits the sequence of models made of token and position tables, norms, "
                f"column/row Linears and a head; this one also has {what}: use plain tp_mode='1d' (sp_mode='ring' "
                f"or 'ulysses' for causal models)")

    @classmethod
    def check(cls, cfg, layout) -> None:
        super().check(cfg, layout)
        p = layout.size(Axis.TP)
        require_divisible({"seq_len": cfg.seq_len}, p,
                          f"sp_mode='split_gather' splits the sequence over tp={p}: use a seq_len that is a "
                          f"multiple of {p}")

    def shard_batch(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows stay whole (tokens are split inside the model); a length that does not split over tp
        is refused here, at the step's start, before any collective."""
        n = self.mesh.size(Axis.TP)
        if rows.dim() > 1 and rows.shape[1] % n:
            raise ValueError(f"a sequence of {rows.shape[1]} tokens does not split over tp={n} with "
                             f"sp_mode='split_gather': use a sequence length that is a multiple of {n}")
        return super().shard_batch(rows)

    def parallelize(self, model, policy=None):
        """1D's layers by role, with the regions split along the sequence: g at the entry of each
        attention module (it reads the whole sequence's length) and of each column Linear outside one
        (the MLP's up projections, the head), g-bar after each row Linear and the token table."""
        policy = policy or policy_for(model)
        policy.check(model)
        self._attention_paths = tuple(p for p, _, _ in policy.attentions(model))
        for _, att, _ in policy.attentions(model):
            gather_at_entry(att, self.mesh, Axis.TP)
        return super().parallelize(model, policy)

    def layer(self, role, path, dense):
        mesh, axis = self.mesh, Axis.TP
        if role == "vocab":
            return SequenceVocabEmbedding.from_dense(dense, mesh, axis)
        if role == "positions":
            dense.__class__ = SequencePositions1D
            _SPLIT[dense] = (mesh.rank(axis), mesh.size(axis))
            add_partial(dense, "weight", axis)
            return None
        if role == "norm":
            for name, _ in dense.named_parameters(recurse=False):
                add_partial(dense, name, axis)
            return None
        if role == "row":
            return SequenceRowLinear.from_dense(dense, mesh, axis)
        linear = RegionColumnLinear.from_dense(dense, mesh, axis)  # column, head
        return linear if self._in_attention(path) else gather_at_entry(linear, mesh, axis)

    def _in_attention(self, path: str) -> bool:
        return any(path.startswith(a + ".") for a in self._attention_paths)

    _attention_paths: tuple[str, ...] = ()

