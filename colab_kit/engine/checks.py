"""``check_policy``: every refusal ``boost`` makes for a model, in the kernel, before any process is touched;
``unsupported`` and ``check_experts``, the parts of it the config picker and the planner ask by name.

It prepares the model as the policy says (a Hugging Face GPT-2's Conv1D -> nn.Linear, its routers counting the
load-balancing loss over the whole batch), reads the model's facts once (``engine.facts.ModelFacts``) and asks
the rules of every part (``engine.parts.first_refusal``: a missing policy where tp, pp, sp or recompute needs
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
from .parts import first_refusal, not_yet, part

__all__ = ["check_experts", "check_policy", "count_router_loss", "unsupported"]


def count_router_loss(model: nn.Module, policy) -> None:
    """A Hugging Face MoE model (its policy from ``policy.hf_moe``): make its routers count HF's load-balancing
    loss over the whole batch (``models.hf_moe.router_loss``; idempotent, nothing when the loss is off)."""
    if policy is not None and policy.experts and policy.name.startswith("hf-"):
        router_loss(model, policy.experts, *hf_moe_sizes(model))


def check_policy(model: nn.Module, config: ParallelConfig, policy=None):
    """The policy ``boost`` will lower for ``model`` (given, or the built-in one of its class; None where it has
    none), after every rule of every part has taken ``config`` for this model (the parts' ``RULES``): a ConfigError
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


def unsupported(config: ParallelConfig, model: nn.Module | None = None) -> str | None:
    """Why ``boost`` refuses a valid ``config`` today (the message of the ConfigError it raises), or None: what
    this version of the engine does not run yet (the parts' ``NotYet`` rules, all of them in one
    sentence). ``model``: the model it would train, where a refusal depends on it (mixture-of-experts layers).

    ConfigPicker shows the same text as "valid, not runnable yet"::

        unsupported(ParallelConfig(dp=2, tp=2))   # None: boost runs it
        unsupported(ParallelConfig(dp=2, pp=2, zero=3))  # "this version of the engine does not run ZeRO
                                  # stage 3 with pipeline parallelism yet (...): set zero=2 with pp (...)"

    ZeRO stage 3 with a pipeline is refused on purpose: each stage would gather its parameters
    for every microbatch's forward and backward (2 x microbatches all-gathers per step), or keep
    them whole through the step, which is stage 2's memory at stage 3's traffic.

    A model with mixture-of-experts layers (its policy's ``experts``) is refused under 2D/2.5D/3D tp and
    split_gather (they split a router's tokens over tp ranks the MoE step does not gather counts over), and with
    a capacity factor under sp (a rank's tokens are no run of the batch's order, which sets the capacity's
    priority); dropless layers run under sp (counts gathered over dp x sp). Under 1D tp every tp rank routes
    the same tokens, so the MoE layers run whole on each (tp does not split their work: ``docs/moe.md``). dp,
    ep, ZeRO 1-3, offload, pp and recomputation run them exactly (with ep and ZeRO 3, a block's experts are
    a second chunk over edp: ``colab_kit.zero.stage3``)::

        unsupported(ParallelConfig(sp=2), GPT(GPTConfig(n_experts=4, capacity_factor=1.0)))   # "... with a
                                  # capacity factor under sequence parallelism ...: set sp=1 (dp=2 ...) ..."
    """
    return not_yet(config, ModelFacts.of(model) if model is not None else None)


def check_experts(config: ParallelConfig, model: nn.Module) -> None:
    """The expert part's rules (``expert.part``): ``ep > 1`` needs a model whose MoE layers' experts it can split
    evenly (the built-in ``Experts``, or the fused experts of a Hugging Face MoE model its policy names), a Hugging
    Face load-balancing loss needs a policy that names the MoE layers, and MoE layers run under 1D tp without
    split_gather, and under sp only dropless: a ConfigError with the rule and a value that works otherwise::

        check_experts(ParallelConfig(dp=4, ep=4), GPT(GPTConfig(n_experts=6, ...)))
        # ConfigError: ep=4 splits each mixture-of-experts layer's 6 experts over 4 ranks, so it must divide
        # the number of experts: try ep=1 or 2 (it must also divide dp x sp = 4; ...)
    """
    why = part("expert").refuses(config, ModelFacts.of(model))
    if why is not None:
        raise why
