"""Cross-entropy over logits split along the vocabulary, without gathering them.

Megatron-LM's vocab-parallel cross-entropy: each rank of the ``axis`` group holds
``V / n`` columns of the logits. Three all-reduces of one number per token give the
exact loss: the max (for stability), the sum of exponentials and the target's logit
(found on the one rank that owns that vocabulary slice).

Worked example, V = 8 over n = 2 ranks, one token with target 5::

    rank 0 holds logits[0:4], rank 1 logits[4:8]
    max      = all_reduce_max(local max)            -> same on both
    sum_exp  = all_reduce_sum(sum exp(local - max))
    target   = all_reduce_sum(rank 1: logits[5] - max, rank 0: 0)
    loss     = log(sum_exp) - target                -> same on both ranks

Backward needs no communication: the gradient of each local column is
``softmax - onehot`` on that column.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["vocab_parallel_cross_entropy"]


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, mesh, axis, vocab_start):
        logits = logits.float()
        local_v = logits.shape[-1]
        peak = logits.max(dim=-1).values
        comm.all_reduce(peak, mesh, axis, op=dist.ReduceOp.MAX, tag="cross-entropy max")
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        local_t = targets - vocab_start
        mine = (local_t >= 0) & (local_t < local_v)
        idx = local_t.clamp(0, local_v - 1)
        target_logit = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine
        both = torch.stack([sum_exp, target_logit])
        comm.all_reduce(both, mesh, axis, tag="cross-entropy sums")
        sum_exp, target_logit = both[0], both[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), idx, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mesh, axis: str,
                                 vocab_start: int) -> torch.Tensor:
    """Per-token losses ``[...]`` from vocab-split ``logits [..., V/n]`` and global ``targets [...]``."""
    if mesh.size(axis) == 1:
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten(),
                                                 reduction="none").view(targets.shape)
    return VocabParallelCrossEntropy.apply(logits, targets, mesh, axis, vocab_start)
