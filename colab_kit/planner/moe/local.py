"""``ck.plan`` and ``ck.estimate`` of a mixture of experts on this machine (the measured constants).

The configs: what ``enumerate_configs`` gives for the model's facts (``engine.rules``, the rules ``boost``
applies: tp 1D only, without split_gather, and sp only with dropless layers), each again with every ``ep > 1``
that divides both dp x sp and the experts (what ``boost`` refuses is never proposed). The seconds: the local cost
model (``planner.local.step.step_seconds``) of the dense GPT a token sees, its MLP as wide as the experts it is
routed to and the shared ones (``top_k * d_expert + shared * d_expert``; under 1D tp ``tp`` times that, so
that a rank's tp share of it is the whole MoE layer's work, which every tp rank repeats), plus the dispatch
and combine all-to-alls of each MoE layer, forward and backward (4 per layer and microbatch, full
and per-op recomputation 2 more), of ``T k h`` values a rank (T = ``rows x seq / sp``: under sp each rank routes its own
tokens; tp does not divide them) at the measured all-to-all constants of ``ep`` ranks. The memory is the
engine's estimate (``memory.experts``).

Worked example, the MoE GPT of 4 experts and 2 blocks on 4 ranks: ``moe_configs`` keeps dp=4 with ep 1, 2 and 4,
dp=2 x pp=2 with ep 1 and 2 (pp=4 would need 4 blocks), the 1D tp layouts (tp=4, dp=2 x tp=2 with ep 1 and 2)
and the sp ones (ep over dp x sp), and none in 2D tp or split_gather::

    >>> from colab_kit.models import GPTConfig
    >>> g = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4)
    >>> sorted({(c.dp, c.pp, c.ep) for c in moe_configs(g, 4, 16) if c.tp == c.sp == 1})
    [(2, 2, 1), (2, 2, 2), (4, 1, 1), (4, 1, 2), (4, 1, 4)]
    >>> sorted({(c.dp, c.tp, c.sp, c.ep) for c in moe_configs(g, 4, 16) if c.pp == 1 and c.tp * c.sp > 1})[:6]
    [(1, 1, 4, 1), (1, 1, 4, 2), (1, 1, 4, 4), (1, 2, 2, 1), (1, 2, 2, 2), (1, 4, 1, 1)]
    >>> sorted({(c.tp_mode, c.sp_mode) for c in moe_configs(g, 4, 16) if c.tp > 1})  # no 2D, no split_gather
    [('1d', 'ring'), ('1d', 'ulysses')]
"""
from __future__ import annotations

import dataclasses

from ...engine.facts import ModelFacts
from ...engine.parts import first_refusal
from ...memory.estimator import stage_params
from ...memory.experts import moe_stage_params
from ...memory.formulas import PRECISION_BYTES, recompute_mode
from ...models import GPTConfig
from ...models.moe import moe_blocks
from ..configs import enumerate_configs
from ..local.comm import collective_seconds
from ..local.step import step_seconds

__all__ = ["moe_configs", "moe_step_seconds", "active_gpt"]


def moe_configs(model: GPTConfig, world_size: int, batch: int, precision: str = "fp32", with_auto: bool = False,
                facts: ModelFacts | None = None):
    """Every config ``boost`` runs for the MoE GPT ``model`` on ``world_size`` ranks (module docstring); ``facts``:
    the model's (``ModelFacts.of(model)`` by default)."""
    facts = facts if facts is not None else ModelFacts.of(model, seq=model.seq_len)
    for cfg in enumerate_configs(model, world_size, batch, precision, with_auto, facts=facts):
        yield cfg
        fold = cfg.dp * cfg.sp
        for ep in range(2, fold + 1):
            if fold % ep or model.n_experts % ep:
                continue
            moe = cfg.replace(ep=ep)
            if first_refusal(moe, facts) is None:
                yield moe


def active_gpt(model: GPTConfig, tp: int = 1) -> GPTConfig:
    """The dense GPT of what one token passes: its MoE MLPs as wide as its ``top_k`` experts and the shared ones
    (the router's ``E h`` and the dispatch are priced apart); under 1D tp ``tp`` times as wide, so that the
    cost model's tp share of it is the whole MoE MLP every tp rank runs."""
    width = tp * (model.top_k + model.shared_experts) * (model.d_expert or model.d_ff or 4 * model.d_model)
    d_ff = model.d_ff or 4 * model.d_model
    share = len(moe_blocks(model)) / model.n_layers  # the MoE blocks' share of the blocks
    return GPTConfig(vocab_size=model.vocab_size, seq_len=model.seq_len, d_model=model.d_model,
                     n_heads=model.n_heads, n_layers=model.n_layers, d_ff=round(share * width + (1 - share) * d_ff))


def moe_step_seconds(model: GPTConfig, cfg, batch: int, consts: dict, memory: dict, optimizer: str = "adamw"):
    """``(seconds, breakdown, collectives)`` of one step of the MoE GPT ``model`` under ``cfg`` (the module
    docstring): ``step_seconds`` of ``active_gpt(model)`` and the all-to-alls as ``comm:ep``."""
    active = dataclasses.replace(active_gpt(model, cfg.tp), seq_len=model.seq_len)
    # the gradients a rank reduces: every parameter it holds, its experts' too (at ep > 1 over edp, priced over
    # the dp x sp group: the ring's bytes a rank differ by (n - 1) / n only)
    held = max(sum(p) for p in moe_stage_params(model, cfg))
    scale = held / max(max(stage_params(active, cfg)), 1)
    seconds, parts, counts = step_seconds(active, cfg, batch, consts, memory, optimizer, grad_scale=scale)
    if cfg.ep <= 1:
        return seconds, parts, counts
    n_stages = cfg.pp * cfg.chunks
    layers = -(-len(moe_blocks(model)) // n_stages) * cfg.chunks  # the fullest rank's MoE blocks
    tokens = batch // (cfg.dp * cfg.microbatches) * model.seq_len // cfg.sp  # a rank's own (sp), all of them (tp)
    payload = tokens * model.top_k * model.d_model * PRECISION_BYTES[cfg.precision]
    per = 4 + (2 if recompute_mode(cfg.recompute) in ("full", "op") else 0)  # both replay the forward's two
    n = cfg.microbatches * layers * per
    ep = collective_seconds(consts, "all_to_all", payload, cfg.ep, n)
    return seconds + ep, {**parts, "comm:ep": ep}, {**counts, "comm:ep": n}
