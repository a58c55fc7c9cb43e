"""The expert part: this rank's experts with tokens sent to them (``apply_expert_parallel``), the auxiliary losses
the reported loss adds, DeepSeek's router bias after the optimizer; and its rules: where mixture-of-experts layers
run, their load-balancing loss, ep over their experts."""
from __future__ import annotations

from ..models.moe import update_router_bias
from ..part import Build, NotYet, Part, or_words, rule
from .apply import apply_expert_parallel


@rule(not_yet=True)
def moe_tokens(c, f):  # 2D/2.5D/3D and split_gather split a router's tokens over tp ranks
    if not (f.moe and c.tp > 1 and (c.tp_mode != "1d" or c.sp_mode == "split_gather")):
        return None
    also = " and split_gather" if c.sp_mode == "split_gather" else ""
    what = f"mixture-of-experts layers with tp_mode={c.tp_mode!r}{also} (which split the tokens a router sees over " \
           "the tp ranks)"
    return NotYet(what, "tp_mode='1d' without split_gather (each tp rank routes the same tokens: the MoE layers run "
                        "whole on every tp rank)")


@rule(not_yet=True)
def moe_capacity(c, f):
    if not (f.moe and c.sp > 1 and f.drops):
        return None
    return NotYet(f"mixture-of-experts layers with a capacity factor under sequence parallelism (sp={c.sp}: a rank's "
                  "tokens are not one run of the batch's order, which sets the capacity's priority)",
                  f"sp=1 (dp={c.dp * c.sp} runs the same ranks), or capacity_factor=None (dropless)")


@rule()
def router_loss(c, f):  # a Hugging Face load-balancing loss is counted on the MoE layers the policy names
    if not f.aux_coef or f.policy_experts:
        return None
    return (f"{f.name} adds a load-balancing loss (output_router_logits=True, router_aux_loss_coef={f.aux_coef}) "
            "that colab_kit does not count for this model (its policy names no MoE layers; built in: Mixtral, "
            "Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek-V3, GPT-OSS): set config.output_router_logits=False to train on "
            "the cross-entropy alone")


@rule()
def ep_experts(c, f):
    if c.ep == 1:
        return None
    if not f.experts:
        return (f"ep={c.ep} splits the experts of mixture-of-experts layers, and this model ({f.name}) has none its "
                "policy can find (stacked expert tensors, colab_kit.models.experts.Experts): set ep=1, or give the "
                "model MoE layers (GPTConfig(n_experts=8))")
    bad = [n for n in f.experts if n % c.ep]
    if not bad:
        return None
    fold = c.dp * c.sp
    ok = [k for k in range(1, fold + 1) if fold % k == 0 and all(n % k == 0 for n in f.experts)]
    most = f"; the most that divides both: try ep={ok[-1]}" if len(ok) > 1 else ""
    return (f"ep={c.ep} splits each mixture-of-experts layer's {bad[0]} experts over {c.ep} ranks, so it must divide "
            f"the number of experts: try ep={or_words(ok)} (it must also divide dp x sp = {fold}{most})")


RULES = (moe_tokens, moe_capacity, router_loss, ep_experts)
"""This part's rules, in the order they are asked."""


def apply(b: Build) -> None:  # this rank's experts, tokens sent to them
    apply_expert_parallel(b.model, b.mesh, b.config, b.policy)


def moe_step(step, microbatch: int):  # the microbatch's MoEStep: counts over its ranks, losses into backward
    return step.moe_at(microbatch)


def aux_losses(step, local):  # this rank's share of the auxiliary losses: their mean over ranks is one process's
    return local + step.aux_value() if step.moe else local


def router_bias(step, done) -> None:  # DeepSeek's bias, from the step's load (the same on every dp rank)
    if step.moe:  # kept on a skipped step
        update_router_bias(step.parts.module, skip=done["skipped"])


PART = Part("expert", lambda c, _: c.ep > 1, RULES, apply,
            {"microbatch": moe_step, "loss": aux_losses, "after_optimizer": router_bias})
