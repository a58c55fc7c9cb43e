"""The data-parallel part's rules (plain dp, ZeRO 1-3)."""
from __future__ import annotations

from .base import NotYet, rule


@rule(model=False, not_yet=True)
def zero3_pipeline(c, f):
    if c.zero == 3 and c.pp > 1:
        return NotYet("ZeRO stage 3 with pipeline parallelism", "zero=2 with pp (stage 3 would gather each stage's "
                      "parameters for every microbatch's forward and backward), or zero=3 with pp=1")
    return None


RULES = (zero3_pipeline,)
"""This part's rules, in the order they are asked."""
