"""The dropout step of ``ck.parallelize`` (``colab_kit.engine.parallelize``): layout-invariant dropout."""
from __future__ import annotations

import torch.nn as nn

from ..models.dropout import layout_invariant

__all__ = ["apply_dropout"]


def apply_dropout(model: nn.Module, policy) -> list:
    """Layout-invariant dropout: every ``nn.Dropout`` draws its mask from the global coordinates of each
    element, so that any split draws what one process draws (``colab_kit.models.dropout``).

    Needs: the dense model (before any part cuts it: the layers are numbered in the dense order).
    Leaves: the same modules, their dropout numbered (the ``DropoutLayout`` that says where this rank's
    elements sit is made after the tensor and sequence steps). Returns the calls that undo what it changed
    on the user's modules (``Parallelized.restore``)."""
    undo: list = []
    layout_invariant(model, policy=policy, undo=undo)
    return undo
