"""Several ranks on one GPU: their CUDA tensors cross gloo through host buffers.

NCCL refuses two ranks on one GPU, and gloo's messages and most of its collectives take CPU tensors only. A job
with fewer GPUs than ranks still runs with every tensor on a GPU under the ``nccl_rules`` backend with
``COLAB_KIT_RULES_DEVICE=cuda`` (``ck.launch`` puts rank r on ``cuda:r % gpus``): each collective or message is
checked against NCCL's rules on the tensors the caller handed in (on the GPU), then runs on host copies of them
(pinned memory, which the CUDA copies need to run at full speed), and its outputs are copied back onto the GPU
when its Work completes (``Staged``). ``COLAB_KIT_RULES_STAGE=1`` stages CPU tensors the same way, so the CPU
suite runs this code (tests/ranks/test_staging.py); nothing else differs between the two.

Worked example, rank 1 of 2 sharing cuda:0, ``dist.all_reduce(x)`` with x a CUDA float32[4]::

    stage:   h = pinned host float32[4]; h.copy_(x)     (synchronous: x's producing kernels have finished)
    gloo:    all_reduce(h) with rank 0's h              (rules 1-4 checked as for any call)
    wait():  gloo's work done; x.copy_(h)               x holds the sum, on the GPU, when wait() returns

A copy that waits on the GPU is a host sync: a staged step is slower than NCCL's, and its timings are no
measure of a real run's communication. What it shows is that the program is right with every tensor on CUDA.
"""
from __future__ import annotations

import functools
import os
import threading

import torch
import torch._C._distributed_c10d as c10d

__all__ = ["Staged", "staged", "staging", "to_host", "first", "nothing", "root_only", "as_list"]


def staging(device_type: str) -> bool:
    """Whether a rules group on ``device_type`` runs its calls on host copies: always off the CPU; on the CPU
    where ``COLAB_KIT_RULES_STAGE=1`` (the suite's run of this code)."""
    return device_type != "cpu" or os.environ.get("COLAB_KIT_RULES_STAGE", "0") == "1"


def _room(t: torch.Tensor) -> torch.Tensor:
    """A host buffer for ``t`` (pinned for a CUDA tensor), its contents not copied."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")


def _host(t: torch.Tensor) -> torch.Tensor:
    h = _room(t)
    h.copy_(t)
    return h


def to_host(args, outputs, written: bool = False) -> tuple:
    """``(args with every tensor replaced by a host copy, [(device tensor, its host copy)] for those of
    outputs)``: ``args`` nested lists and tuples of tensors and other values, ``outputs`` the tensors the call
    writes (their host copies are copied back by ``Staged``). A tensor that appears twice gets one copy.
    ``written``: the call writes its outputs whole without reading them (a gather's, a receive's), so an output
    that is no input too gets an empty host buffer: its old contents never cross to the host."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    seen: dict[int, int] = {}
    for t in _flat(args):
        seen[id(t)] = seen.get(id(t), 0) + 1
    fresh = {id(t) for t in _flat(outputs) if seen.get(id(t)) == 1} if written else set()

    def swap(a):
        if isinstance(a, torch.Tensor):
            if id(a) not in copies:
                copies[id(a)] = (a, _room(a) if id(a) in fresh else _host(a))
            return copies[id(a)][1]
        if isinstance(a, (list, tuple)):
            return type(a)(swap(x) for x in a)
        return a

    host_args = swap(args)
    back = [copies[id(t)] for t in _flat(outputs)]
    return host_args, back


def _flat(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for a in x for t in _flat(a)]
    return []


class Staged(c10d.Work):
    """A rules group's Work on host copies: once it completes (``wait()``, ``is_completed()`` or its future),
    each output's host copy is copied back onto the caller's tensor, once. ``result()`` and the future's value
    are the caller's tensors."""

    def __init__(self, inner, back: list, outputs, kept=None):
        super().__init__()
        self.inner, self._back, self.outputs = inner, back, outputs
        self.polls = getattr(inner, "polls", False)  # comm.waiting polls a gloo-backed work first
        self.tensor = getattr(inner, "tensor", None)  # what a message's Work keeps alive (FutureWork.tensor)
        self.kept = kept  # the caller's tensors, alive as long as the Work, as NCCL's Work keeps them
        self._lock = threading.Lock()

    def _copy_back(self) -> None:
        with self._lock:
            back, self._back = self._back, []
            for dst, src in back:  # .data: as a collective writes (no version bump autograd could see),
                dst.data.copy_(src)  # not as an in-place op (a broadcast root's saved activation stays usable)

    def wait(self, timeout=None) -> bool:
        self.inner.wait()
        self._copy_back()
        return True

    def is_completed(self) -> bool:
        done = self.inner.is_completed()
        if done:
            self._copy_back()
        return done

    def result(self):
        return self.outputs

    def get_future(self):
        def back(fut):
            fut.wait()  # raises the call's error
            self._copy_back()
            return self.outputs
        return self.inner.get_future().then(back)


def staged(what: str, outputs, result=None, written: bool = False):
    """A ``RulesGroup`` method, staged where its group stages (``staging``): the caller's tensors checked against
    the job's device and contiguous (rules 4 and 5), the call run on host copies of them, ``outputs(group,
    args)``'s copies copied back when its Work completes. ``what`` names the call in a broken rule;
    ``result(args)``: what the Work's ``result()`` and future give, as the unstaged call's (by default the first
    argument). ``written``: the call only writes its outputs (``to_host``)."""
    result = result or (lambda args: args[0] if args else [])

    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if not self.staging:
                return method(self, *args, **kwargs)
            self._on_device(what, args, self.device_type)
            host_args, back = to_host(args, outputs(self, args), written)
            return Staged(method(self, *host_args, **kwargs), back, result(args), kept=args)
        return call
    return wrap


def first(group, args):
    """A call's outputs: its first argument (``all_reduce(tensors)``, ``all_gather(outputs, inputs)``, ...)."""
    return args[0]


def nothing(group, args):
    """A call without outputs (a send)."""
    return []


def root_only(group, args):
    """A reduce's outputs: the root's tensor only. gloo's ring reduce leaves partial sums in the other ranks'
    buffers, where NCCL leaves them as they were: copied back, they would differ from a real GPU run."""
    opts = args[1] if len(args) > 1 and args[1] is not None else None
    return args[0] if group.rank() == (opts.rootRank if opts is not None else 0) else []


def as_list(args):
    """The result of a ``*_single`` call: ``[output]``, as the unstaged group gives it."""
    return [args[0]]
