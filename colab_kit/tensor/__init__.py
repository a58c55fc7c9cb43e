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

import torch.nn as nn

from ..config import ConfigError
from .cross_entropy import vocab_parallel_cross_entropy
from .plan import TensorPlan, regrouped, require_divisible, sync_grads
from ..mesh import MeshLayout
from .split_gather import SplitGather1D
from .tp1d import Plan1D
from .tp2d import Plan2D
from . import tp1d, tp2d, tp3d
from .tp3d import Plan3D

__all__ = ["block_collectives", "TensorPlan", "regrouped", "require_divisible", "vocab_parallel_cross_entropy",
           "plan_for", "plan_class", "check_model", "model_sizes", "linear_comm_bytes", "sync_grads"]


def plan_class(tp_mode: str, sp_mode: str | None = None) -> type[TensorPlan]:
    """The plan class of a tensor mode; ``sp_mode="split_gather"`` (Megatron's sequence parallelism
    inside the tp group) selects ``split_gather.SplitGather1D``, which runs on 1D only."""
    if sp_mode == "split_gather":
        if tp_mode != "1d":
            raise ConfigError(f"sp_mode='split_gather' splits 1D's LayerNorm and dropout regions along the "
                              f"sequence; tp_mode={tp_mode!r} has no split_gather form: use tp_mode='1d'")
        return SplitGather1D
    if tp_mode == "1d":
        return Plan1D
    if tp_mode in ("2d", "2.5d"):
        return Plan2D
    if tp_mode == "3d":
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
        return tp1d.linear_comm_bytes(rows, d_in, d_out, kind, bytes_per_elem)
    if config.tp_mode in ("2d", "2.5d"):
        return tp2d.linear_comm_bytes(rows, d_in, d_out, q, config.tp_depth, bytes_per_elem=bytes_per_elem)
    return tp3d.linear_comm_bytes(rows, d_in, d_out, q, bytes_per_elem)


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
        sizes = model_sizes(model_cfg, policy)
        plan = plan_class(config.tp_mode, config.sp_mode)
        why = plan.refused_layers(sizes)
        if why is not None:
            raise ConfigError(why)
        plan.check(sizes, MeshLayout(config))


def _width(norm) -> int:
    """The features a norm normalises: torch's LayerNorm and RMSNorm say it (``normalized_shape``), a
    model's own RMSNorm (Hugging Face's, which has no such field) by its weight."""
    shape = getattr(norm, "normalized_shape", None)
    return int(shape[-1]) if shape else int(norm.weight.shape[-1])


def model_sizes(model, policy=None):
    """The sizes a tensor mode splits, as one namespace: ``d_model``, ``n_heads``, ``d_ff``, ``seq_len``,
    ``outputs`` (the head's: ``{"vocab_size": V}`` or ``{"num_classes": C}``), ``tables`` (the token
    table's ``{"vocab_size": V}``), ``inputs`` (an input Linear's ``{"input features": F}``), ``dropout``,
    ``roles`` (each role the model has -> its first path), ``tied`` (the policy's tied pairs) and ``kv``
    (``{"n_kv_heads": k}`` where grouped-query attention has fewer key/value heads than query heads).

    From a config (``GPTConfig``), its fields; from a model with its policy, its layers: ``d_ff`` is the
    gcd of the out features of the column Linears outside attention (a tp size divides all of them
    exactly when it divides their gcd), ``d_model`` the first norm's width (a LayerNorm's, else an RMSNorm's; the
    first row Linear's out features where the policy names no norm).
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
    norms = policy.modules(model, "norm") or policy.modules(model, "rmsnorm")
    rows = policy.modules(model, "row")
    d_model = _width(norms[0][2]) if norms else (rows[0][2].out_features if rows else 0)
    counts = policy.head_count(model)
    heads = counts["heads"]
    head_name = "num_classes" if policy.loss == "classes" else "vocab_size"
    head, vocab, inputs = (policy.modules(model, role) for role in ("head", "vocab", "input"))
    pos = policy.modules(model, "positions")
    drops = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    return SimpleNamespace(
        d_model=d_model, n_heads=heads, d_ff=math.gcd(*cols) if cols else d_model,
        seq_len=pos[0][2].num_embeddings if pos else 0,
        outputs={head_name: head[-1][2].out_features} if head else {},  # the last, if a policy names several
        tables={"vocab_size": vocab[-1][2].num_embeddings} if vocab else {},
        inputs={"input features": inputs[-1][2].in_features} if inputs else {},
        kv={"n_kv_heads": counts["kv_heads"]} if counts["kv_heads"] != heads else {},
        dropout=max(drops, default=0.0), roles={r: p for p, r, _ in reversed(policy.modules(model))},
        tied=tuple(policy.tied))
