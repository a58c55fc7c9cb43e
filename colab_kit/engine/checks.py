"""``check_policy``: the policy ``boost`` will lower for a model, checked against a config in the kernel.

Before any process is touched: a missing policy where tp, pp, sp or recompute needs one, paths the
model lacks or of the wrong kind, sizes that do not divide (``tensor.check_model``), blocks that do not
split over the pipeline's stages, and what a mode cannot take yet (each with the rule and what works).
It asks each part (tensor, sequence, pipeline) whether the model fits it, so it lives above them, in the
engine's package, beside ``boost`` which calls it.
"""
from __future__ import annotations

import torch.nn as nn

from ..config import ConfigError, ParallelConfig
from ..pipeline.plan import SCHEDULE_PLACEMENT, PipelinePlan
from ..pipeline.stage import check_stages
from ..models.hf_moe import router_loss
from ..policy import missing_policy_message, policy_for
from ..policy.hf_moe import hf_moe_sizes
from ..sequence.plan import SequencePlan
from ..sharded_init import defer
from ..tensor import check_model, model_sizes

__all__ = ["check_policy", "count_router_loss"]


def count_router_loss(model: nn.Module, policy) -> None:
    """A Hugging Face MoE model (its policy from ``policy.hf_moe``): make its routers count HF's load-balancing
    loss over the whole batch (``models.hf_moe.router_loss``; idempotent, nothing when the loss is off)."""
    if policy is not None and policy.experts and policy.name.startswith("hf-"):
        router_loss(model, policy.experts, *hf_moe_sizes(model))


def check_policy(model: nn.Module, config: ParallelConfig, policy=None):
    """The policy ``boost`` will lower for ``model`` (given, or the built-in one of its class), checked
    against ``config`` in the kernel, before any process is touched: a missing policy where tp, pp, sp or
    recompute needs one, paths the model lacks, sizes that do not divide, blocks that do not split."""
    policy = policy_for(model, policy)
    if policy is not None and policy.prepare is not None:  # e.g. a Hugging Face GPT-2's Conv1D -> nn.Linear
        defer(model)  # built on meta: each tensor's recipe by the names and layout the model came with
        policy.prepare(model)
    count_router_loss(model, policy)
    needs = [f"{k}={getattr(config, k)}" for k in ("tp", "pp", "sp") if getattr(config, k) > 1]
    needs += {"full": ["recompute=True"], "selective": ["recompute='selective'"],
              "op": ["recompute='op'"]}.get(config.recompute, [])
    if policy is None:
        if needs:
            raise ConfigError(missing_policy_message(model, " and ".join(needs)))
        return None
    if not needs:
        return policy
    policy.check(model)
    if config.tp > 1:
        check_model(model, config, policy)
    if config.sp > 1:  # ulysses: heads per tensor rank must divide by sp
        SequencePlan.check(model_sizes(model, policy), config)
        SequencePlan.check_policy(model, policy, config)
    if config.pp > 1:
        check_stages(len(policy.block_list(model)), config)
        n = config.pp * config.chunks
        where = PipelinePlan(config.pp, config.microbatches, config.chunks, config.schedule,
                     placement=SCHEDULE_PLACEMENT[config.schedule])
        if policy.tied and where.rank_of(0) != where.rank_of(n - 1) and config.zero:
            a, b = policy.tied[0]
            raise ConfigError(f"{b} shares its weight with {a}, and pp={config.pp} with schedule="
                              f"{config.schedule!r} puts the first and the last stage on different ranks, whose "
                              f"copies' gradients are summed before the step; ZeRO's flat pieces (zero="
                              f"{config.zero}) place them differently on the two ranks, which this version does "
                              f"not sum yet: use zero=0, schedule='zb-v' (both stages on one rank), or untie them")
    return policy
