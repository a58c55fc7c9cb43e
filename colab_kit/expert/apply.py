"""The expert step of ``ck.parallelize`` (``colab_kit.engine.parallelize``): experts split over ep."""
from __future__ import annotations

import torch.nn as nn

from ..config import Axis, ParallelConfig
from ..mesh import ProcessMesh
from ..models.experts import Experts
from .hf import HFExpertParallel, is_fused_experts
from .layer import ExpertParallel

__all__ = ["apply_expert_parallel", "expert_modules", "expert_count"]


def expert_modules(model: nn.Module, policy) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, child name, experts)`` of every mixture-of-experts layer the policy names (``policy.experts``:
    the layers' paths; the stacked expert tensors are the ``Experts`` module inside each, or a Hugging Face
    model's fused experts, ``colab_kit.expert.hf``)."""
    out = []
    for path in getattr(policy, "experts", ()) if policy is not None else ():
        layer = model.get_submodule(path)
        for parent in layer.modules():
            for name, child in parent.named_children():
                if isinstance(child, Experts) or is_fused_experts(child):
                    out.append((parent, name, child))
    return out


def expert_count(module: nn.Module) -> int:
    """The experts of one ``expert_modules`` entry (dim 0 of its stacked tensors)."""
    return module.n if isinstance(module, Experts) else int(module.get_parameter("gate_up_proj").shape[0])


def apply_expert_parallel(model: nn.Module, mesh: ProcessMesh, config: ParallelConfig, policy) -> list[nn.Module]:
    """Each MoE layer's experts cut to this rank's ``E / ep`` (``Shard(0)`` on ep) with the all-to-all dispatch
    around them (``colab_kit.expert.layer``; a Hugging Face model's fused experts: ``colab_kit.expert.hf``).

    Needs: the tensor and sequence steps first (none applies to an MoE model today) and the layers still in
    the whole model (before the pipeline split: another stage's experts are cut too, still meta, and dropped
    with the stage). Leaves: the ``ExpertParallel`` modules in place of the ``Experts``, declared ``Shard(0)``
    on ep; the data-parallel step sums their gradients over edp (``colab_kit.zero.apply``)."""
    made: list[nn.Module] = []
    for i, (parent, name, experts) in enumerate(expert_modules(model, policy)):
        layer = ExpertParallel(experts, mesh, Axis.EP) if isinstance(experts, Experts) else HFExpertParallel(
            experts, mesh, Axis.EP, layer=i)
        setattr(parent, name, layer)
        made.append(layer)
    return made
