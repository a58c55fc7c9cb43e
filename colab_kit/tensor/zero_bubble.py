"""Zero-bubble backward split (ZB-H1; Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
arXiv 2401.10241): a linear layer's backward cut into B (input gradient) and W (weight gradient).

A linear layer ``y = x W^T + b`` has two gradients that need different things:

- ``dx = g W`` (g = dL/dy) is what the stage before waits for: the pipeline's critical path;
- ``dW = g^T x`` and ``db = sum(g)`` wait for nobody until the optimizer step.

The paper's schedules run the first at once (the "I" action, called B in the paper) and
the second later (W), in the bubbles a plain 1F1B leaves. ``ZeroBubbleLinear`` is the
autograd function that makes the cut: its backward always computes ``dx``; then

- with no store active (a normal backward, the "B" action), it computes ``dW``, ``db`` too;
- in the I pass (``store.backward_input(y, g)``, the store active), it computes no weight
  gradient and pushes ``(weight, bias, x, g)`` on the store instead; ``store.run()`` (W)
  later does the matmul (and the sum) per layer and accumulates them into ``.grad`` through
  autograd, so the parameters' post-accumulate-grad hooks fire then, once (the dp buckets
  of ``zero.DataParallel`` count on them). The pipeline executor runs
  ``store.run(ready=engine.data_parallel.ready)`` instead: each matmul adds in place into ``.grad``
  (``addmm``, as B's own accumulation would) and the buckets are told directly, once per
  parameter; that skips a temporary per weight and an autograd call per W, which on CPU ranks
  made I + W take 1.3x B's time for the same FLOPs.

So I + W costs the FLOPs of one backward (the same matmuls, in two groups). After I the
autograd graph is freed: the store keeps each linear's input (one of the tensors the
forward saved; the attention, LayerNorm and GELU ones are gone) and its output gradient.
For a GPT block the output gradients are wide (qkv 3d, fc1 4d), so the store holds about
as many bytes as the forward saved: the split frees the graph, not the memory.
Worked example, one stage = one GPT block with d=4, MLP 4 -> 16 -> 4, a microbatch of
``[b, t] = [2, 3]`` rows (N = 6 rows), on pipeline rank 1 of pp=2::

    F   y = block(x)                       saves LayerNorm, attention, GELU inputs, ...
    I   store.backward_input(y, g_y)       dx (sent to rank 0), LayerNorm gradients now;
                                           the store keeps x, g of qkv [6,4],[6,12], proj
                                           [6,4],[6,4], fc1 [6,4],[6,16], fc2 [6,16],[6,4]
    W   store.run()                        dW_qkv = g^T x [12,4], ... db = g.sum(0): 4 mm
                                           (2*N*in*out FLOPs each), then the buckets' hooks

Parameters that are not in a split linear (LayerNorm, embeddings, a RowLinear's bias added
after its all-reduce) get their cheap gradients in I. The 2D, 2.5D and 3D tensor-parallel
layers have their own fused autograd functions and are not split: their weight gradients
are computed in I as well, so I + W is still one backward, with less of it deferred.
The store is process-wide (like a mode, not per thread) so that autograd's device threads
see it on GPU; one backward runs at a time per rank.

It lives with tensor parallelism because the 1D layers (``tp1d``, ``split_gather``) run their matmuls
through ``split_linear``; the pipeline, above, drives the store in its I and W actions.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..measure import tensor_bytes

__all__ = ["ZeroBubbleLinear", "split_linear", "WeightGradStore", "input_pass_leaves", "DeferredLinear",
           "use_split_backward"]

_ACTIVE: list[WeightGradStore] = []  # the store(s) of the I pass running now, innermost last


class WeightGradStore:
    """The weight gradients one I pass deferred: fill it once (I), then ``run()`` it once (W).

    >>> lin = torch.nn.Linear(4, 3)
    >>> use_split_backward(lin)                       # an nn.Linear whose backward can split
    1
    >>> x = torch.randn(6, 4, requires_grad=True)
    >>> y = lin(x)
    >>> store = WeightGradStore("1I0")
    >>> store.backward_input(y, torch.ones(6, 3))   # I: dx of every layer, the linears' dW deferred
    >>> x.grad.shape, lin.weight.grad is None
    (torch.Size([6, 4]), True)
    >>> store.nbytes                                  # kept for W: x [6, 4] and g [6, 3] in fp32
    168
    >>> store.run()                                   # W: dW, db accumulated into .grad, hooks fire
    >>> lin.weight.grad.shape, lin.bias.grad.tolist()
    (torch.Size([3, 4]), [6.0, 6.0, 6.0])

    ``with store: torch.autograd.backward(y, g)`` fills it as well, but autograd then also
    visits the deferred parameters with no gradient, which fires their hooks early, empty.
    """

    def __init__(self, name: str = ""):
        self.name = name
        self.entries: list[tuple] = []  # (weight or None, bias or None, x, g)
        self.state = "empty"            # -> "capturing" -> "captured" -> "done"

    def __enter__(self) -> WeightGradStore:
        if self.state != "empty":
            raise RuntimeError(f"weight-gradient store {self.name!r} is {self.state}: one I pass fills a store once")
        self.state = "capturing"
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        self.state = "captured"

    def backward_input(self, y: torch.Tensor, grad: torch.Tensor | None = None, inputs=None) -> None:
        """I: ``autograd.backward(y, grad)`` with this store active and no retain_graph.

        Only the leaves that need their gradient now are its ``inputs`` (``input_pass_leaves``,
        or ``inputs`` when the caller already knows them: the pipeline executor keeps them per
        stage and step), so autograd never visits a deferred parameter: its post-accumulate-grad
        hooks fire once, in W, with the gradient (a visit with no gradient would fire them too,
        empty-handed).
        """
        leaves = input_pass_leaves(y) if inputs is None else inputs
        with self:
            torch.autograd.backward(y, grad, inputs=leaves or None)

    def push(self, weight, bias, x: torch.Tensor, g: torch.Tensor) -> None:
        self.entries.append((weight, bias, x, g))

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct storages the store keeps alive (inputs and output gradients, not weights)."""
        return tensor_bytes(t for _, _, x, g in self.entries for t in (x, g))

    def run(self, ready=None) -> None:
        """W: compute every deferred ``dW = g^T x``, ``db = sum g`` and accumulate them into the parameters.

        ``ready=None``: the sums reach ``.grad`` through autograd (each parameter a root of one
        backward), so the parameters' post-accumulate-grad hooks fire, once each. With ``ready``
        (a callable, e.g. ``data.DataParallel.ready``, what the pipeline executor passes) each matmul
        adds straight into the existing ``.grad`` (``addmm_``: no temporary, no autograd call, so W
        costs what the same matmuls cost inside B) and ``ready(param)`` is called once per parameter,
        right after its last addition, in place of the hooks (a bucket's all-reduce can start while
        the rest of W computes).
        """
        if self.state != "captured":
            what = {"empty": "before its I pass filled it (W before I?)", "capturing": "inside its own I pass",
                    "done": "a second time (W twice?)"}[self.state]
            raise RuntimeError(f"weight-gradient store {self.name!r} run {what}: each microbatch's W runs once, "
                               "after its I")
        entries, self.entries, self.state = self.entries, [], "done"
        if ready is None:
            return _run_through_autograd(entries)
        last = {id(p): i for i, (w, b, _, _) in enumerate(entries) for p in (w, b) if p is not None}
        with torch.no_grad():
            for i, (w, b, x, g) in enumerate(entries):
                g2 = g.reshape(-1, g.shape[-1])
                if w is not None:
                    _add_into_grad(w, g2.t(), x.reshape(-1, x.shape[-1]))
                if b is not None:
                    _add_into_grad(b, g2.sum(0))
                for p in (w, b):
                    if p is not None and last[id(p)] == i:
                        ready(p)


def _add_into_grad(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """``p.grad += a @ b`` (or ``+= a`` when ``b`` is None), in place where ``p.grad`` exists and dtypes agree."""
    if p.grad is not None and p.grad.dtype == a.dtype:
        if b is None:
            p.grad.add_(a)
        else:  # addmm_'s twin (FlopCounterMode counts this form, not the method)
            torch.addmm(p.grad, a, b, out=p.grad)
        return
    value = (a if b is None else a.mm(b)).to(p.dtype)
    if p.grad is None:
        p.grad = value
    else:
        p.grad.add_(value)


def _run_through_autograd(entries) -> None:
    """W for a store run without ``ready``: sum per parameter, then autograd adds into ``.grad`` (hooks fire)."""
    grads: dict[int, list] = {}  # id(param) -> [param, summed gradient]

    def add(p, grad):
        if id(p) in grads:
            grads[id(p)][1] += grad
        else:
            grads[id(p)] = [p, grad]

    with torch.no_grad():
        for w, b, x, g in entries:
            g2 = g.reshape(-1, g.shape[-1])
            if w is not None:
                add(w, g2.t().mm(x.reshape(-1, x.shape[-1])).to(w.dtype))
            if b is not None:
                add(b, g2.sum(0).to(b.dtype))
    if grads:  # a leaf as a root of backward: AccumulateGrad adds into .grad and fires the hooks
        params, values = zip(*grads.values())
        torch.autograd.backward(list(params), list(values))


class ZeroBubbleLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward defers dW, db to the active ``WeightGradStore``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)  # leaves that outlive the graph: W accumulates into them
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        dx = g.matmul(weight) if need_x else None
        if not (need_w or need_b):
            return dx, None, None
        # I: keep what W needs, nothing more (detached: the graph behind x is freed). A layer whose
        # input needs no gradient has no dx to hurry for, so its weight gradient is computed now.
        if _ACTIVE and need_x:
            w, b = ctx.params
            _ACTIVE[-1].push(w if need_w else None, b if need_b else None, x.detach(), g.detach())
            return dx, None, None
        g2 = g.reshape(-1, g.shape[-1])  # B: both at once, leading dims flattened
        dw = g2.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None
        db = g2.sum(0) if need_b else None
        return dx, dw, db


def input_pass_leaves(y: torch.Tensor) -> list[torch.Tensor]:
    """The leaves of ``y``'s graph that get their gradient in I: all that need one, except the
    weights and biases reached only through a ``ZeroBubbleLinear`` whose input needs a gradient
    (those wait for W). A weight also used elsewhere (tied) gets that part in I, the rest in W.

    Worked example, a block's graph: the LayerNorms' weights and biases and the stage's input
    leaf are kept; qkv, proj, fc1 and fc2's weights and biases are not.
    """
    kept, seen, todo = {}, set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        split = isinstance(fn, ZeroBubbleLinear._backward_cls) and fn.next_functions[0][0] is not None
        for slot, (nxt, _) in enumerate(fn.next_functions):
            if nxt is None or (split and slot > 0):  # W's: a deferred weight or bias, and what made it
                continue
            if hasattr(nxt, "variable"):  # AccumulateGrad: a leaf
                kept[id(nxt.variable)] = nxt.variable
            else:
                todo.append(nxt)
    return list(kept.values())


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose weight gradient an active ``WeightGradStore`` defers to W."""
    return ZeroBubbleLinear.apply(x, weight, bias)


class DeferredLinear(nn.Linear):
    """An ``nn.Linear`` computed with ``split_linear`` (what ``use_split_backward`` turns one into)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_linear(x, self.weight, self.bias)


def use_split_backward(*modules: nn.Module) -> int:
    """Make every plain ``nn.Linear`` inside ``modules`` a ``DeferredLinear`` (same parameters and
    state-dict keys, only the class changes); returns how many changed. The model's own code
    (``ck.models.GPT``) stays free of it. The 1D tensor-parallel layers call ``split_linear``
    themselves; other layers are left alone (their weight gradients come in I). Without an
    active store a ``DeferredLinear`` trains exactly like an ``nn.Linear``; calling this twice
    changes nothing more.
    """
    changed = 0
    for module in modules:
        for m in module.modules():
            if type(m) is nn.Linear:
                m.__class__ = DeferredLinear
                changed += 1
    return changed
