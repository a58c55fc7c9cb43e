"""The tensor step of ``ck.parallelize`` (``colab_kit.engine.parallelize``): this rank's blocks of each matrix."""
from __future__ import annotations

import torch.nn as nn

from ..config import ParallelConfig
from ..mesh import ProcessMesh
from . import plan_for

__all__ = ["apply_tensor_parallel"]


def apply_tensor_parallel(model: nn.Module, mesh: ProcessMesh, config: ParallelConfig, policy, token_loss=None):
    """Tensor parallelism in ``config.tp_mode`` (1d, 2d, 2.5d, 3d; split_gather's sequence cut with 1d).

    Needs: the dense model (deferred or real) and its policy. Leaves ``(model, plan)``: each matrix the policy
    names replaced by this rank's block of it (``colab_kit.tensor``), the loss over a vocabulary-parallel head
    exact (``token_loss.per_token``), and the plan that says how a batch is split over tp."""
    plan = plan_for(mesh)
    model = plan.parallelize(model, policy)
    if token_loss is not None:
        token_loss.per_token = plan.token_losses
    return model, plan
