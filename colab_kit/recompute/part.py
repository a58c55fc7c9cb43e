"""The recompute part: blocks (``recompute="full"``), their matmuls and elementwise ops (``"op"``) or attention
cores (``"selective"``) run again in backward (``apply_recompute``). Its rules are ``ParallelConfig``'s (``"op"``
refused for 2D and 2.5D tp when the config is built)."""
from __future__ import annotations

from ..part import Build, Part
from .apply import apply_recompute


def apply(b: Build) -> None:  # blocks (or attention cores) recompute in backward
    apply_recompute(b.model, b.policy, b.config, b.sp_plan)


PART = Part("recompute", lambda c, _: c.recompute != "none", apply=apply)
