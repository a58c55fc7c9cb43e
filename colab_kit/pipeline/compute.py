"""The compute actions of a pipeline rank: F, B, I and W on one stage and one microbatch.

``ComputeActions`` is a mixin of ``PipelineExecutor`` (as ``messages.CommActions`` is for the sends
and receives): the executor runs ``_do_<kind>(action, stage, microbatch)`` for each compute
action of its plan. The table in ``executor``'s docstring says what each one does; the state
they share, per step, lives on the executor:

- ``_saved[s, m]``: after F the stage's (input, output) for backward; after a zero-bubble I the
  ``WeightGradStore`` W will run (or, on the first stage, a ``_WholeBackward``);
- ``_bytes[s, m]`` and ``_held``: what those hold, as the activation meter counted it (the
  executor's ``peak_bytes`` is the most ``_held`` reached);
- ``_act`` / ``_out``: activations handed to the next stage on this rank / to be sent;
  ``_gout`` / ``_gin``: output gradients received (or handed over locally) / input gradients
  to be sent back.

Worked example, rank 1 of ``pp=2`` under ZB-H1, microbatch 0: ``_do_F`` runs blocks 2-3 and
the loss and keeps (x, loss); ``_do_I`` runs the backward with a store active, puts ``x.grad``
in ``_gin[1, 0]`` for the send to rank 0 and keeps the store (the linears' inputs and output
gradients) in ``_saved[1, 0]``; ``_do_W`` later adds each ``dW = g^T x`` into ``.grad`` and
tells the dp buckets.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..tensor.zero_bubble import WeightGradStore, input_pass_leaves
from .plan import PipelinePlan
from .work import MicrobatchWork

__all__ = ["ComputeActions"]


class _WholeBackward:
    """``_saved`` after a first-stage I: the output and its gradient, the whole backward left to W."""

    __slots__ = ("y", "grad")

    def __init__(self, y, grad):
        self.y, self.grad = y, grad


class ComputeActions:
    """F, B, I and W of one stage and microbatch (mixed into ``PipelineExecutor``)."""

    # what this mixin reads and writes of the executor it is part of (``PipelineExecutor`` sets them)
    work: MicrobatchWork  # this step's microbatches and how to run one (handed over by the step loop)
    plan: PipelinePlan
    stages: dict[int, nn.Module]
    params: dict[int, list[torch.Tensor]]
    me: int  # this rank's pipeline rank
    m: int  # microbatches of the step
    forward_only: bool
    loss: torch.Tensor
    peak_bytes: int
    _x: list[torch.Tensor]
    _y: list[torch.Tensor]
    _saved: dict
    _bytes: dict[tuple[int, int], int]
    _held: int
    _act: dict
    _out: dict
    _gout: dict
    _gin: dict
    _leaves: dict

    def _do_F(self, a, s, m):
        st = self.stages[s]
        x = self._x[m] if st.first else self._take(self._act, a, "its input activation").requires_grad_()
        key = (s, tuple(x.shape), x.dtype, torch.is_grad_enabled())
        with self.work.meter.measure(key):  # hooks once per shape
            y = st(x, self._x[m])
            if st.last:
                loss = self.work.loss_fn(y, self._y[m]) / self.m
                self.loss += loss.detach()
                y = self.work.backward_loss(loss)
        if not self.forward_only:
            self._saved[s, m] = (x, y)
            self._bytes[s, m] = self.work.meter.last
            self._held += self._bytes[s, m]
            self.peak_bytes = max(self.peak_bytes, self._held)
        if not st.last and self.plan.rank_of(s + 1) == self.me:  # local handoff (two stages on one rank)
            self._act[s + 1, m] = y.detach()
        elif not st.last:
            self._out[s, m] = y.detach()

    def _do_B(self, a, s, m):
        x, y = self._saved.pop((s, m))
        self._held -= self._bytes.pop((s, m))
        grad = None if self.stages[s].last else self._take(self._gout, a, "its output gradient")
        torch.autograd.backward(y, grad)
        if s > 0:
            self._give_grad(s, m, x.grad)

    def _do_I(self, a, s, m):
        x, y = self._saved[s, m]
        grad = None if self.stages[s].last else self._take(self._gout, a, "its output gradient")
        if s == 0:  # nothing waits for the first stage's I: its whole backward runs in W (the table above)
            self._saved[s, m] = _WholeBackward(y, grad)
            return
        store = WeightGradStore(str(a))
        store.backward_input(y, grad, self._input_leaves(s, x, y))  # no retain_graph: the graph is freed
        self._saved[s, m] = store  # still held until W, now as the linears' inputs and output gradients
        nbytes = store.nbytes
        self._held += nbytes - self._bytes[s, m]
        self._bytes[s, m] = nbytes
        self.peak_bytes = max(self.peak_bytes, self._held)  # a store can outweigh what the forward saved
        if s > 0:
            self._give_grad(s, m, x.grad)

    def _do_W(self, a, s, m):
        store = self._saved.get((s, m))
        if not isinstance(store, (WeightGradStore, _WholeBackward)):
            why = f"before {s}I{m}" if store is not None else "without an F and I before it, or a second time"
            raise RuntimeError(f"pipeline rank {self.me} ran {a} {why}: a plan runs each microbatch's F, then I, "
                               "then W, once each")
        del self._saved[s, m]
        self._held -= self._bytes.pop((s, m))
        if isinstance(store, _WholeBackward):
            torch.autograd.backward(store.y, store.grad)
        else:  # in place into .grad; the dp buckets are told each parameter's gradient is ready
            store.run(ready=self.work.data_parallel.ready)

    def _input_leaves(self, s, x, y) -> list:
        """``input_pass_leaves(y)``, the graph walked once per stage and step (every microbatch of a
        stage has the same graph): the stage's parameters that get their gradient in I, then ``x``."""
        if s not in self._leaves:
            leaves = input_pass_leaves(y)
            mine = {id(p) for p in self.params[s]}
            cacheable = all(id(t) in mine or t is x for t in leaves)  # else walk it for each microbatch
            self._leaves[s] = ([t for t in leaves if t is not x], any(t is x for t in leaves)) if cacheable else None
        if self._leaves[s] is None:
            return input_pass_leaves(y)
        params, with_x = self._leaves[s]
        return params + [x] if with_x else params

    def _give_grad(self, s, m, gx):
        if self.plan.rank_of(s - 1) == self.me:  # local handoff (two stages on one rank)
            self._gout[s - 1, m] = gx
        else:
            self._gin[s, m] = gx

    def _take(self, store: dict, a, what: str):
        try:
            return store.pop((a.stage, a.microbatch))
        except KeyError:
            raise RuntimeError(f"pipeline rank {self.me} ran {a} without {what}: the plan must put the action "
                               "that provides it (a receive, or the stage before it on this rank) first") from None

    # ------------------------------------------------------------------ hangs
