"""Global gradient-norm clipping: ``boost(..., max_grad_norm=1.0)`` clips by the norm of the whole model's
gradient, as ``torch.nn.utils.clip_grad_norm_`` does in one process.

Every rank sums the squares of the gradient elements its optimizer steps (``grads.optimizer_layout()``:
whole parameters, ZeRO's pieces, or their fp32 masters), each weighted so that an element held by several
ranks counts once: ``1 / size(axis)`` for every tensor axis the parameter is ``Replicate()`` on
(``engine.placement_table``), ``1 / (dp sp)`` when the gradients are copies over dp x sp (no ZeRO; ZeRO's
pieces are apart over dp x sp), ``1 / 2`` for each copy of a weight tied across two pipeline ranks; an expert
split over ep (``Shard(0)`` on ep) has copies on its edp group only: ``1 / edp`` without ZeRO. One all-reduce
of that number per mesh axis gives the global sum; then, as torch does, every gradient is multiplied by
``min(1, max_norm / (norm + 1e-6))``. With fp16 this runs after unscaling, and an overflowed
(skipped) step is not clipped.

Worked example, ``ParallelConfig(dp=2, tp=2)`` (1d), a block's ``fc1.weight`` split over tp and its
``ln1.weight`` whole on both tp ranks::

    rank 0: fc1.weight rows 0..7, sum of squares a0; ln1.weight b (weight 1/2 over tp, 1/2 over dp)
    rank 1: fc1.weight rows 8..15, a1;  ln1.weight b     -> each rank adds (a_i + b/2) / 2
    ranks 2, 3: the same as ranks 0, 1 (dp copies)       -> the sum over all four: a0 + a1 + b
"""
from __future__ import annotations

import math

import torch

from .. import comm
from ..config import Axis, ConfigError

__all__ = ["check_max_norm", "weights", "global_norm", "clip_"]


def check_max_norm(max_grad_norm) -> None:
    """Refuse a ``max_grad_norm`` that is not a positive finite number (None: no clipping)."""
    if max_grad_norm is None:
        return
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) \
            or not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
        raise ConfigError(f"max_grad_norm must be a positive number (the global gradient norm to clip to, e.g. 1.0), "
                          f"or None for no clipping; got {max_grad_norm!r}")


def weights(mesh, table, config, grads, tied) -> list[tuple[torch.Tensor, list[tuple[int, int, float]]]]:
    """Per optimizer tensor of ``grads`` (the gradient part), its runs ``(at, length, weight)``: where each
    parameter's elements lie in it and how much each counts in the global sum of squares (see the module
    docstring). ``table``: the placement table; ``tied``: the pipeline's tied pairs ``(shape, param or None)``."""
    axes = [a for a in mesh.layout.fine_names if a not in (Axis.PP, Axis.DP, Axis.SP) and mesh.size(a) > 1]
    tied_here = {id(p) for _, p in tied if p is not None}
    dp_copies = 1.0 / config.zero_ranks if config.zero == 0 else 1.0  # ZeRO: pieces apart over dp x sp
    out = []
    for t, runs in grads.optimizer_layout():
        mine = []
        for p, _start, length, at in runs:
            placed = table[p]
            copies = dp_copies
            if getattr(config, "ep", 1) > 1 and any(Axis.EP in on for _, on in placed.shards):
                copies = 1.0 / mesh.size(Axis.EDP) if config.zero == 0 else 1.0  # experts: copies over edp only
            w = copies * (0.5 if id(p) in tied_here else 1.0)
            for a in axes:
                if not any(a in shard_axes for _, shard_axes in placed.shards):
                    w /= mesh.size(a)
            mine.append((at, length, w))
        out.append((t, mine))
    return out


def global_norm(mesh, layout) -> float:
    """The global gradient norm from this rank's weighted sum of squares, summed over every mesh axis."""
    total = torch.zeros(1, dtype=torch.float64, device=mesh.device)
    for t, runs in layout:
        if t.grad is None:
            continue
        g = t.grad.detach().reshape(-1)
        for at, length, w in runs:
            total += w * g[at:at + length].double().pow(2).sum()
    for axis in (Axis.PP, Axis.DP, Axis.SP, Axis.TP):
        if mesh.size(axis) > 1:
            comm.all_reduce(total, mesh, axis, tag="grad norm")
    return float(total.sqrt().item())


def clip_(mesh, layout, max_norm: float) -> float:
    """Clip every gradient of ``layout`` (``weights(...)``, worked out once: the optimizer's tensors do not
    change) to the global ``max_norm``; returns the norm before clipping."""
    norm = global_norm(mesh, layout)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for t, _ in layout:
            if t.grad is not None:
                t.grad.mul_(coef)
    return norm
