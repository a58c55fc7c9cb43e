"""What the pipeline executor needs from the engine that owns it: ``PipelineHost``, a declared interface.

``PipelineExecutor`` (``executor.py``) and ``ComputeActions`` (``passes.py``) reach the engine through these
names and no others (``tests/unit/test_pipeline_host.py`` reads their source to hold them to it, and checks that
``colab_kit.engine.core.Engine`` provides every one). The executor runs the actions; the engine owns what every
parallel mode shares: the batch split, the loss, the gradient part, the optimizer step.

For ``ParallelConfig(pp=2, microbatches=2)`` on pipeline rank 1 (the last stage), one step uses them so::

    x, y = host.prepare_batch(batch, 2)         # this rank's rows, cut into 2 microbatches
    host.events.clear(); host.activation_meter.reset(); host.grads.arm(sync=False, t0=t0)
    with host.dropout_at(m):                    # F of microbatch m: the loss of its rows,
        loss = host.loss_fn(stage(x_m), y_m)    # scaled by host.loss_shards and host.scale_loss
    host.grads.arm(sync=True)                   # the last backward reduces over dp
    host.activation_meter.peak = held_bytes     # what the schedule held at once
    host.pipeline_loss(local) / host.finish_step(local, t0)   # the global mean loss; the optimizer step
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Protocol, runtime_checkable

import torch

__all__ = ["PipelineHost", "HOST_NAMES"]


@runtime_checkable
class PipelineHost(Protocol):
    config: Any             # the ParallelConfig: pp, chunks, schedule, microbatches
    mesh: Any               # the ProcessMesh: groups, coordinates, the comm log
    model_cfg: Any          # the model's config (the FLOP-ordered ZB-V plan reads it), or None
    module: torch.nn.Module  # this rank's stages' modules (train() / eval())
    sp_plan: Any            # the sequence plan, or None: begins each step
    grads: Any              # the gradient part: arm(sync) before backward, ready(param) for W actions
    loss_fn: Callable       # (logits, targets) -> the loss of a microbatch's rows
    events: list            # the step's timeline: {"name", "kind", "start", "end"} per action
    activation_meter: Any   # what autograd holds: measure(key), last, reset(), peak

    @property
    def loss_shards(self) -> int: ...  # how many ranks share one microbatch's loss terms (tp, sp)

    def prepare_batch(self, batch, microbatches: int, local: bool = False) -> tuple: ...

    def dropout_at(self, microbatch: int) -> AbstractContextManager: ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def pipeline_loss(self, local: torch.Tensor) -> float: ...

    def finish_step(self, local: torch.Tensor, t0: float) -> float: ...


HOST_NAMES = frozenset(PipelineHost.__annotations__) | frozenset(
    name for name in vars(PipelineHost) if not name.startswith("_"))
"""Every name of ``PipelineHost``: what the executor may touch on its engine."""
