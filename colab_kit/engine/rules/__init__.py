"""The rules in one place: what each parallel part refuses, given a config and the model's facts.

``boost`` (through ``check_policy``, in the kernel, before any process group) and the planner (``ck.plan`` on
this machine and at a preset, ``ck.estimate``) ask the same question, ``first_refusal(config, facts)``, so the
planner never proposes what ``boost`` refuses. ``facts`` is a ``ModelFacts`` (``engine.facts``: built from a
module through its policy, a ``GPTConfig`` or a planner ``ModelShape``), or None where the model is not known
yet (the config picker, ``boost``'s first look): the rules that read the model are then passed over.

Each part has a ``name`` (its step of ``ck.parallelize``) and ``refuses(config, facts) -> ConfigError | None``;
its ``rules`` are functions ``(config, facts) -> message | NotYet | None``, in order. ``first_refusal`` asks first
what this version of the engine does not run yet, in every part (``NotYet``: the sentence ``engine.unsupported``
has always given, all of them in one when several apply), then each part's other rules in the parts' order.
A config's own rules (a square tp for 2D, chunks for a schedule, ep dividing dp x sp, offload with ZeRO) are
``ParallelConfig``'s, checked when it is built (``config.py``, the layer below every part): no config that
breaks them exists to be asked about.

Rules marked ``priced`` refuse what the engine cannot lower for a particular model (a Llama's RMSNorms under
split_gather, DeepSeek-V3's latent attention under tp); ``ck.estimate`` at a cluster preset prices such a layout
as the shape reads, saying so in its assumptions (the layouts of published runs), and ``ck.plan`` never proposes
it. Worked example::

    >>> from colab_kit import ParallelConfig
    >>> from colab_kit.models import GPTConfig
    >>> f = ModelFacts.of(GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=4))
    >>> first_refusal(ParallelConfig(dp=2, tp=4), f) is None
    True
    >>> str(first_refusal(ParallelConfig(pp=3, dp=2), f))[:58]
    'n_layers=4 does not split evenly over pp*chunks = 3*1 = 3 '
    >>> [(p.name, r.name) for p, r, _ in refusals(ParallelConfig(tp=8), f)]
    [('tensor', 'tensor_sizes')]
"""
from __future__ import annotations

from collections.abc import Iterator

from ...config import ConfigError, ParallelConfig
from ..facts import ModelFacts
from .base import NotYet, Part, Rule, sentence
from .expert import ep_experts, moe_capacity, moe_tokens, router_loss
from .pipeline import pipeline_stages, tied_across_ranks
from .policy import attention_sinks, needs_policy, policy_fits
from .sequence import attention_scale, sequence_attention, sequence_length, sequence_tensor_1d, ulysses_heads
from .tensor import attention_heads, split_gather_1d, split_gather_layers, tensor_sizes
from .zero import zero3_pipeline

__all__ = ["Part", "Rule", "NotYet", "PARTS", "first_refusal", "refusals", "not_yet", "part"]

PARTS: tuple[Part, ...] = (
    Part("policy", (needs_policy, policy_fits, attention_sinks)),
    Part("dropout"),
    Part("tensor", (split_gather_1d, attention_heads, split_gather_layers, tensor_sizes)),
    Part("sequence", (sequence_tensor_1d, ulysses_heads, sequence_attention, attention_scale, sequence_length)),
    Part("expert", (moe_tokens, moe_capacity, router_loss, ep_experts)),
    Part("recompute"),
    Part("pipeline_split", (pipeline_stages, tied_across_ranks)),
    Part("precision"),
    Part("data_parallel", (zero3_pipeline,)),
)
"""The parts in ``ck.parallelize``'s order, each with its rules in order ("policy": what every part lowers)."""

_ORDER = tuple((p, r) for first in (True, False) for p in PARTS for r in p.rules if r.not_yet == first)


def part(name: str) -> Part:
    """The part called ``name`` (``part("expert").refuses(config, facts)``)."""
    return next(p for p in PARTS if p.name == name)


def refusals(config: ParallelConfig, facts: ModelFacts | None = None) -> Iterator[tuple[Part, Rule, str]]:
    """``(part, rule, message)`` of every rule ``config`` breaks, in ``first_refusal``'s order."""
    for p, r in _ORDER:
        if r.model and facts is None:
            continue
        why = r.check(config, facts)
        if why is not None:
            yield p, r, sentence([why]) if isinstance(why, NotYet) else why


def not_yet(config: ParallelConfig, facts: ModelFacts | None = None) -> str | None:
    """What this version of the engine does not run of ``config`` (for the model of ``facts``), in one sentence
    with what to set instead, or None (``engine.unsupported``)."""
    items = [why for _, r in _ORDER if r.not_yet and not (r.model and facts is None)
             for why in (r.check(config, facts),) if why is not None]
    return sentence(items) if items else None


def first_refusal(config: ParallelConfig, facts: ModelFacts | None = None) -> ConfigError | None:
    """The ConfigError ``boost`` raises for ``config`` and the model of ``facts`` before any process starts (the
    rule broken and a value that works), or None where every part takes it."""
    for _, r in _ORDER:
        if r.model and facts is None:
            continue
        why = r.check(config, facts)
        if why is not None:
            return ConfigError(not_yet(config, facts) if isinstance(why, NotYet) else why)
    return None
