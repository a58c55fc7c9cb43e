"""Tensor parallelism in the four modes of the Colossal-AI paper.

A ``TensorPlan`` turns the dense GPT into this rank's shard, in place, for one
mode. Every mode keeps the same contract so that the engine treats them alike:

- ``plan.parallelize(model)`` replaces Linear / LayerNorm / Embedding modules with
  parallel layers built ``from_dense`` (each can gather itself back: ``to_dense()``);
  the model's own forward code runs unchanged on the local shards.
- ``plan.shard_batch(rows)`` keeps the rows of the (dp-local) batch this rank works on:
  modes that split the batch inside the tensor block do it over ``plan.batch_axes``.
- ``plan.loss(local_logits, local_targets)`` is the vocab-parallel cross-entropy: the
  mean over this rank's tokens, computed without ever gathering full logits.
- Each parallel layer declares how its parameters lie on the mesh in DTensor's terms
  (``colab_kit.placement.declare``: ``Shard(dim)`` per axis, and the axes over which a gradient
  is ``Partial()``, the same weight slice used by several batch shards); ``sync_grads(module,
  mesh, table)`` sums those gradients over their axes, reading the engine's ``PlacementTable``.

The loss each rank backpropagates is ``plan.loss(...) / plan.batch_shards``, so the
weight gradients that the parallel layers sum over batch shards come out as the
gradient of the mean over the whole (dp-local) batch.

=======  ================================  ======================  ==================
mode     paper                             activation [b, t, h]    batch_axes
=======  ================================  ======================  ==================
1d       Megatron-LM (1909.08053)          replicated              ()
2d       SUMMA / Optimus (2104.05343)      b by tp_row, h by       (tp_row,)
                                           tp_col
2.5d     Tesseract (2105.14500)            b by (tp_dep, tp_row),  (tp_dep, tp_row)
                                           h by tp_col
3d       3D parallelism (2105.14450)       see ``tp3d``            see ``tp3d``
=======  ================================  ======================  ==================
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .. import comm
from ..config import ConfigError
from ..policy import expand, get_module, set_module
from .cross_entropy import vocab_parallel_cross_entropy

__all__ = ["block_collectives", "TensorPlan", "plan_for", "plan_class", "check_model", "model_sizes", "linear_comm_bytes",
           "sync_grads"]


def sync_grads(module, mesh, table=None) -> None:
    """Sum every gradient that is ``Partial()`` on an axis over that axis (``colab_kit.placement``).

    ``table``: the engine's ``PlacementTable`` (its parameters are what is summed: the model's, or
    their fp32 masters); None reads the declarations of ``module``'s layers. One flat all-reduce per
    axis: the partial gradients are packed, summed, unpacked; one partial over two axes is summed
    over the first, then the second.
    """
    from ..placement import PlacementTable
    table = table if table is not None else PlacementTable(module)
    by_axis: dict[str, list[torch.Tensor]] = {}
    for p in table.params:
        for axis in table.partial(p):
            if p.grad is not None and mesh.size(axis) > 1:
                by_axis.setdefault(axis, []).append(p.grad)
    for axis, grads in by_axis.items():
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, mesh, axis, tag="replicated grads")
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class TensorPlan:
    """Base of the per-mode plans; see the module docstring for the contract."""

    mode = ""
    batch_axes: tuple[str, ...] = ()

    def __init__(self, mesh):
        self.mesh = mesh

    @property
    def batch_shards(self) -> int:
        return math.prod(self.mesh.size(a) for a in self.batch_axes)

    def shard_batch(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows: split over ``batch_axes``, slowest axis first."""
        for axis in self.batch_axes:
            n, i = self.mesh.size(axis), self.mesh.rank(axis)
            if rows.shape[0] % n:
                raise ValueError(f"{rows.shape[0]} rows do not split over {axis}={n} inside tp_mode="
                                 f"{self.mode!r}: use a batch whose rows per dp rank are a multiple of "
                                 f"{self.batch_shards}")
            rows = rows.chunk(n)[i]
        return rows

    @classmethod
    def check(cls, model_cfg, layout) -> None:
        """Raise ConfigError when the model's sizes do not divide over this mode's mesh.

        Pure: ``layout`` is a ``MeshLayout``, so the check runs in the notebook kernel
        before any process is touched (``check_model``).
        """

    # ------------------------------------------------------------------ lowering a policy
    head_axes: tuple[str, ...] = ("tp",)
    """Axes over which the attention heads are split (their sizes divide each head count)."""
    vocab_axis = "tp"
    """The axis the logits' vocabulary (or classes) is split over, for the vocab-parallel loss."""
    hidden_axes: tuple[str, ...] = ()
    """Axes over which the residual stream's features (its last dim) are split, slowest first."""
    token_axes: tuple[str, ...] = ()
    """Axes over which the residual stream's tokens (dim 1) are split (split_gather's tp)."""

    def dropout_rows(self, dp_rows: torch.Tensor, microbatches: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global row ids of microbatch ``i``'s residual stream and of its attention inputs on this rank,
        given this dp rank's ``dp_rows`` (``colab_kit.models.dropout``): the engine splits the batch over
        ``batch_axes`` and then into microbatches, and both tensors have the token rows."""
        rows = self.shard_batch(dp_rows).chunk(microbatches)[i]
        return rows, rows

    def layer(self, role: str, path: str, dense: nn.Module) -> nn.Module | None:
        """This mode's layer for a dense module of ``role`` (None: keep it whole on every rank)."""
        raise NotImplementedError

    def parallelize(self, model: nn.Module, policy=None) -> nn.Module:
        """Replace every layer ``policy`` names by this mode's (in the model's own module order, so a
        meta model's shards are made one at a time), divide the attention head counts by the head split,
        and tie what the policy ties. The model's own forward code then runs on the local shards."""
        if policy is None:
            from ..policy import policy_for
            policy = policy_for(model)
        policy.check(model)
        split = math.prod(self.mesh.size(a) for a in self.head_axes)
        fused = {p: k for pattern, k in policy.fused.items()
                 for p in expand(pattern, policy.blocks, len(policy.block_list(model)))}
        dense_of = {}
        for path, role, dense in policy.modules(model):
            dense_of[path] = dense
            if path in fused:  # [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: a contiguous split is whole parts
                dense = regrouped(dense, fused[path], split)
            new = self.layer(role, path, dense)
            if new is not None:
                if path in fused:
                    from ..placement import mark_parts
                    mark_parts(new, fused[path])
                set_module(model, path, new)
        for _, att, what in policy.attentions(model):
            for name in (*what.heads, *what.kv_heads, *what.widths):
                setattr(att, name, getattr(att, name) // split)
        for a, b in policy.tied:  # the head as it was (dense), the table as this mode made it
            self.tie(model, get_module(model, a), dense_of.get(b, get_module(model, b)), a, b)
        return model

    def tie(self, model: nn.Module, table: nn.Module, head: nn.Module, table_path: str, head_path: str) -> None:
        """Make the head at ``head_path`` use ``table``'s (sharded) weight again (the policy's ``tied``);
        ``head`` is the dense head module, before this mode replaced it."""
        raise ConfigError(f"tp_mode={self.mesh.config.tp_mode!r} cannot shard {head_path} tied to {table_path} "
                          f"yet: untie them (e.g. BERTConfig(tie_embeddings=False)) or use tp_mode '1d' or '2d'")

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy from logits split over ``vocab_axis`` (targets -100: any value)."""
        start = self.mesh.rank(self.vocab_axis) * logits.shape[-1]
        return vocab_parallel_cross_entropy(logits, targets, self.mesh, self.vocab_axis, start)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over this rank's tokens."""
        return self.token_losses(logits, targets).mean()


def regrouped(dense: nn.Linear, parts: int, n: int) -> nn.Linear:
    """``dense`` with its output features reordered from ``parts`` blocks (``[q | k | v]``) to ``n`` groups
    of every block's share (``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``), so that block ``i`` of a contiguous
    ``n``-way split of the output features is rank ``i``'s share of each part. A new Linear on the CPU
    (from the dense value: ``colab_kit.sharded_init``); the layer cut from it keeps only its slice.

    >>> lin = nn.Linear(1, 6, bias=False)
    >>> with torch.no_grad(): _ = lin.weight.copy_(torch.arange(6.).view(6, 1))   # q0 q1 | k0 k1 | v0 v1
    >>> regrouped(lin, 3, 2).weight.flatten().tolist()
    [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]
    """
    from ..sharded_init import dense_value
    out = dense.out_features
    if out % (parts * n):
        raise ConfigError(f"{out} fused output features in {parts} parts do not split over {n} ranks: "
                          f"each part's size must be a multiple of {n}")
    order = torch.arange(out).view(parts, n, out // (parts * n)).transpose(0, 1).reshape(-1)
    new = nn.Linear(dense.in_features, out, bias=dense.bias is not None, device="meta")
    new.weight = nn.Parameter(dense_value(dense.weight).detach()[order].clone())
    if dense.bias is not None:
        new.bias = nn.Parameter(dense_value(dense.bias).detach()[order].clone())
    return new


def require_divisible(what: dict[str, int], by: int, rule: str) -> None:
    """ConfigError naming every size in ``what`` that ``by`` does not divide."""
    bad = {k: v for k, v in what.items() if v % by}
    if bad:
        sizes = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ConfigError(f"{sizes} not divisible by {by}: {rule}")


def plan_class(tp_mode: str, sp_mode: str | None = None) -> type[TensorPlan]:
    """The plan class of a tensor mode; ``sp_mode="split_gather"`` (Megatron's sequence parallelism
    inside the tp group) selects ``split_gather.SplitGather1D``, which runs on 1D only."""
    if sp_mode == "split_gather":
        if tp_mode != "1d":
            raise ConfigError(f"sp_mode='split_gather' splits 1D's LayerNorm and dropout regions along the "
                              f"sequence; tp_mode={tp_mode!r} has no split_gather form: use tp_mode='1d'")
        from .split_gather import SplitGather1D
        return SplitGather1D
    if tp_mode == "1d":
        from .tp1d import Plan1D
        return Plan1D
    if tp_mode in ("2d", "2.5d"):
        from .tp2d import Plan2D
        return Plan2D
    if tp_mode == "3d":
        from .tp3d import Plan3D
        return Plan3D
    raise ConfigError(f"unknown tp_mode {tp_mode!r}: choose one of '1d', '2d', '2.5d' or '3d'")


def plan_for(mesh) -> TensorPlan:
    """The plan of ``mesh.config.tp_mode`` (and ``sp_mode``, for "split_gather") on this rank's mesh."""
    return plan_class(mesh.config.tp_mode, mesh.config.sp_mode)(mesh)


def linear_comm_bytes(config, rows: int, d_in: int, d_out: int, kind: str = "column",
                      bytes_per_elem: int = 4) -> dict[str, int]:
    """The paper's communication of one parallel Linear ``d_in -> d_out`` in ``config``'s mode.

    Bytes one rank hands to collectives, by direction (``forward``, ``backward`` and, for
    the modes that have it, the once-per-step ``grad_sync``). ``rows`` = tokens of the
    dp-local batch; ``kind`` ('column' or 'row') matters for 1D only. Each mode's own
    function documents its formula: ``tp1d``, ``tp2d`` (2D and 2.5D), ``tp3d``.
    """
    q = config.tp_q
    if config.tp_mode == "1d":
        from .tp1d import linear_comm_bytes as f
        return f(rows, d_in, d_out, kind, bytes_per_elem)
    if config.tp_mode in ("2d", "2.5d"):
        from .tp2d import linear_comm_bytes as f
        return f(rows, d_in, d_out, q, config.tp_depth, bytes_per_elem=bytes_per_elem)
    from .tp3d import linear_comm_bytes as f
    return f(rows, d_in, d_out, q, bytes_per_elem)


def block_collectives(config) -> dict[str, int]:
    """Collectives one transformer block sends per training step (forward and backward) on the
    tensor axes, by op: four Linears (the fused qkv, proj, fc1, fc2) and two LayerNorms.

    ==========  ==========================================  ================================
    mode        per Linear                                  per block (q = grid side)
    ==========  ==========================================  ================================
    1d          column: f's all-reduce (bwd); row: g's      all_reduce 4 (Megatron's count)
                all-reduce (fwd); LayerNorms need none
    1d +        column: all-gather (fwd), reduce-scatter    all_gather 4, reduce_scatter 4
    split_      (bwd); row: reduce-scatter (fwd),           (same wire bytes as 1D's 4
    gather      all-gather (bwd), along the sequence        all-reduces)
    2d, 2.5d    SUMMA: q steps of 2 broadcasts (fwd), of    broadcast 16q, reduce 8q,
                broadcast + reduce for dX and for dW        all_reduce 8 (LayerNorm sums)
    3d          all-gather X and W, reduce-scatter Y (fwd); all_gather 12, reduce_scatter 12,
                all-gather dY, reduce-scatter dX and dW     all_reduce 8 (LayerNorm sums)
    ==========  ==========================================  ================================

    Worked example, ``ParallelConfig(tp=4, tp_mode="2d")`` (q = 2): a block's step sends
    32 broadcasts, 16 reduces and 8 all-reduces inside the 2 x 2 grid. With q, k and v as
    three Linears it would be 48, 24 and 8: the attention input would travel three times.
    """
    q = config.tp_q
    if config.tp == 1:
        return {}
    if config.tp_mode == "1d" and config.sp_mode == "split_gather":
        return {"all_gather": 4, "reduce_scatter": 4}  # g and g-bar around each Linear pair, both ways
    if config.tp_mode == "1d":
        return {"all_reduce": 4}
    if config.tp_mode in ("2d", "2.5d"):
        return {"broadcast": 16 * q, "reduce": 8 * q, "all_reduce": 8}
    return {"all_gather": 12, "reduce_scatter": 12, "all_reduce": 8}


def check_model(model_cfg, config, policy=None) -> None:
    """ConfigError, before any process runs, if a model cannot be sharded by ``config``.

    ``model_cfg``: a built-in model's config (``GPTConfig``), or the model itself with its
    ``policy`` (``colab_kit.policy``), whose sizes are read off its layers (``model_sizes``).
    """
    if config.tp > 1:
        from ..mesh import MeshLayout

        sizes = model_sizes(model_cfg, policy)
        plan_class(config.tp_mode, config.sp_mode).check(sizes, MeshLayout(config))


def model_sizes(model, policy=None):
    """The sizes a tensor mode splits, as one namespace: ``d_model``, ``n_heads``, ``d_ff``, ``seq_len``,
    ``outputs`` (the head's: ``{"vocab_size": V}`` or ``{"num_classes": C}``), ``tables`` (the token
    table's ``{"vocab_size": V}``), ``inputs`` (an input Linear's ``{"input features": F}``), ``dropout``,
    ``roles`` (each role the model has -> its first path), ``tied`` (the policy's tied pairs) and ``kv``
    (``{"n_kv_heads": k}`` where grouped-query attention has fewer key/value heads than query heads).

    From a config (``GPTConfig``), its fields; from a model with its policy, its layers: ``d_ff`` is the
    gcd of the out features of the column Linears outside attention (a tp size divides all of them
    exactly when it divides their gcd), ``d_model`` the first norm's width.
    """
    from types import SimpleNamespace
    if not isinstance(model, nn.Module):
        v = model.vocab_size
        return SimpleNamespace(d_model=model.d_model, n_heads=model.n_heads, d_ff=model.d_ff,
                               seq_len=model.seq_len, outputs={"vocab_size": v}, tables={"vocab_size": v},
                               inputs={}, dropout=getattr(model, "dropout", 0.0), roles={}, tied=(), kv={})
    inside = {p for p, _, _ in policy.attentions(model)}
    cols = [m.out_features for p, _, m in policy.modules(model, "column")
            if not any(p.startswith(a + ".") for a in inside)]
    norms = policy.modules(model, "norm")
    rows = policy.modules(model, "row")
    d_model = norms[0][2].normalized_shape[0] if norms else (rows[0][2].out_features if rows else 0)
    counts = policy.head_count(model)
    heads = counts["heads"]
    head_name = "num_classes" if policy.loss == "classes" else "vocab_size"
    pos = policy.modules(model, "positions")
    drops = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    return SimpleNamespace(
        d_model=d_model, n_heads=heads, d_ff=math.gcd(*cols) if cols else d_model,
        seq_len=pos[0][2].num_embeddings if pos else 0,
        outputs={head_name: m.out_features for _, _, m in policy.modules(model, "head")},
        tables={"vocab_size": m.num_embeddings for _, _, m in policy.modules(model, "vocab")},
        inputs={"input features": m.in_features for _, _, m in policy.modules(model, "input")},
        kv={"n_kv_heads": counts["kv_heads"]} if counts["kv_heads"] != heads else {},
        dropout=max(drops, default=0.0), roles={r: p for p, r, _ in reversed(policy.modules(model))},
        tied=tuple(policy.tied))
