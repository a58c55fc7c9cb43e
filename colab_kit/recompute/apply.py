"""The recompute step of ``ck.parallelize`` (``colab_kit.engine.parallelize``): blocks that keep their input
only ("full"), blocks under per-op selective checkpointing ("op"), or attention cores that run again in
backward ("selective")."""
from __future__ import annotations

import torch.nn as nn

from . import recompute_blocks
from .op import recompute_ops
from .selective import recompute_attention

__all__ = ["apply_recompute"]


def apply_recompute(model: nn.Module, policy, config=None, sp_plan=None) -> int:
    """Activation recomputation as ``config.recompute`` asks (None: "full"). "full": each block the policy
    names keeps its input only and runs its forward again in backward (``colab_kit.recompute``).
    "selective": each attention's core runs again in backward (``colab_kit.recompute.selective``; under
    ring or Ulysses, ``sp_plan`` recomputes its own). "op": each block runs under per-op selective
    checkpointing, keeping its attention kernel's and every second matmul's outputs (``colab_kit.recompute.op``).

    Needs: the tensor and sequence steps (what is recomputed is what this rank runs). Must come before the
    pipeline split (the stages hold these same modules). Leaves: the blocks or cores recomputing; returns how
    many."""
    if config is not None and config.recompute == "selective":
        return recompute_attention(model, policy, sp_plan)
    if config is not None and config.recompute == "op":
        return recompute_ops(model, policy)
    return recompute_blocks(model, policy)
