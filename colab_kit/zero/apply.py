"""The data-parallel step of ``ck.parallelize`` (``colab_kit.engine.parallelize``): plain dp or ZeRO 1-3."""
from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from ..config import Axis, ParallelConfig
from ..mesh import ProcessMesh
from ..placement import PlacementTable
from .optimizer import local_names
from .stage0 import GradientPart, DataParallel, reduction_axis
from .stage1 import ZeroStage1
from .stage2 import ZeroStage2
from .stage3 import ZeroStage3
from .split import ExpertSplit, split_experts

__all__ = ["apply_data_parallel"]


def apply_data_parallel(module: nn.Module, mesh: ProcessMesh, config: ParallelConfig, policy,
                        table: PlacementTable, events: list, *, bucket_bytes: int | None = None,
                        device_budget: int | None = None,
                        group_of_name: Callable[[str], int] | None = None) -> GradientPart:
    """Data parallelism over dp (over ``dp_sp``, the dp x sp block, with sequence parallelism:
    ``reduction_axis``): plain (buckets all-reduced during backward) or ZeRO stage 1, 2, 3 (``colab_kit.zero``),
    with offload where ``config.offload`` says.

    Needs: the final module (every other step done: its parameters are what the optimizer steps) and the
    placement table. Leaves: the gradient part (``GradientPart``); with ZeRO 1-2 the parameters moved into
    one flat buffer, with ZeRO 3 each block's parameters sharded and gathered around its use."""
    group_of = None
    if group_of_name is not None:
        names = local_names(module)
        group_of = lambda p: group_of_name(names[id(p)])  # noqa: E731
    axis = reduction_axis(config)  # dp, or dp x sp under sequence parallelism
    if config.zero == 3:
        return ZeroStage3(module, mesh, axis, events, offload=config.offload, device_budget=device_budget,
                          blocks=policy.block_list(module) if policy is not None else None,
                          tail=policy.tail_modules(module) if policy is not None else (),
                          placements=table, group_of=group_of, experts=config.ep > 1)
    if config.ep > 1:  # the experts over edp, the rest over dp (colab_kit.zero.split)
        dense, experts = split_experts(module.parameters(), table)
        parts = [_part(ps, mesh, over, config, bucket_bytes, events, table, group_of)
                 for ps, over in ((dense, axis), (experts, Axis.EDP))]
        return ExpertSplit(parts[0], parts[1], config.zero)
    return _part(module.parameters(), mesh, axis, config, bucket_bytes, events, table, group_of)


def _part(params, mesh, axis, config, bucket_bytes, events, table, group_of):
    if config.zero:
        part = ZeroStage2 if config.zero == 2 else ZeroStage1
        return part(params, mesh, axis, bucket_bytes, events, config.zero, offload=config.offload,
                    placements=table, group_of=group_of)
    return DataParallel(params, mesh, axis, bucket_bytes, events, placements=table)
