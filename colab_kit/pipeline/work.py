"""What the pipeline executor is handed for one step: ``MicrobatchWork``, a declared interface.

The training step (``colab_kit.engine.step``) owns what every mode shares: the batch split, the loss, the
gradient sync, the optimizer. It hands the executor this step's microbatches and how to run one of them;
the executor runs its F/B/I/W actions and returns the step's local loss. It never reaches back into the
engine (``tests/unit/test_pipeline_work.py`` reads its source to hold it to that).

For ``ParallelConfig(pp=2, microbatches=2)`` on pipeline rank 1 (the last stage), the executor uses it so::

    with work.microbatch_at(m), work.meter.measure(key):   # F of microbatch m: the parts' contexts (dropout
        loss = work.loss_fn(stage(x), work.targets[m]) / 2   # coordinates, MoEStep), its activations counted
    backward from work.backward_loss(loss)               # times the fp16 scale, over the ranks sharing it
    work.data_parallel.arm(sync=True)                    # before the last B: the dp buckets reduce as they fill
    work.data_parallel.ready(param)                      # W: a deferred weight gradient is complete

A model whose stages must tell each other something small about a microbatch besides the activation and its
gradient sets ``work.side`` (a ``Sideband``): every activation and every input gradient that crosses to
another rank is followed by one fixed-shape message, ``side.outgoing(m)`` at the sender, handed to
``side.incoming(m, t)`` at the receiver. A Hugging Face MoE model's load-balancing loss uses it to carry each
layer's expert counts of the microbatch up the pipeline with the activations and back down with the
gradients (``colab_kit.models.hf_moe.CountsRelay``).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol
from collections.abc import Callable

import torch

__all__ = ["MicrobatchWork", "GradientSync", "ActivationCounter", "Sideband"]


class GradientSync(Protocol):
    """The data-parallel gradient part as the executor sees it (``colab_kit.zero``'s ``GradientPart``)."""

    def arm(self, sync: bool, t0: float | None = None) -> None: ...

    def ready(self, param: torch.Tensor) -> None: ...


class ActivationCounter(Protocol):
    """What autograd holds, measured per forward (``colab_kit.measure.ActivationMeter``)."""

    last: int

    def measure(self, key=None) -> AbstractContextManager: ...


class Sideband(Protocol):
    """A fixed-shape message per microbatch that rides each cross-rank activation and input-gradient
    message (equal shape and dtype on every pipeline rank: the receiver shapes its buffer from them)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def outgoing(self, microbatch: int) -> torch.Tensor: ...

    def incoming(self, microbatch: int, t: torch.Tensor) -> None: ...


@dataclass
class MicrobatchWork:
    """One step's work on this pipeline rank, as the step loop hands it over."""

    inputs: list[torch.Tensor]
    """This rank's rows of each microbatch (the first stage's input)."""
    targets: list[torch.Tensor]
    """Their targets (the last stage's loss)."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``(outputs, targets) -> loss`` of a microbatch's rows."""
    backward_loss: Callable[[torch.Tensor], torch.Tensor]
    """The loss backward starts from: times the fp16 scale, over the ranks that share its terms."""
    meter: ActivationCounter
    microbatch_at: Callable[[int], AbstractContextManager]
    """The context a microbatch's forward (and a recomputed forward in backward) runs in."""
    data_parallel: GradientSync
    t0: float
    """When the step began (``time.perf_counter``): the timeline's zero."""
    side: Sideband | None = None
    """What rides each message besides the tensor (None: nothing; not sent in a forward-only pass)."""
