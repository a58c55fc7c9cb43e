"""The sequence part: attention on this rank's tokens (``apply_sequence_parallel``), and its rules (ring and
Ulysses): heads, the policy's attentions, their scale, the sequence's split."""
from __future__ import annotations

from ..part import Build, NotYet, Part, raised, rule
from .apply import apply_sequence_parallel
from .plan import LAYOUT, attention_refusal, scale_refusal
from .ulysses import check_heads
from .zigzag import check_length


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


def apply(b: Build) -> None:  # attention on this rank's tokens
    b.model, b.sp_plan = apply_sequence_parallel(b.model, b.mesh, b.config, b.policy)


PART = Part("sequence", lambda c, _: c.sp > 1, RULES, apply)
