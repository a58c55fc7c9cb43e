"""Where each parameter lies on the mesh, in DTensor's terms: one ``PlacementTable`` per engine.

A parallel layer says, for each parameter it makes, how that parameter relates to the dense one
(``declare``): the dense dims it is split along and over which mesh axes, outer axis first
(``Shard(dim)`` on each of them), ``Replicate()`` on every other axis, and the axes over which
its *gradient* is ``Partial()`` after backward (the copies on those ranks each saw other rows or
tokens, so their gradients must be summed). ``transposed``: the rank stores the block of
``dense.T`` (2D's ``[in, out]`` weights); ``parts``: the dense dim 0 is ``parts`` fused blocks
(``[q | k | v]``), each split alike (DTensor's strided shard). The engine gathers every
declaration into one table after the model is sharded (``PlacementTable(module)``); the gradient
sums (``tensor.sync_grads``), ZeRO's pieces, the fp32 masters and the estimator read it, and
``ck.placements(engine)`` shows it.

Worked example, GPT d_model=8 under ``ParallelConfig(dp=2, tp=4, tp_mode="2d")`` (q=2), rank
(dp 0, tp_row 1, tp_col 0)::

    blocks.0.mlp.fc1.weight [32, 8] -> local [4, 16] = W.T[4:8, 0:16]
        tp_row: Shard(1)  tp_col: Shard(0)  dp: Replicate()   grad: as the weight (complete)
    blocks.0.ln1.weight [8] -> local [4] = weight[0:4]
        tp_col: Shard(0)  tp_row: Replicate()  grad on tp_row: Partial()   (the rows differ per grid row)
    dp: every parameter Replicate(), its gradient Partial() until the dp buckets reduce it

The dp axis is the data-parallel part's own (its buckets, or ZeRO's flat pieces): the table lists
the axes the tensor and sequence parts add.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard

__all__ = ["Placed", "declare", "add_partial", "declared", "PlacementTable", "Shard", "Replicate", "Partial"]


@dataclass(frozen=True)
class Placed:
    """One parameter's placement: ``shards`` ``((dense dim, (axis, ...)), ...)``, outer axis first;
    ``partial``: axes its gradient is summed over after backward; ``transposed``, ``parts``: see above."""

    shards: tuple = ()
    partial: tuple = ()
    transposed: bool = False
    parts: int = 1

    def on(self, axis: str):
        """The parameter's placement on ``axis``: ``Shard(dim)`` or ``Replicate()``."""
        for dim, axes in self.shards:
            if axis in axes:
                return Shard(dim)
        return Replicate()

    def grad_on(self, axis: str):
        """Its gradient's placement on ``axis`` right after backward."""
        return Partial() if axis in self.partial else self.on(axis)

    def axes(self) -> tuple[str, ...]:
        return tuple(a for _, axes in self.shards for a in axes) + tuple(self.partial)

    def local(self, dense: torch.Tensor, mesh) -> torch.Tensor:
        """This rank's block of ``dense`` (any tensor shaped like the dense parameter), as the layer stores it."""
        return dense.reshape(-1)[self.local_index(dense.shape, mesh)]

    def local_ranges(self, shape, mesh) -> list[list[tuple[int, int]]]:
        """Per dense dim, the runs ``(dense start, length)`` of indices this rank stores, in its local order:
        the rank's block is their product (``dense.T``'s when ``transposed``). A handful of ints per
        parameter, whatever its size (what the checkpoint maps elements with). A ``[96, 32]`` weight of
        3 fused parts split over tp=2, tp rank 1: ``[[(16, 16), (48, 16), (80, 16)], [(0, 32)]]``."""
        shape = tuple(shape)
        out = [[(0, n)] for n in shape]
        for dim, axes in self.shards:
            whole = shape[dim] // (self.parts if dim == 0 else 1)
            lo, n = 0, whole
            for a in axes:  # torch.chunk's pieces: ceil(n / size) each, the last ones shorter
                step = -(-n // mesh.size(a))
                lo, n = lo + mesh.rank(a) * step, max(0, min(step, n - mesh.rank(a) * step))
            out[dim] = [(b * whole + lo, n) for b in range(self.parts)] if dim == 0 else [(lo, n)]
        return out

    def local_index(self, shape, mesh) -> torch.Tensor:
        """The dense flat position (int64) of every element this rank stores of a parameter of dense
        ``shape``: ``local(arange(numel).view(shape))``, made from ``local_ranges`` without the dense tensor."""
        shape = tuple(shape)
        if not shape:
            return torch.zeros((), dtype=torch.int64)
        per_dim = [torch.cat([torch.arange(s, s + n) for s, n in runs]) for runs in self.local_ranges(shape, mesh)]
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        idx = torch.zeros((), dtype=torch.int64)
        for d, v in enumerate(per_dim):
            view = [1] * len(shape)
            view[d] = -1
            idx = idx + v.view(view) * strides[d]
        return idx.t() if self.transposed else idx

    def describe(self, axes) -> str:
        """``"tp_row: Shard(1), tp_col: Shard(0); grad tp_dep: Partial()"`` over ``axes``."""
        out = ", ".join(f"{a}: {_name(self.on(a))}" for a in axes)
        part = [a for a in axes if a in self.partial]
        extra = ("; grad " + ", ".join(f"{a}: Partial()" for a in part)) if part else ""
        return out + extra + (" (stored transposed)" if self.transposed else "") + \
            (f" ({self.parts} fused parts)" if self.parts > 1 else "")


_DECLARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per module, what each parallel layer declared of its parameters (``declare``): ``{name: Placed}``. Kept
here, keyed by the module, not as an attribute of it; ``PlacementTable`` reads it once."""


def _name(p) -> str:
    return f"Shard({p.dim})" if isinstance(p, Shard) else type(p).__name__ + "()"


def declare(module: nn.Module, name: str, shards: dict | None = None, partial=(), transposed: bool = False,
            parts: int = 1) -> None:
    """Record on ``module`` how its parameter ``name`` lies: ``shards`` ``{dense dim: axis or (axes, outer
    first)}``, ``partial`` the axes its gradient is summed over. A parallel layer calls it for what it makes::

        declare(self, "weight", {1: "tp_row", 0: "tp_col"}, partial=("tp_dep",), transposed=True)
    """
    items = tuple((d, (a,) if isinstance(a, str) else tuple(a)) for d, a in (shards or {}).items())
    _DECLARED.setdefault(module, {})[name] = Placed(items, tuple(partial), transposed, parts)


def add_partial(module: nn.Module, name: str, axis: str) -> None:
    """Add ``axis`` to the axes ``module.<name>``'s gradient is summed over (never twice)."""
    p = declared(module, name)
    if axis not in p.partial:
        _DECLARED.setdefault(module, {})[name] = replace(p, partial=p.partial + (axis,))


def declared(module: nn.Module, name: str) -> Placed:
    """What ``module`` declared for its parameter ``name`` (replicated everywhere if nothing)."""
    return _DECLARED.get(module, {}).get(name, Placed())


def mark_parts(module: nn.Module, parts: int) -> None:
    """Every parameter ``module`` declared is ``parts`` fused blocks along dim 0 (a regrouped q/k/v)."""
    decl = _DECLARED.get(module, {})
    for n, p in list(decl.items()):
        if any(d == 0 for d, _ in p.shards):
            decl[n] = replace(p, parts=parts)


class PlacementTable:
    """Every parameter of a module with its ``Placed``, read once from the declarations of its modules.

    ``table[param]`` -> ``Placed``; ``table.partial(param)`` -> the axes its gradient is summed over;
    ``table.alias(copy, param, source)`` lets a copy (an fp32 master) answer as ``param`` does in
    ``source``. A parameter two modules hold (a tied head) is one entry, the partial axes of both.
    """

    def __init__(self, module: nn.Module | None = None):
        self.names: dict = {}     # id -> first name
        self.entries: dict = {}   # id -> Placed
        self.params: list = []
        if module is not None:
            for mname, mod in module.named_modules(remove_duplicate=False):
                for pname, p in mod.named_parameters(recurse=False):
                    self._add(p, f"{mname}.{pname}" if mname else pname, declared(mod, pname))

    def _add(self, p, name, placed):
        if id(p) not in self.entries:
            self.names[id(p)], self.entries[id(p)] = name, placed
            self.params.append(p)
        else:
            old = self.entries[id(p)]
            if not old.shards and placed.shards:
                old = replace(placed, partial=old.partial)
            more = tuple(a for a in placed.partial if a not in old.partial)
            self.entries[id(p)] = replace(old, partial=old.partial + more)

    def __getitem__(self, p) -> Placed:
        return self.entries.get(id(p), Placed())

    def __contains__(self, p) -> bool:
        return id(p) in self.entries

    def partial(self, p) -> tuple[str, ...]:
        return self[p].partial

    def alias(self, copy, of, source: PlacementTable | None = None) -> None:
        """Enter ``copy`` as ``of`` stands in ``source`` (default: this table); nothing if it is not there."""
        source = self if source is None else source
        if id(of) in source.entries:
            self._add(copy, source.names[id(of)], source.entries[id(of)])

    def replace(self, old, new) -> None:
        """``new`` takes ``old``'s entry, name and place in the order (ZeRO-3 making a meta parameter real)."""
        if id(old) in self.entries:
            self.names[id(new)], self.entries[id(new)] = self.names.pop(id(old)), self.entries.pop(id(old))
            self.params = [new if p is old else p for p in self.params]

    def rows(self, axes) -> list[tuple[str, tuple, str]]:
        """``(name, local shape, placements over axes)`` per parameter: what ``ck.placements(engine)`` prints."""
        return [(self.names[id(p)], tuple(p.shape), self.entries[id(p)].describe(axes)) for p in self.params]
