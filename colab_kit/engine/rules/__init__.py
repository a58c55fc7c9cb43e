"""What each parallel part refuses, given a config and the model's facts: one module per part, each with its
``RULES`` in the order they are asked; ``engine.parts`` puts them on the parts, in the parts' one order, and
asks them (``first_refusal``: what ``boost`` and the planner both ask).

A rule is a function ``(config, facts) -> message | NotYet | None`` (``base.rule``): ``facts`` is a
``ModelFacts`` (``engine.facts``: built from a module through its policy, a ``GPTConfig`` or a planner
``ModelShape``), or None where the model is not known yet (the config picker, ``boost``'s first look), and the
rules that read the model are then passed over. ``NotYet``: what this version of the engine does not run yet
(asked first, in every part). A config's own rules (a square tp for 2D, chunks for a schedule, ep dividing
dp x sp, offload with ZeRO) are ``ParallelConfig``'s, checked when it is built (``config.py``, the layer below
every part): no config that breaks them exists to be asked about.

Rules marked ``priced`` refuse what the engine cannot lower for a particular model (a Llama's RMSNorms under
split_gather, DeepSeek-V3's latent attention under tp); ``ck.estimate`` at a cluster preset prices such a layout
as the shape reads, saying so in its assumptions (the layouts of published runs), and ``ck.plan`` never proposes
it.
"""
from __future__ import annotations

from .base import NotYet, Rule, rule, sentence

__all__ = ["NotYet", "Rule", "rule", "sentence"]
