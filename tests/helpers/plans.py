"""Memory and pipeline plans: ``LiveBytes`` (live bytes seen at the dispatcher), the big GPT, the ZB-V checks."""
from __future__ import annotations

import itertools
import weakref

import torch

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from colab_kit.models import GPT, GPTConfig
from colab_kit.pipeline import Action


# =========================================================================== memory and pipeline plans
# ~10.6 MB dense; the largest parameters are the token table and the head (2 MiB each)
BIG = GPTConfig(vocab_size=2048, seq_len=32, d_model=256, n_heads=8, n_layers=2)


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive (``live``) and their maximum (``peak``) while the mode is on.

    Every op's output storage is counted once, when it first appears, and subtracted when the
    storage is freed (``weakref.finalize`` on it: torch keeps one Python object per storage
    for as long as the storage lives). Views share their base's storage, so a slice costs
    nothing and a clone costs its bytes. ``mark(name)`` keeps the peak so far under ``name``.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.marks: dict[str, int] = {}
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._count(t.untyped_storage())
        return out

    def _count(self, storage) -> None:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._alive:
            return
        self._alive.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes

    def mark(self, name: str) -> None:
        self.marks[name] = self.peak


def dense_sizes(cfg: GPTConfig) -> tuple[int, int]:
    """Bytes of the dense model and of its largest parameter (from shapes: a meta model)."""
    sizes = [p.numel() * p.element_size() for p in GPT(cfg, device="meta").parameters()]
    return sum(sizes), max(sizes)


def assert_one_f_i_w_each(plan, pp: int, m: int) -> None:
    """ZB-V's count rule: exactly one F, one I and one W per stage and microbatch."""
    acts = [a for row in plan.actions for a in row]
    every = sorted(itertools.product(range(2 * pp), range(m)))
    for kind in "FIW":
        assert sorted((a.stage, a.microbatch) for a in acts if a.kind == kind) == every, (pp, m, kind)
    assert len(acts) == 3 * len(every)


def assert_f_i_w_in_order(plan, pp: int, m: int) -> None:
    """ZB-V's order rule on each rank: F before I before W of a microbatch; microbatches in order."""
    for row in plan.actions:
        at = {a: i for i, a in enumerate(row)}
        for a in row:
            if a.kind == "F":
                assert at[a] < at[Action(a.stage, "I", a.microbatch)] < at[Action(a.stage, "W", a.microbatch)]
        for s in {a.stage for a in row}:
            for kind in "FIW":
                assert [a.microbatch for a in row if (a.stage, a.kind) == (s, kind)] == list(range(m)), (pp, m)
