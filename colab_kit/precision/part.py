"""The precision part: a 16-bit model with the loss in fp32 (``apply_precision``); the fp32 masters and the loss
scale are the data-parallel part's optimizer's. No rules of its own (``ParallelConfig`` checks the names)."""
from __future__ import annotations

from ..part import Build, Part
from .apply import apply_precision


def apply(b: Build) -> None:  # a 16-bit model, the loss in fp32
    b.loss = apply_precision(b.module, b.config, b.loss)


PART = Part("precision", lambda c, _: c.precision != "fp32", apply=apply)
