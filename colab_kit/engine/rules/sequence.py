"""The sequence part's rules (ring and Ulysses): heads, the policy's attentions, their scale, the sequence's split."""
from __future__ import annotations

from ...sequence.plan import LAYOUT, attention_refusal, scale_refusal
from ...sequence.ulysses import check_heads
from ...sequence.zigzag import check_length
from .base import NotYet, raised, rule


@rule(model=False, not_yet=True)
def sequence_tensor_1d(c, f):
    if c.sp > 1 and c.tp > 1 and c.tp_mode != "1d":
        return NotYet(f"sequence parallelism (sp={c.sp}) with tp_mode={c.tp_mode!r}", "tp_mode='1d' with sp, or sp=1")
    return None


@rule()
def ulysses_heads(c, f):  # every rank of the all-to-all gets whole heads of the tp rank's share
    if c.sp > 1 and c.sp_mode == "ulysses" and f.sizes is not None:
        return raised(check_heads, f.sizes.n_heads // c.tp, c.sp)
    return None


@rule()
def sequence_attention(c, f):
    return attention_refusal(f.policy, f.attends, f.sequence, f.bidirectional_hf) if c.sp > 1 else None


@rule(priced=True)
def attention_scale(c, f):
    return scale_refusal(*f.scale) if c.sp > 1 and f.scale is not None else None


@rule()
def sequence_length(c, f):  # the training sequence where the planner knows it; the engine's at its first step
    if c.sp > 1 and f.seq:
        return raised(check_length, f.seq, c.sp, LAYOUT[c.sp_mode])
    return None


RULES = (sequence_tensor_1d, ulysses_heads, sequence_attention, attention_scale, sequence_length)
"""This part's rules, in the order they are asked."""
