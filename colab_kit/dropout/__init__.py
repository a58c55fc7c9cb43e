"""Layout-invariant dropout inside the engine: where this rank's tensors sit in the global ones.

The masks themselves are the models' (``colab_kit.models.dropout``): each element a pure function of
the seed, the step, the layer and its global coordinates, so every split draws what one process draws.
What a parallel run adds is the coordinates: ``DropoutLayout`` makes, for each microbatch, the
``Coordinates`` of this rank's rows (its dp rank's, the microbatch's, the tensor plan's split of the
batch), features and heads (the tensor plan's axes, and sp's under Ulysses) and token positions (sp's
layout), and ``at(step, i)`` holds them while microbatch ``i`` runs. It sits above tensor and sequence
parallelism, whose plans it reads, and below the engine, which sets it up when a model has dropout.

Worked example, tp=2 (1d) x dp=2, a global batch of 8 rows, 2 microbatches, rank 1 (dp 0, tp 1)::

    layout = DropoutLayout(mesh, tp_plan)    # features: (0, 1) (1D keeps the residual stream whole)
    layout.begin(8, 2)                       # dp 0 holds rows 0..3
    with layout.at(step=5, i=1):             # rows 2..3, step 5: the masks one process draws there
        ...
"""
from __future__ import annotations

import torch

from ..config import Axis
from ..models.dropout import Coordinates, at
from ..sequence.zigzag import sequence_positions

__all__ = ["DropoutLayout"]


def _block(mesh, axes) -> tuple[int, int]:
    index, count = 0, 1
    for a in axes:
        index, count = index * mesh.size(a) + mesh.rank(a), count * mesh.size(a)
    return index, count


class DropoutLayout:
    """One rank's ``Coordinates`` per microbatch, from the engine's mesh and plans.

    ``begin(batch_rows, microbatches)`` at each step's start; ``at(step, i)`` around microbatch ``i``'s
    forward and backward (recomputation's second forward then draws the same masks).
    """

    def __init__(self, mesh, tp_plan=None, sp_plan=None):
        self.mesh, self.tp, self.sp = mesh, tp_plan, sp_plan
        self.features = _block(mesh, tp_plan.hidden_axes) if tp_plan is not None else (0, 1)
        heads = tuple(tp_plan.head_axes) if tp_plan is not None else ()
        if sp_plan is not None and sp_plan.mode == "ulysses":
            heads += (sp_plan.axis,)
        self.heads = _block(mesh, heads)
        self._seq = _block(mesh, tp_plan.token_axes) if tp_plan is not None else (0, 1)
        self._cache: dict = {}
        self._key: tuple[int, int] | None = None  # (global batch rows, microbatches) of the step

    def begin(self, batch_rows: int, microbatches: int) -> None:
        key = (batch_rows, microbatches)
        if key != self._key:
            self._key, self._cache = key, {}

    def _positions(self, t: int):
        dev = self.mesh.device
        if self.sp is not None:
            seq = t * self.sp.size
            return sequence_positions(self.sp.rank, self.sp.size, seq, self.sp.layout, device=dev), seq
        blk, n = self._seq
        return torch.arange(t, device=dev) + blk * t, t * n

    def coordinates(self, step: int, i: int) -> Coordinates:
        if self._key is None:
            raise RuntimeError("DropoutLayout.begin(rows, microbatches) comes before a step's coordinates")
        if i not in self._cache:
            b, m = self._key
            cfg = self.mesh.config
            dp_rows = torch.arange(b).chunk(cfg.dp)[self.mesh.rank(Axis.DP)]
            if self.tp is not None:
                hidden, token = self.tp.dropout_rows(dp_rows, m, i)
            else:
                hidden = token = dp_rows.chunk(m)[i]
            dev = self.mesh.device
            self._cache[i] = (hidden.to(dev), token.to(dev))
        hidden, token = self._cache[i]
        return Coordinates(step, hidden, token, self._positions, self.features, self.heads, self._key[0])

    def at(self, step: int, i: int):
        """A context manager: microbatch ``i`` of ``step`` runs inside it (``colab_kit.models.dropout.at``)."""
        return at(self.coordinates(step, i))
