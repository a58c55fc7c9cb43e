"""The pipeline part's rules: blocks over the stages, tied weights across ranks."""
from __future__ import annotations

from ...pipeline.plan import SCHEDULE_PLACEMENT, PipelinePlan
from ...pipeline.stage import check_stages
from .base import memo, raised, rule


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
