"""The dropout part: masks from each element's global coordinates (``apply_dropout``), so a parallel layout draws
the dense model's masks. Wanted where the model has dropout; no rules (it runs under every layout)."""
from __future__ import annotations

from ..part import Build, Part
from .apply import apply_dropout


def apply(b: Build) -> None:  # masks from global coordinates
    b.undo = apply_dropout(b.model, b.policy)


PART = Part("dropout", lambda c, dropout: dropout, apply=apply)
