"""The shape of a rule (``engine.rules``; the parts that hold the rules: ``engine.parts``), and their helpers."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ...config import ConfigError, ParallelConfig
from ..facts import ModelFacts

__all__ = ["NotYet", "Rule", "rule", "sentence", "raised", "needs", "memo", "or_words"]


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


def memo(f: ModelFacts, key: tuple, compute):
    """``compute()``, kept with the facts under ``key`` (the config fields a rule reads): once per plan."""
    if key not in f.memo:
        f.memo[key] = compute()
    return f.memo[key]


def or_words(values) -> str:
    values = [str(v) for v in values]
    return " or ".join(values) if len(values) < 3 else ", ".join(values[:-1]) + " or " + values[-1]
