"""The policy part, rules only (``engine.checks.check_policy`` prepares the model before ``parallelize``): what
every part lowers (a policy that exists and fits the model, an attention some plan takes)."""
from __future__ import annotations

from ..part import Part, needs, rule
from . import missing_policy_message


@rule()
def needs_policy(c, f):
    if f.policy is None and (what := needs(c)):
        return missing_policy_message(f.name, what)
    return None


@rule()
def policy_fits(c, f):
    return f.policy_error if f.policy_error is not None and needs(c) else None


@rule(priced=True)
def attention_sinks(c, f):
    split = [f"{a}={getattr(c, a)}" for a in ("tp", "sp", "pp") if getattr(c, a) > 1]
    if not (f.sinks and split):
        return None
    return (f"{' and '.join(split)} with {f.name}: its attention (a learned sink per head, sliding-window layers "
            "among full ones, masks the model's own forward makes) has no tensor, sequence or pipeline plan in this "
            "version: set tp=1, sp=1 and pp=1 (dp, ep and ZeRO run it)")


@rule(priced=True)
def sliding_window(c, f):
    split = [f"{a}={getattr(c, a)}" for a in ("sp", "pp") if getattr(c, a) > 1]
    if not (f.window and split) or f.seq is None or f.seq <= f.window:
        return None  # the sequence unknown (boost): checked on the first batch (engine.batch.check_batch)
    return (f"{' and '.join(split)} with {f.name}: its attention looks back at most {f.window} tokens (a sliding "
            "window the model's own forward masks), and sequence and pipeline parallelism call the attention "
            f"without that mask: set the config's sliding_window=None if no sequence is longer than {f.window} "
            "tokens (then the two are the same), or use tp, dp and ZeRO, which run the model's own forward")


RULES = (needs_policy, policy_fits, attention_sinks, sliding_window)
"""This part's rules, in the order they are asked."""


PART = Part("policy", rules=RULES)
