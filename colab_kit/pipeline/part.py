"""The pipeline part: this rank's stages (``apply_pipeline_split``), the tied weights' gradients summed over pp
before the optimizer, and its rules: blocks over the stages, tied weights across ranks."""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import comm
from ..config import Axis
from ..part import Build, Part, memo, raised, rule
from .apply import apply_pipeline_split
from .plan import SCHEDULE_PLACEMENT, PipelinePlan
from .stage import check_stages


@rule()
def pipeline_stages(c, f):
    if c.pp > 1 and f.policy is not None and f.policy_error is None:
        return raised(check_stages, f.layers, c)
    return None


@rule()
def tied_across_ranks(c, f):
    if not (c.pp > 1 and c.zero and f.tied):
        return None
    n = c.pp * c.chunks
    where = memo(f, ("placement", c.pp, c.chunks, c.schedule), lambda: PipelinePlan(
        c.pp, c.microbatches, c.chunks, c.schedule, placement=SCHEDULE_PLACEMENT[c.schedule]))
    if where.rank_of(0) == where.rank_of(n - 1):
        return None
    a, b = f.tied[0]
    return (f"{b} shares its weight with {a}, and pp={c.pp} with schedule={c.schedule!r} puts the first and the last "
            f"stage on different ranks, whose copies' gradients are summed before the step; ZeRO's flat pieces "
            f"(zero={c.zero}) place them differently on the two ranks, which this version does not sum yet: use "
            f"zero=0, schedule='zb-v' (both stages on one rank), or untie them")


RULES = (pipeline_stages, tied_across_ranks)
"""This part's rules, in the order they are asked."""


def apply(b: Build) -> None:  # this rank's stages
    b.stages, b.tied = apply_pipeline_split(b.model, b.mesh, b.config, b.policy)
    b.model = nn.ModuleList(b.stages)


def sum_tied(step, masters) -> None:
    """A weight the first and the last pipeline stage share (a head tied to the token table) has a copy on each
    of their ranks, each with the gradient of its own use: sum them over pp (the ranks between contribute
    zeros), so both copies take the same step and stay equal (Megatron's way)."""
    for shape, p in step.parts.tied:
        if p is None:  # the gradient's dtype: the fp32 masters', else the model's
            dtype = torch.float32 if masters is not None else {"fp32": torch.float32, "bf16": torch.bfloat16,
                                                               "fp16": torch.float16}[step.config.precision]
            g = torch.zeros(shape, dtype=dtype, device=step.mesh.device)
        elif masters is not None:
            master = masters.params[next(i for i, t in enumerate(masters.model) if t is p)]
            if master.grad is None:
                raise RuntimeError("a tied weight's fp32 master has no gradient after grads.finish()")
            g = master.grad
        else:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = g
        comm.all_reduce(g, step.mesh, Axis.PP, tag="tied grads")


PART = Part("pipeline_split", lambda c, _: c.pp > 1, RULES, apply, {"finish_grads": sum_tied})
