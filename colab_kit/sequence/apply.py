"""The sequence step of ``ck.parallelize`` (``colab_kit.engine.parallelize``): ring or Ulysses attention."""
from __future__ import annotations

import torch.nn as nn

from ..config import ParallelConfig
from ..mesh import ProcessMesh
from .plan import SequencePlan

__all__ = ["apply_sequence_parallel"]


def apply_sequence_parallel(model: nn.Module, mesh: ProcessMesh, config: ParallelConfig, policy):
    """Ring or Ulysses attention over the sp axis (``colab_kit.sequence``).

    Needs: the tensor step first (attention then runs on this rank's heads). Leaves ``(model, plan)``: each
    attention the policy names computing over this rank's tokens, the plan that cuts a batch's tokens."""
    plan = SequencePlan(mesh)
    return plan.parallelize(model, policy), plan
