"""The dropout part: masks from each element's global coordinates (``apply_dropout``), so a parallel layout draws
the dense model's masks. Wanted where the model has dropout; no rules (it runs under every layout)."""
from __future__ import annotations

from contextlib import nullcontext

from ..part import Build, Part
from .apply import apply_dropout


def apply(b: Build) -> None:  # masks from global coordinates
    b.undo = apply_dropout(b.model, b.policy)


def at(step, microbatch: int):  # the microbatch's coordinates: (step, microbatch) draws the dense model's masks
    drop = step.parts.dropout
    return drop.at(step.records.count, microbatch) if drop is not None else nullcontext()


PART = Part("dropout", lambda c, dropout: dropout, apply=apply, hooks={"microbatch": at})
