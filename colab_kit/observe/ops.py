"""Operators a step dispatches: the count behind the estimate's host floor (``planner.cluster.host``).

Eager PyTorch pays host time for every operator it dispatches (Python, the dispatcher, autograd, the kernel's
launch), whatever the operator's size. ``count_ops(fn)`` runs ``fn()`` under a ``TorchDispatchMode`` that
counts every aten operator dispatched (forward, backward, optimizer and the engine's own), and the host reads
among them (``aten._local_scalar_dense``: ``.item()`` and friends, each a device -> host sync on a GPU)::

    >>> import torch
    >>> x = torch.ones(4, requires_grad=True)
    >>> counted = count_ops(lambda: (x * 2).sum().backward())
    >>> counted["ops"] > 0, counted["host_reads"]
    (True, 0)

The number does not depend on the tensors' sizes, only on the program, so a model at a tiny width on CPU
counts what its full-size twin dispatches on a GPU.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_ops"]


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.reads = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> dict:
    """``{"ops": aten operators fn() dispatched, "host_reads": of them, reads of a value to the host,
    "result": what fn returned}``."""
    counter = _Count()
    with counter:
        result = fn()
    return {"ops": counter.ops, "host_reads": counter.reads, "result": result}
