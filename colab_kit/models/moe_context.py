"""What an MoE layer needs to know of the batch it sees: who else holds tokens of it, and how its losses count.

The balancing loss, the z-loss and a capacity are defined over the whole batch one process sees (every row
of one microbatch, ``docs/moe.md``). In one process a layer sees all of it. Inside the engine a rank sees
its own rows only, so the engine sets a ``MoEStep`` around each microbatch's forward and backward (the way
it sets dropout coordinates, ``colab_kit.models.dropout.at``), in a ``contextvars.ContextVar``: the model
imports no engine part, it reads what was declared here.

``MoEStep`` carries:

- ``gather(t)``: ``t`` of every rank that holds rows of this microbatch, stacked in the batch's row order
  (``[pieces, *t.shape]``; one all-gather over dp in the engine, ``t[None]`` in one process). The layer
  gathers its per-expert counts and token count with it, once per layer and microbatch: their sums are the
  whole batch's, the rows before ``piece`` give a capacity's priority. Counts are not differentiable, and
  need not be: the balancing loss ``E sum_i f_i P_i`` is linear in the router probabilities, so each rank's
  share ``E sum_i f_i (sum of its own p_ti) / N`` has exactly the gradient of the whole-batch loss.
- ``piece`` / ``pieces``: this rank's place among them and how many there are. The engine reports the mean
  of its ranks' losses, so a rank's share of an auxiliary loss is taken ``pieces`` times.
- ``grad_scale``: what the engine's backward multiplies this rank's loss by (``1 / microbatches``, times the
  fp16 scale): the gradient an auxiliary loss injects into backward (``AuxLoss``).
- ``values``: each layer's share of the auxiliary losses, by layer number, detached: the engine adds them
  to the loss it reports. A layer recomputed in backward writes the same number again.
- ``cache``: each layer's gathered counts (a recomputed forward reuses them: no collective in backward).

Worked example, dp=2, a microbatch of 2 x 8 tokens per rank, 4 experts, top-1: rank 1 counts ``[3 5 0 8]``
and 16 tokens; ``gather`` gives ``[[6 2 4 4 | 16], [3 5 0 8 | 16]]``: the batch's counts ``[9 7 4 12]`` of
32 tokens, and rank 0's ``[6 2 4 4]`` come before rank 1's in a capacity's order.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

__all__ = ["MoEStep", "AuxLoss", "at", "current", "ONE_PROCESS", "CountedRouter"]


class CountedRouter:
    """Marker of a router that counts its model's load-balancing loss under the engine's ``MoEStep``
    (``colab_kit.models.hf_moe.RouterLoss``): ``models.moe.has_experts`` knows it without importing it."""


def _alone(t: torch.Tensor) -> torch.Tensor:
    return t[None]


@dataclass
class MoEStep:
    """One microbatch's view of the batch, as the engine sets it (see the module docstring)."""

    gather: Callable[[torch.Tensor], torch.Tensor] = _alone
    """``t`` of every rank holding rows of this microbatch, stacked in row order: ``[pieces, *t.shape]``."""
    piece: int = 0
    """This rank's place in that order (its dp rank)."""
    pieces: int = 1
    """Ranks holding rows of this microbatch (dp)."""
    grad_scale: float = 1.0
    """The gradient of the engine's backward loss with respect to this rank's loss (1 / microbatches, ...)."""
    inject: bool = True
    """Whether the auxiliary losses enter backward through ``AuxLoss`` (the engine) rather than as tensors
    the caller adds to its loss (one process: ``ck.models.moe_loss(model)``)."""
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per MoE layer number, this rank's share of its auxiliary losses (detached)."""
    cache: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per MoE layer number, the gathered counts of its first forward (reused when it is recomputed)."""
    seen: dict[int, dict] = field(default_factory=dict)
    """Per MoE layer number, what its first forward routed (the engine's records, ``colab_kit.expert.records``):
    ``counts`` (the batch's assignments per expert), ``mine`` (this rank's), ``dropped`` (the batch's, by a
    capacity), ``balance`` and ``z`` (this rank's shares, before ``pieces`` and the coefficients), as detached
    tensors (``dropped`` 0 without a capacity): no host read in the forward, the step's end reads them all at
    once (``step_layers``); an expert-parallel layer adds ``sent`` / ``received`` (bytes to and from each ep
    rank, host ints: its all-to-all's split sizes are read on the host anyway)."""


ONE_PROCESS = MoEStep(inject=False)
"""What a layer assumes with nothing set: it sees the whole batch (never written: ``values``/``cache`` unused)."""

_STEP: ContextVar[MoEStep | None] = ContextVar("colab_kit_moe_step", default=None)


def current() -> MoEStep | None:
    """The ``MoEStep`` the engine set for the microbatch running now (None: one process)."""
    return _STEP.get()


@contextmanager
def at(step: MoEStep | None):
    """Run the block under ``step`` (None: one process), then give back what was set before."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


class AuxLoss(torch.autograd.Function):
    """``AuxLoss.apply(out, aux, scale)`` returns ``out`` unchanged; in backward ``aux`` receives the gradient
    ``scale``, as if ``scale * aux`` had been added to the loss that backward started from.

    Megatron-Core's ``MoEAuxLossAutoScaler``: an auxiliary loss computed inside a pipeline stage reaches
    backward through the stage's own output, whatever runs after it (the next stage, a recomputation), with
    no change to the loss the last stage computes. ``out`` must be used by what follows (the layer's output).
    """

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        aux, = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None
