"""Pipeline actions: the vocabulary every schedule is written in.

A schedule is data: for each pipeline rank, the ordered list of actions it runs in
one training step. An action names a stage, what to do and a microbatch, and prints
in a compact form that parses back::

    2F0    stage 2, forward of microbatch 0
    1B3    stage 1, full backward of microbatch 3 (input and weight gradients)
    1I3    stage 1, backward for the input gradient only (zero-bubble schedules)
    1W3    stage 1, weight-gradient part of that backward, run later
    2SF0   stage 2 sends its forward output of microbatch 0 to stage 3
    3RF0   stage 3 receives that activation from stage 2
    3SB0   stage 3 sends the gradient of its input of microbatch 0 to stage 2
    2RB0   stage 2 receives it

Compute actions (F, B, I, W) come from the schedule generators; the lowering pass
adds the communication actions (SF, RF, SB, RB). Stage ``s`` of ``pp * chunks``
stages is chunk ``s // pp`` of the pipeline rank ``PipelinePlan.rank_of(s)`` names: rank
``s % pp`` under the round-robin 'loop' placement (so with one chunk stage and
pipeline rank coincide), the V of ``zb-v`` sends the second chunk back up the ranks.
"""
from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["Action", "COMPUTE", "COMM", "parse", "format_actions"]

COMPUTE = ("F", "B", "I", "W")
COMM = ("SF", "RF", "SB", "RB")
_PATTERN = re.compile(r"^(\d+)(SF|RF|SB|RB|F|B|I|W)(\d+)$")


_KINDS = frozenset(COMPUTE + COMM)


class _Fields(NamedTuple):
    stage: int
    kind: str
    microbatch: int


class Action(_Fields):
    """One action of a rank's list: ``Action(stage, kind, microbatch)``, immutable, ordered and hashed as the tuple
    of its fields (a named tuple: plan checks build tens of thousands, a frozen dataclass took 4 us each)."""

    __slots__ = ()

    def __new__(cls, stage: int, kind: str, microbatch: int):
        if kind not in _KINDS:
            raise ValueError(f"unknown action kind {kind!r}: one of {', '.join(COMPUTE + COMM)}")
        return tuple.__new__(cls, (stage, kind, microbatch))

    @classmethod
    def _make(cls, iterable):  # type: ignore[override]  # the named tuple's other constructor checks the kind too
        return cls(*iterable)

    def _replace(self, **changes):
        return type(self)(**{**self._asdict(), **changes})

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"


def parse(text: str) -> Action | list[Action]:
    """``parse("2F0")`` -> Action; ``parse("0F0 0F1 0B0")`` -> list of Actions."""
    words = text.split()
    if len(words) != 1:
        return [parse_one(w) for w in words]
    return parse_one(text)


def parse_one(text: str) -> Action:
    """``parse_one("2F0")`` -> Action; anything but one action is a ValueError."""
    words = text.split()
    m = _PATTERN.match(words[0]) if len(words) == 1 else None
    if not m:
        raise ValueError(f"cannot read pipeline action {text!r}: write stage, kind, microbatch, e.g. 2F0 or 1SB3")
    return Action(int(m.group(1)), m.group(2), int(m.group(3)))


def format_actions(actions) -> str:
    return " ".join(str(a) for a in actions)
