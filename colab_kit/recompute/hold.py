"""``_Hold``: the identity that lets the activation meter see what a checkpoint keeps in its closure."""
from __future__ import annotations

import torch

__all__ = ["_Hold"]


class _Hold(torch.autograd.Function):
    """Identity that saves its input for backward (and never reads it): the saved-tensor
    hooks outside a checkpointed region see the tensor the region keeps (its input, held by
    ``torch.utils.checkpoint``'s closure, out of their sight)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g
