"""The steps of ``parallelize``, one ``apply_<what>`` per parallel part, in the order it takes them.

Each says what it needs before it and what it leaves after it. They change the model in place where the
part does (a swapped class, a replaced layer) and return what the next steps read.
"""
from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from ..config import ParallelConfig
from ..mesh import ProcessMesh
from ..placement import PlacementTable
from ..zero.stage0 import GradientPart, ZeroStage0

__all__ = ["apply_dropout", "apply_tensor_parallel", "apply_sequence_parallel", "apply_recompute",
           "apply_pipeline_split", "apply_precision", "apply_data_parallel"]


def apply_dropout(model: nn.Module, policy) -> None:
    """Layout-invariant dropout: every ``nn.Dropout`` draws its mask from the global coordinates of each
    element, so that any split draws what one process draws (``colab_kit.models.dropout``).

    Needs: the dense model (before any part cuts it: the layers are numbered in the dense order).
    Leaves: the same modules, their dropout numbered (the ``DropoutLayout`` that says where this rank's
    elements sit is made after the tensor and sequence steps)."""
    from ..models.dropout import layout_invariant
    layout_invariant(model, policy=policy)


def apply_tensor_parallel(model: nn.Module, mesh: ProcessMesh, config: ParallelConfig, policy, token_loss=None):
    """Tensor parallelism in ``config.tp_mode`` (1d, 2d, 2.5d, 3d; split_gather's sequence cut with 1d).

    Needs: the dense model (deferred or real) and its policy. Leaves ``(model, plan)``: each matrix the policy
    names replaced by this rank's block of it (``colab_kit.tensor``), the loss over a vocabulary-parallel head
    exact (``token_loss.per_token``), and the plan that says how a batch is split over tp."""
    from ..tensor import plan_for
    plan = plan_for(mesh)
    model = plan.parallelize(model, policy)
    if token_loss is not None:
        token_loss.per_token = plan.token_losses
    return model, plan


def apply_sequence_parallel(model: nn.Module, mesh: ProcessMesh, config: ParallelConfig, policy):
    """Ring or Ulysses attention over the sp axis (``colab_kit.sequence``).

    Needs: the tensor step first (attention then runs on this rank's heads). Leaves ``(model, plan)``: each
    attention the policy names computing over this rank's tokens, the plan that cuts a batch's tokens."""
    from ..sequence.plan import SequencePlan
    plan = SequencePlan(mesh)
    return plan.parallelize(model, policy), plan


def apply_recompute(model: nn.Module, policy) -> int:
    """Activation recomputation: each block the policy names keeps its input only and runs its forward
    again in backward (``colab_kit.recompute``).

    Needs: the tensor and sequence steps (the blocks recompute what this rank runs). Must come before the
    pipeline split (the stages hold these same blocks). Leaves: the blocks recomputing; returns how many."""
    from ..recompute import recompute_blocks
    return recompute_blocks(model, policy)


def apply_pipeline_split(model: nn.Module, mesh: ProcessMesh, config: ParallelConfig, policy):
    """This pipeline rank's stages (``colab_kit.pipeline.stage``): ``pp * chunks`` stages cut on blocks.

    Needs: every step that changes a block (tensor, sequence, recompute), so each stage holds this rank's
    shards. Leaves ``(stages, tied)``: the stages this rank runs, and per weight tied across the first and
    last stage (a head tied to the token table) ``(shape, the parameter here or None)``."""
    from ..pipeline.stage import split_model, tied_across_ranks
    tied = tied_across_ranks(model, config, policy)
    stages = split_model(model, config, mesh.rank("pp"), policy)
    mine = {id(p) for st in stages for p in st.parameters()}
    return stages, [(tuple(t.shape), t if id(t) in mine else None) for t in tied]


def apply_precision(module: nn.Module, config: ParallelConfig, loss_fn: Callable) -> Callable:
    """Mixed precision (``colab_kit.precision``): the model in bf16 or fp16, the loss in fp32.

    Needs: the materialised module (its parameters real) and the broadcast (one starting point in fp32).
    Leaves: the module's floating tensors 16-bit; returns the loss computed in fp32. The fp32 master
    weights are the data-parallel step's (they follow its pieces)."""
    from ..precision import loss_in_fp32, to_compute_dtype
    to_compute_dtype(module, config.precision)
    return loss_in_fp32(loss_fn)


def apply_data_parallel(module: nn.Module, mesh: ProcessMesh, config: ParallelConfig, policy,
                        table: PlacementTable, events: list, *, bucket_bytes: int | None = None,
                        device_budget: int | None = None,
                        group_of_name: Callable[[str], int] | None = None) -> GradientPart:
    """Data parallelism over dp: plain (buckets all-reduced during backward) or ZeRO stage 1, 2, 3
    (``colab_kit.zero``), with offload where ``config.offload`` says.

    Needs: the final module (every other step done: its parameters are what the optimizer steps) and the
    placement table. Leaves: the gradient part (``GradientPart``); with ZeRO 1-2 the parameters moved into
    one flat buffer, with ZeRO 3 each block's parameters sharded and gathered around its use."""
    group_of = None
    if group_of_name is not None:
        from ..zero.optimizer import local_names
        names = local_names(module)
        group_of = lambda p: group_of_name(names[id(p)])  # noqa: E731
    if config.zero == 3:
        from ..zero.stage3 import ZeroStage3
        return ZeroStage3(module, mesh, "dp", events, offload=config.offload, device_budget=device_budget,
                          blocks=policy.block_list(module) if policy is not None else None,
                          placements=table, group_of=group_of)
    if config.zero:
        from ..zero import ZeroStage1, ZeroStage2  # stage 2 frees each bucket after its reduce-scatter
        part = ZeroStage2 if config.zero == 2 else ZeroStage1
        return part(module.parameters(), mesh, "dp", bucket_bytes, events, config.zero, offload=config.offload,
                    placements=table, group_of=group_of)
    return ZeroStage0(module.parameters(), mesh, "dp", bucket_bytes, events, placements=table)
