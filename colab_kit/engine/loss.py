"""The loss of the correctness contract, and the engine's form of it that is exact however the batch is split.

``lm_loss`` is what one process computes: the mean token cross-entropy over every target that is not
-100. ``TokenLoss`` is what each rank computes for its piece of the batch so that the engine's mean
over pieces equals it (see its docstring for a worked example).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["lm_loss", "TokenLoss", "token_losses"]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, the loss of the correctness contract: over every target that is not
    -100 (``F.cross_entropy``'s ``ignore_index``); logits ``[b, t, V]`` with targets ``[b, t]``, or
    ``[b, C]`` with ``[b]`` (a classifier)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TokenLoss:
    """The engine's own ``lm_loss``, exact however the batch is split.

    Each piece of the global batch (a dp rank's microbatch, the rows of a tensor plan's batch axes,
    an sp rank's tokens) holds its own number of counted targets (not -100: a masked-LM batch predicts
    15% of its tokens, unevenly). A mean of the pieces' means would weigh them alike; instead each
    piece returns ``sum of its token losses * pieces / counted targets of the global batch``, which the
    engine's mean over pieces turns into the global batch's mean. The count is read off the global
    targets, which every rank has (no collective).

    Worked example, dp=2, 8 counted targets in the global batch: rank 0's rows hold 6, rank 1's 2;
    rank 0 returns ``sum_0 * 2 / 8``, rank 1 ``sum_1 * 2 / 8``; their mean is ``(sum_0 + sum_1) / 8``.
    """

    def __init__(self, per_token):
        self.per_token = per_token
        """``per_token(logits, targets)``: the cross-entropy of every token (vocab-parallel under tp)."""
        self.scale = None

    def count(self, targets: torch.Tensor, pieces: int) -> None:
        """Set this step's scale from the global batch's ``targets`` split into ``pieces``."""
        self.scale = pieces / max(int((targets != -100).sum()), 1)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        counted = targets != -100
        losses = torch.where(counted, self.per_token(logits, targets), 0.0)
        if self.scale is None:  # no global batch given: this piece's own mean
            return losses.sum() / counted.sum().clamp(min=1)
        return losses.sum() * self.scale


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of every token (``[b, t]`` or ``[b]``), 0 where the target is -100."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).clamp(min=0),
                           reduction="none").view(targets.shape)
