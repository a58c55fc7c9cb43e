"""``ck.parallelize(model, mesh, config)``: the ordered steps that turn a dense model into this rank's share.

``boost`` is ``parallelize`` (what this rank holds) plus the optimizer over it plus the one training step
(``colab_kit.engine.step``). ``parallelize`` is a loop over ``engine.parts.PARTS``, the one place the order is
written: each part's step runs where the config wants it, and is an ``apply_<what>(model, mesh, config, ...)``
in its own part's package (``colab_kit/<part>/apply.py``), whose docstring says what it needs before it and what
it leaves after it. Adding a mode means adding one part.

Worked example: ``ParallelConfig(dp=2, tp=2, pp=2)`` (8 ranks), a 4-block GPT built on every rank, on rank 5
(coordinates pp 1, dp 0, tp 1)::

    parts = ck.parallelize(GPT(cfg), mesh, config)
    parts.steps      # ('defer_init', 'tensor', 'pipeline_split', 'materialize', 'placements', 'broadcast',
                     #  'data_parallel')
    parts.stages     # [stage 1]: blocks 2-3, ln_f and the head, each matrix cut in halves over tp (this half: 1)
    parts.placement_table[parts.module.0.blocks...weight]   # tp: Shard(0) or Shard(1), dp: Replicate()
    parts.data_parallel      # DataParallel: the dp buckets over this rank's 1/2 x 1/2 of the model

A step that the config does not ask for is left out of ``parts.steps`` (``plan_steps(config)`` lists them
without a model; ``tests/unit/test_parallelize.py`` prints the list for every config of the parity matrix, and
the rank tests check that each engine took exactly those).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import torch
import torch.nn as nn

from ..config import ParallelConfig
from ..mesh import ProcessMesh
from ..placement import PlacementTable
from ..zero.stage0 import GradientPart
from .loss import TokenLoss, lm_loss, token_losses
from .options import BoostOptions
from ..dropout import DropoutLayout
from ..models.dropout import has_dropout
from .parts import PARTS, Build, plan_steps

__all__ = ["parallelize", "Parallelized", "plan_steps", "STEPS"]

STEPS = tuple(p.name for p in PARTS if p.apply is not None)
"""Every step ``parallelize`` may take, in the order it takes them (the parts' names: ``engine.parts``)."""


@dataclass
class Parallelized:
    """What ``parallelize`` leaves on this rank: the module it runs and the parts that transformed it."""

    config: ParallelConfig
    mesh: ProcessMesh
    module: nn.Module
    """This rank's model (with pp: an ``nn.ModuleList`` of this rank's stages), on the mesh's device."""
    dense_twin: nn.Module
    """The dense model on the meta device: names and shapes only (checkpoints map elements to it)."""
    policy: Any
    """The ``colab_kit.policy.Policy`` the parts lowered (None: a model under dp / ZeRO only)."""
    loss_fn: Callable
    """``(outputs, targets) -> loss`` of one microbatch's rows, as this layout computes it."""
    data_parallel: GradientPart
    """Plain dp or ZeRO stage 1-3: gradient sync and what the optimizer steps (``colab_kit.zero``)."""
    placement_table: PlacementTable
    events: list[dict]
    """The step's timeline, written by the gradient part and the step (``engine.timeline()``)."""
    logits: Callable = staticmethod(lambda out: out)
    token_loss: TokenLoss | None = None
    tp_plan: Any = None
    sp_plan: Any = None
    dropout: Any = None
    """With dropout in the model: the ``DropoutLayout`` (where this rank's tensors sit)."""
    stages: list | None = None
    tied: list[tuple[tuple, torch.Tensor | None]] = field(default_factory=list)
    """With pp: per weight shared by the first and last stage, ``(shape, the parameter here or None)``."""
    n_local: int = 0
    """Elements this rank trains before ZeRO splits them (the estimate of another model reads it)."""
    steps: tuple[str, ...] = ()
    """The steps taken, in order (``plan_steps(config)``)."""
    conv1d: tuple[str, ...] = ()
    """A Hugging Face GPT-2's modules that were ``Conv1D`` (its policy's ``prepare``): checkpoints turn them back."""
    undo: list[Callable[[], None]] = field(default_factory=list)
    """Calls that put back what the steps changed on the user's modules and not for good (``restore``)."""

    def restore(self) -> None:
        """Undo the changes that tie the user's model to this run (``engine.close()`` calls it): the sequence
        plan's attention and positions, the dropout numbering. What stays: the shards the tensor, pipeline and
        ZeRO steps cut (``ck.dense_state_dict`` assembles the dense weights), blocks that recompute, GPT-2's
        Linear where it had Conv1D. Idempotent."""
        if self.sp_plan is not None:
            self.sp_plan.restore()
        while self.undo:
            self.undo.pop()()

    @property
    def model_cfg(self) -> Any:
        """The dense model's config (``GPTConfig``, ...), or None for a model without one."""
        return getattr(self.dense_twin, "cfg", None)


def output_logits(out):
    """The logits in a model's output for the built-in loss: the tensor it returns, or the ``logits`` of a
    Hugging Face ``ModelOutput`` (``model(ids).logits``, as plain PyTorch reads them). A loss of the user's own
    (``boost(..., loss_fn=)``) gets the output as the model returns it.

    >>> import types
    >>> t = torch.zeros(2, 3)
    >>> output_logits(t) is t, output_logits(types.SimpleNamespace(logits=t, loss=None)) is t
    (True, True)
    """
    if not isinstance(out, torch.Tensor):
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor):
            return logits
    return out


def parallelize(model: nn.Module, mesh: ProcessMesh, config: ParallelConfig, options: BoostOptions | None = None,
                *, group_of_name: Callable[[str], int] | None = None) -> Parallelized:
    """This rank's share of ``model`` under ``config``: each part's step (``engine.parts.PARTS``), in order, where
    the config wants it. ``options``: boost's keywords (``BoostOptions``: the policy, which ``check_policy`` has
    checked fits and whose parts' rules have taken the config, the loss, the bucket size, the device budget);
    ``group_of_name``: the optimizer's param group of a parameter by name (ZeRO keeps groups apart)."""
    options = options if options is not None else BoostOptions()
    policy, loss_fn = options.policy, options.loss_fn
    token_loss = TokenLoss(token_losses) if loss_fn is lm_loss else None
    b = Build(model, mesh, config, options, token_loss if token_loss is not None else loss_fn, token_loss,
              group_of_name)
    dropout = has_dropout(model)
    for p in PARTS:
        if p.apply is not None and p.wants(config, dropout):
            p.apply(b)
            b.steps.append(p.name)
    layout = DropoutLayout(mesh, b.tp_plan, b.sp_plan) if "dropout" in b.steps else None
    if policy is not None and policy.output is not None:
        logits = policy.output
    else:  # the built-in loss takes logits: a Hugging Face model's output holds them (any causal LM, no policy)
        logits = output_logits if loss_fn is lm_loss else (lambda out: out)
    return Parallelized(config=config, mesh=mesh, module=b.module, dense_twin=b.twin, policy=policy, loss_fn=b.loss,
                        data_parallel=b.data_parallel, placement_table=b.table, events=b.events, logits=logits,
                        token_loss=token_loss, tp_plan=b.tp_plan, sp_plan=b.sp_plan, dropout=layout, stages=b.stages,
                        tied=b.tied, n_local=b.n_local, steps=tuple(b.steps), conv1d=b.conv1d, undo=b.undo)
