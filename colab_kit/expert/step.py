"""What a training step does for mixture-of-experts layers, per microbatch: its ``MoEStep`` (the context its
forward, backward and recomputation run in), the gather of its routing counts over the ranks that hold its
tokens, and this rank's share of the auxiliary losses the reported loss adds (``engine.parts``' expert hooks
read it). A mixin of ``engine.step.TrainingStep``, whose ``config``, ``mesh``, ``scaler``, ``loss_shards``,
``moe`` and ``_moe_steps`` it reads.

Worked example, ``ParallelConfig(dp=2, sp=2)`` with an MoE GPT, on the rank of dp 1, sp 0: microbatch 0's
``MoEStep`` gathers its counts from the 4 ranks in (dp, sp) order, this rank's piece being 2, and injects its
auxiliary losses into backward at ``1 / (microbatches x loss_shards)`` of the fp16 scale.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from ..config import Axis
from .. import comm
from ..models import moe_context

__all__ = ["ExpertSteps"]


class ExpertSteps:
    """The MoE part of ``TrainingStep`` (module docstring)."""

    if TYPE_CHECKING:  # what TrainingStep gives it
        config: Any
        mesh: Any
        scaler: Any
        moe: bool
        _moe_steps: dict

        @property
        def loss_shards(self) -> int: ...

    def moe_at(self, microbatch: int):
        """With MoE layers, the context of ``microbatch``'s ``MoEStep`` (``moe_step``); else nothing."""
        return moe_context.at(self.moe_step(microbatch)) if self.moe else nullcontext()

    def moe_step(self, microbatch: int) -> moe_context.MoEStep:
        """The ``colab_kit.models.moe_context.MoEStep`` of ``microbatch`` (made at its forward, or when a
        pipeline message brings its counts; the same at its backward and recomputation): its counts gathered
        over dp and sp, its auxiliary losses injected into backward at the scale of the loss (1 / microbatches,
        the fp16 scale, the shards)."""
        step = self._moe_steps.get(microbatch)
        if step is None:
            scale = (self.scaler.scale if self.scaler is not None else 1.0) / (self.config.microbatches
                                                                                * self.loss_shards)
            sp = self.config.sp
            step = self._moe_steps[microbatch] = moe_context.MoEStep(
                gather=self._gather_pieces, piece=self.mesh.rank(Axis.DP) * sp + self.mesh.rank(Axis.SP),
                pieces=self.config.dp * sp, grad_scale=scale)
        return step

    def _gather_pieces(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` of every rank holding tokens of the microbatch, ``[dp * sp, *t.shape]`` in (dp, sp) order: over
        sp (a row's tokens), then over dp (the rows)."""
        t = comm.all_gather(t[None], self.mesh, Axis.SP, tag="moe counts") if self.config.sp > 1 else t[None]
        return comm.all_gather(t[None], self.mesh, Axis.DP, tag="moe counts").flatten(0, 1)

    @property
    def moe_steps(self) -> list[moe_context.MoEStep]:
        """This step's ``MoEStep`` of each microbatch so far (with MoE layers), in the order they were made."""
        return list(self._moe_steps.values())

    def aux_value(self) -> torch.Tensor | float:
        """This rank's share of the step's auxiliary losses (each microbatch's over ``microbatches``): what the
        reported loss adds to the token loss."""
        m = self.config.microbatches
        return sum((v for s in self._moe_steps.values() for v in s.values.values()), 0.0) / m
