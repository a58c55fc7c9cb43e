"""``ck.parallelize(model, mesh, config)``: the ordered steps that turn a dense model into this rank's share.

``boost`` is ``parallelize`` (what this rank holds) plus the optimizer over it plus the one training step
(``colab_kit.engine.step``). The order of the steps is written once, here, in ``parallelize``; each step is
an ``apply_<what>(model, mesh, config, ...)`` in its own part's package (``colab_kit/<part>/apply.py``), whose
docstring says what it needs before it and what it leaves after it. Adding a mode means adding one step.

Worked example: ``ParallelConfig(dp=2, tp=2, pp=2)`` (8 ranks), a 4-block GPT built on every rank, on rank 5
(coordinates pp 1, dp 0, tp 1)::

    parts = ck.parallelize(GPT(cfg), mesh, config)
    parts.steps      # ('defer_init', 'tensor', 'pipeline_split', 'materialize', 'placements', 'broadcast',
                     #  'data_parallel')
    parts.stages     # [stage 1]: blocks 2-3, ln_f and the head, each matrix cut in halves over tp (this half: 1)
    parts.placement_table[parts.module.0.blocks...weight]   # tp: Shard(0) or Shard(1), dp: Replicate()
    parts.grads      # ZeroStage0: the dp buckets over this rank's 1/2 x 1/2 of the model

A step that the config does not ask for is left out of ``parts.steps`` (``plan_steps(config)`` lists them
without a model; ``tests/unit/test_parallelize.py`` prints the list for every config of the parity matrix).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import torch
import torch.nn as nn

from .. import comm
from ..config import ParallelConfig
from ..mesh import ProcessMesh
from ..placement import PlacementTable, Replicate
from ..zero.stage0 import GradientPart
from .loss import TokenLoss, lm_loss, token_losses
from ..dropout import DropoutLayout
from ..dropout.apply import apply_dropout
from ..expert.apply import apply_expert_parallel
from ..models.dropout import has_dropout
from ..policy.hf import converted_conv1d
from ..pipeline.apply import apply_pipeline_split
from ..precision.apply import apply_precision
from ..recompute.apply import apply_recompute
from ..sequence.apply import apply_sequence_parallel
from ..tensor.apply import apply_tensor_parallel
from ..zero.apply import apply_data_parallel
from ..pipeline.stage import defer_stages
from ..sharded_init import materialize, meta_twin

__all__ = ["parallelize", "Parallelized", "plan_steps", "STEPS"]

STEPS = ("defer_init", "dropout", "tensor", "sequence", "expert", "recompute", "pipeline_split", "materialize",
         "placements", "broadcast", "precision", "data_parallel")
"""Every step ``parallelize`` may take, in the order it takes them."""


def plan_steps(config: ParallelConfig, *, dropout: bool = False) -> tuple[str, ...]:
    """The steps ``parallelize`` takes for ``config`` (``dropout``: the model has dropout), in order::

        plan_steps(ParallelConfig(dp=2, tp=2, pp=2, recompute=True))
        # ('defer_init', 'tensor', 'recompute', 'pipeline_split', 'materialize', 'placements',
        #  'broadcast', 'data_parallel')
    """
    asks = {"dropout": dropout, "tensor": config.tp > 1, "sequence": config.sp > 1, "expert": config.ep > 1,
            "recompute": config.recompute != "none", "pipeline_split": config.pp > 1,
            "precision": config.precision != "fp32"}
    return tuple(s for s in STEPS if asks.get(s, True))


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
    grads: GradientPart
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


def parallelize(model: nn.Module, mesh: ProcessMesh, config: ParallelConfig, policy=None, *,
                loss_fn: Callable = lm_loss, bucket_bytes: int | None = None, device_budget: int | None = None,
                group_of_name: Callable[[str], int] | None = None) -> Parallelized:
    """This rank's share of ``model`` under ``config``: the steps below, in this order, each only where
    the config asks for it. ``policy``: what each part of the model is (``check_policy`` has checked it
    fits); ``group_of_name``: the optimizer's param group of a parameter by name (ZeRO keeps groups apart).
    """
    steps = plan_steps(config, dropout=has_dropout(model))
    taken: list[str] = []
    take = taken.append  # each step says it ran; the list must come out as ``steps``, in its order
    twin, conv1d = meta_twin(model), tuple(converted_conv1d(model))  # before anything changes the model
    deferred = defer_stages(model, config, mesh.rank("pp"), policy)    # 1. only this rank's shards are made
    take("defer_init")
    _no_kv_cache(model)
    token_loss = TokenLoss(token_losses) if loss_fn is lm_loss else None
    loss = token_loss if token_loss is not None else loss_fn
    undo = []
    if "dropout" in steps:                                             # 2. masks from global coordinates
        undo = apply_dropout(model, policy)
        take("dropout")
    tp_plan = sp_plan = None
    if "tensor" in steps:                                              # 3. this rank's blocks of each matrix
        model, tp_plan = apply_tensor_parallel(model, mesh, config, policy, token_loss)
        take("tensor")
    if "sequence" in steps:                                            # 4. attention on this rank's tokens
        model, sp_plan = apply_sequence_parallel(model, mesh, config, policy)
        take("sequence")
    if "expert" in steps:                                              # 5. this rank's experts, tokens to them
        apply_expert_parallel(model, mesh, config, policy)
        take("expert")
    if "recompute" in steps:                                           # 6. blocks (or attention cores) recompute
        apply_recompute(model, policy, config, sp_plan)
        take("recompute")
    stages, tied = None, []
    if "pipeline_split" in steps:                                      # 7. this rank's stages
        stages, tied = apply_pipeline_split(model, mesh, config, policy)
        model = nn.ModuleList(stages)
        take("pipeline_split")
    # 8. what is still meta, one tensor at a time (under ZeRO-3 the trainable ones stay meta: its chunks make
    # only this rank's piece of each)
    keep = (lambda t: isinstance(t, nn.Parameter) and t.requires_grad) if config.zero == 3 and deferred else None
    module = _to_device(materialize(model, keep), mesh.device)
    take("materialize")
    n_local = sum(p.numel() for p in module.parameters() if p.requires_grad)
    table = PlacementTable(module)                                     # 9. as each layer declared it
    take("placements")
    with torch.no_grad():                                              # 10. one start even if a seed differed
        for p in module.parameters():  # experts: over the ranks holding the same ones
            if p.is_meta:  # made by ZeRO-3 from its recipe: the same values on every rank
                continue
            axis = "edp" if config.ep > 1 and table[p].on("ep") != Replicate() else "dp"
            comm.broadcast(p.data, mesh, axis, tag="init params")
    take("broadcast")
    if "precision" in steps:                                           # 11. a 16-bit model, the loss in fp32
        loss = apply_precision(module, config, loss)
        take("precision")
    events: list[dict] = []
    grads = apply_data_parallel(module, mesh, config, policy, table, events, bucket_bytes=bucket_bytes,
                                device_budget=device_budget, group_of_name=group_of_name)  # 12. dp / ZeRO
    take("data_parallel")
    if tuple(taken) != steps:
        raise RuntimeError(f"parallelize took the steps {taken}, but {config.describe()} asks for {list(steps)}")
    dropout = DropoutLayout(mesh, tp_plan, sp_plan) if "dropout" in steps else None
    logits = policy.output if policy is not None and policy.output is not None else (lambda out: out)
    return Parallelized(config=config, mesh=mesh, module=module, dense_twin=twin, policy=policy, loss_fn=loss,
                        grads=grads, placement_table=table, events=events, logits=logits, token_loss=token_loss,
                        tp_plan=tp_plan, sp_plan=sp_plan, dropout=dropout, stages=stages, tied=tied,
                        n_local=n_local, steps=tuple(taken), conv1d=conv1d, undo=undo)


def _to_device(module: nn.Module, device) -> nn.Module:
    """``module.to(device)``, leaving meta tensors meta (ZeRO-3 makes them on the device)."""
    return module._apply(lambda t: t if t.is_meta else t.to(device))


def _no_kv_cache(model: nn.Module) -> None:
    """A training step reads no KV cache; a recomputed forward would append its keys to it a second time."""
    hf = getattr(model, "config", None)  # a Hugging Face model's config (PretrainedConfig), if any
    if hf is not None and getattr(hf, "use_cache", False):
        hf.use_cache = False
