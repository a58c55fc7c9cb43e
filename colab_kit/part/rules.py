"""The shape of a rule (each part's ``RULES``, in its ``part.py``; asked in the parts' order by ``engine.parts``),
and the helpers the rules share.

A rule is a function ``(config, facts) -> message | NotYet | None`` made a ``Rule`` by ``@rule(...)``. ``facts``
is a ``ModelFacts`` (``engine.facts``: built from a module through its policy, a ``GPTConfig`` or a planner
``ModelShape``; read here by attribute only, so the parts below the engine need not import it), or None where the
model is not known yet (the config picker, ``boost``'s first look): the rules that read the model are then passed
over. ``NotYet``: what this version of the engine does not run yet (asked first, in every part). A config's own
rules (a square tp for 2D, chunks for a schedule, ep dividing dp x sp, offload with ZeRO) are ``ParallelConfig``'s,
checked when it is built: no config that breaks them exists to be asked about.

Rules marked ``priced`` refuse what the engine cannot lower for a particular model (a Llama's RMSNorms under
split_gather, DeepSeek-V3's latent attention under tp); ``ck.estimate`` at a cluster preset prices such a layout
as the shape reads, saying so in its assumptions (the layouts of published runs), and ``ck.plan`` never proposes
it. Worked example (the zero part's one rule, which reads no model)::

    >>> from colab_kit import ParallelConfig
    >>> from colab_kit.zero.part import zero3_pipeline
    >>> zero3_pipeline.model, zero3_pipeline.not_yet, zero3_pipeline.check(ParallelConfig(dp=2), None)
    (False, True, None)
    >>> zero3_pipeline.check(ParallelConfig(dp=2, pp=2, zero=3, microbatches=2), None).what
    'ZeRO stage 3 with pipeline parallelism'
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ..config import ConfigError, ParallelConfig

__all__ = ["NotYet", "Rule", "broken", "rule", "sentence", "raised", "needs", "memo", "or_words"]


class NotYet(NamedTuple):
    """A layout this version of the engine does not run yet: ``what`` it is and the ``fix`` to set."""

    what: str
    fix: str


def sentence(items) -> str:
    """The refusal of one or more ``NotYet``: what this version does not run, and what to set instead."""
    whats = "; ".join(i.what for i in items)
    fixes = " ".join(i.fix for i in items)
    return (f"this version of the engine does not run {whats} yet (data, tensor and pipeline parallelism, "
            f"sequence parallelism, ZeRO stages 1 to 3, offload and mixed precision are what run today): set {fixes}")


@dataclass(frozen=True)
class Rule:
    """One rule: ``check(config, facts)`` gives a message (or a ``NotYet``) where the config breaks it."""

    check: Callable
    model: bool = True
    """It reads the model's facts (passed over where they are None)."""
    priced: bool = False
    """The engine cannot lower it for this model; the cost model prices it as the shape reads."""
    not_yet: bool = False
    """What this version does not run yet (asked first, in every part)."""

    @property
    def name(self) -> str:
        return self.check.__name__


def rule(*, model: bool = True, priced: bool = False, not_yet: bool = False):
    """Make a function ``(config, facts) -> message | NotYet | None`` a ``Rule``."""
    return lambda fn: Rule(fn, model, priced, not_yet)


def broken(rules, config: ParallelConfig, facts=None):
    """``(rule, why)`` of each of ``rules`` that ``config`` breaks for the model of ``facts``, in the order given;
    where ``facts`` is None the rules that read the model are passed over."""
    for r in rules:
        if not (r.model and facts is None):
            why = r.check(config, facts)
            if why is not None:
                yield r, why


def raised(fn, *args) -> str | None:
    """The message of the ConfigError ``fn(*args)`` raises (a part's own check), or None."""
    try:
        fn(*args)
    except ConfigError as e:
        return str(e)
    return None


def needs(c: ParallelConfig) -> str:
    """What in ``c`` needs a policy: tp, pp, sp, recomputation ("tp=2 and recompute=True")."""
    if c.tp == c.pp == c.sp == 1 and c.recompute == "none":
        return ""
    what = [f"{k}={getattr(c, k)}" for k in ("tp", "pp", "sp") if getattr(c, k) > 1]
    what += {"full": ["recompute=True"], "selective": ["recompute='selective'"],
             "op": ["recompute='op'"]}.get(c.recompute, [])
    return " and ".join(what)


def memo(f, key: tuple, compute):
    """``compute()``, kept with the facts ``f`` (a ``ModelFacts``) under ``key`` (the config fields a rule
    reads): once per plan."""
    if key not in f.memo:
        f.memo[key] = compute()
    return f.memo[key]


def or_words(values) -> str:
    values = [str(v) for v in values]
    return " or ".join(values) if len(values) < 3 else ", ".join(values[:-1]) + " or " + values[-1]
