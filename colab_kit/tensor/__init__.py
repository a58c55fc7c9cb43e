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
- After backward, a parameter whose gradient is only partial on this rank (the same
  weight slice used by several batch shards) carries ``param._ck_grad_sum_axes``;
  ``sync_grads(module, mesh)`` sums those gradients over the named axes.

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

__all__ = ["block_collectives", "TensorPlan", "plan_for", "plan_class", "check_model", "linear_comm_bytes", "mark_grad_sum",
           "sync_grads"]


def mark_grad_sum(param: nn.Parameter, *axes: str) -> nn.Parameter:
    """Record that ``param``'s gradient must be summed over ``axes`` after backward."""
    param._ck_grad_sum_axes = tuple(axes)
    return param


def sync_grads(module: nn.Module, mesh) -> None:
    """Sum every marked parameter's gradient over its axes (see ``mark_grad_sum``).

    One flat all-reduce per axis: the marked gradients are packed, summed, unpacked.
    A parameter marked with two axes is summed over the first, then the second.
    """
    by_axis: dict[str, list[torch.Tensor]] = {}
    for p in module.parameters():
        for axis in getattr(p, "_ck_grad_sum_axes", ()):
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

    def parallelize(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


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


def check_model(model_cfg, config) -> None:
    """ConfigError, before any process runs, if ``model_cfg`` cannot be sharded by ``config``."""
    if config.tp > 1:
        from ..config import ConfigError
        from ..mesh import MeshLayout

        if getattr(model_cfg, "dropout", 0.0):
            raise ConfigError(
                f"dropout={model_cfg.dropout} with tensor parallelism (tp={config.tp}) needs the same dropout "
                "masks on ranks whose activations are copies and different ones where they are split (a "
                "Megatron-style RNG tracker), which colab_kit does not have yet: use dropout=0.0 with tp > 1, "
                "or dropout with dp / pp only")
        plan_class(config.tp_mode, config.sp_mode).check(model_cfg, MeshLayout(config))
