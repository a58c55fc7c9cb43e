"""``check_policy``: every refusal ``boost`` makes for a model, in the kernel, before any process is touched.

It prepares the model as the policy says (a Hugging Face GPT-2's Conv1D -> nn.Linear, its routers counting the
load-balancing loss over the whole batch), reads the model's facts once (``engine.facts.ModelFacts``) and asks
the rules of every part (``engine.rules.first_refusal``: a missing policy where tp, pp, sp or recompute needs
one, paths the model lacks, sizes that do not divide, blocks that do not split over the stages, what a mode
cannot take yet), the very question the planner asks of its candidates. It lives in the engine's package,
beside ``boost`` which calls it.
"""
from __future__ import annotations

import torch.nn as nn

from ..config import ParallelConfig
from ..models.hf_moe import router_loss
from ..policy import policy_for
from ..policy.hf_moe import hf_moe_sizes
from ..sharded_init import defer
from .facts import ModelFacts
from .parts import first_refusal

__all__ = ["check_policy", "count_router_loss"]


def count_router_loss(model: nn.Module, policy) -> None:
    """A Hugging Face MoE model (its policy from ``policy.hf_moe``): make its routers count HF's load-balancing
    loss over the whole batch (``models.hf_moe.router_loss``; idempotent, nothing when the loss is off)."""
    if policy is not None and policy.experts and policy.name.startswith("hf-"):
        router_loss(model, policy.experts, *hf_moe_sizes(model))


def check_policy(model: nn.Module, config: ParallelConfig, policy=None):
    """The policy ``boost`` will lower for ``model`` (given, or the built-in one of its class; None where it has
    none), after every rule of every part has taken ``config`` for this model (``engine.rules``): a ConfigError
    with the rule and a value that works otherwise, before any process is touched."""
    policy = policy_for(model, policy)
    if policy is not None and policy.prepare is not None:  # e.g. a Hugging Face GPT-2's Conv1D -> nn.Linear
        defer(model)  # built on meta: each tensor's recipe by the names and layout the model came with
        policy.prepare(model)
    count_router_loss(model, policy)
    why = first_refusal(config, ModelFacts.of(model, policy))
    if why is not None:
        raise why
    return policy
