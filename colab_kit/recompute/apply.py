"""The recompute step of ``ck.parallelize`` (``colab_kit.engine.parallelize``): blocks that keep their input only."""
from __future__ import annotations

import torch.nn as nn

from . import recompute_blocks

__all__ = ["apply_recompute"]


def apply_recompute(model: nn.Module, policy) -> int:
    """Activation recomputation: each block the policy names keeps its input only and runs its forward
    again in backward (``colab_kit.recompute``).

    Needs: the tensor and sequence steps (the blocks recompute what this rank runs). Must come before the
    pipeline split (the stages hold these same blocks). Leaves: the blocks recomputing; returns how many."""
    return recompute_blocks(model, policy)
