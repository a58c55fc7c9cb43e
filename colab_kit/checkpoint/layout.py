"""Where each element a rank holds lives in the dense model: index maps, rectangles, owners.

``local_space(engine)`` reads the engine's placement table (``colab_kit.placement``): each
parameter's declared placement (its ``Shard`` axes per dense dim, 2D's transposed ``[in, out]``
blocks, 3D's pieces, fused q/k/v parts) gives the dense index of every element the rank holds
(``Placed.local_index``, from one index vector per dim), whatever the mode. The grads object's
``optimizer_layout()`` then says which parameter elements each optimizer tensor holds (the
parameter itself, a ZeRO piece of a bucket or chunk, or its fp32 master), and the index map
follows them. Sequence parallelism and recomputation change no parameter. The placements are
tested against every rank's real shards (``tests/ranks/test_placement.py``).

A dense tensor is stored 2-D (``store_shape``: 1-D as ``[1, n]`` in the rectangles here, and
``[d0, d1 * ...]`` above 2-D); what a rank holds of it is cut into rectangles (``rectangles``):
rows with the same mask form one band, each run of columns in a band one rectangle. A row
block, a column block, a 2D tile and a ZeRO piece (a few partial rows and a full block) are all
one to three rectangles. Owners (``owners``): of every region held by several ranks (dp
copies without ZeRO, LayerNorms over tp, ...) the lowest global rank writes it, decided on
every rank from the same all-gathered list of held rectangles.
"""
from __future__ import annotations

import math

import torch

from ..zero.optimizer import local_names

__all__ = ["DenseTable", "LocalSpace", "local_space", "rectangles", "owners", "store_shape"]


def store_shape(shape) -> tuple[int, int]:
    """The 2-D shape a dense tensor is cut in: ``[4, 6] -> (4, 6)``, ``[8] -> (1, 8)``, ``[] -> (1, 1)``."""
    shape = tuple(shape)
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    return (shape[0], math.prod(shape[1:]))


class DenseTable:
    """The dense model's parameters in order: name, shape, global offset of its first element."""

    def __init__(self, named: list[tuple[str, tuple[int, ...]]]):
        self.names = [n for n, _ in named]
        self.shapes = {n: tuple(s) for n, s in named}
        self.numel = {n: math.prod(s) for n, s in named}
        offs, off = [], 0
        for n in self.names:
            offs.append(off)
            off += self.numel[n]
        self.offset = dict(zip(self.names, offs))
        self.index = {n: j for j, n in enumerate(self.names)}
        self.total = off
        self.starts = torch.tensor(offs + [off], dtype=torch.int64)

    def as_list(self) -> list:
        return [[n, list(self.shapes[n])] for n in self.names]


class LocalSpace:
    """This rank's optimizer tensors ``T_k`` seen as one flat space of ``sum(numel)`` positions.

    ``held(name)`` -> (dense flat positions, local positions) of the elements of ``name`` here
    (int32 below 2**31 elements: 8 bytes per element this rank holds, and nothing for padding).
    """

    def __init__(self, tensors: list[torch.Tensor], held: dict, table: DenseTable, dtype: torch.dtype):
        self.tensors, self.table, self._held = tensors, table, held
        self.sizes = [t.numel() for t in tensors]
        cum = [0]
        for n in self.sizes:
            cum.append(cum[-1] + n)
        self.starts = torch.tensor(cum, dtype=dtype)
        for name, (dpos, _) in held.items():
            if torch.unique(dpos).numel() != dpos.numel():
                raise RuntimeError(f"colab_kit.checkpoint: an element of {name} appears twice among this rank's "
                                   "optimizer tensors; the layout is not one this module understands")

    def held(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        empty = torch.zeros(0, dtype=self.starts.dtype)
        return self._held.get(name, (empty, empty))

    def read(self, values: list[torch.Tensor], pos: torch.Tensor) -> torch.Tensor:
        """Elements at local positions ``pos`` of ``values`` (tensors shaped like ``self.tensors``), on the CPU."""
        out = torch.empty(pos.numel(), dtype=values[0].dtype if values else torch.float32)
        for k, sel, local in self._split(pos):
            out[sel] = values[k].detach().reshape(-1)[local.to(values[k].device)].cpu()
        return out

    @torch.no_grad()
    def write(self, values: list[torch.Tensor], pos: torch.Tensor, data: torch.Tensor) -> None:
        """Store ``data`` (one value per position in ``pos``) into ``values`` in place."""
        for k, sel, local in self._split(pos):
            flat = values[k].view(-1)
            flat[local.to(flat.device)] = data[sel].to(device=flat.device, dtype=flat.dtype)

    def _split(self, pos: torch.Tensor):
        if not pos.numel():
            return
        lo, hi = (int(torch.searchsorted(self.starts, int(f(pos)), right=True)) - 1 for f in (torch.min, torch.max))
        if lo == hi:  # all in one tensor (a parameter's elements mostly are)
            yield lo, slice(None), pos - self.starts[lo]
            return
        k = torch.searchsorted(self.starts, pos, right=True) - 1
        for kk in torch.unique(k).tolist():
            sel = (k == kk).nonzero().flatten()
            yield kk, sel, pos[sel] - self.starts[kk]


def _dense_names(engine) -> dict[int, str]:
    """id(parameter) -> its name in the dense model (``colab_kit.zero.optimizer.local_names``)."""
    return local_names(engine.module)


def local_space(engine) -> LocalSpace:
    """This rank's optimizer tensors and the dense index of each of their elements (module docstring).

    Each parameter's elements come from its placement (``engine.placement_table``,
    ``Placed.local_index``: one index vector per dim, no dense tensor is made), then the grads object's
    ``optimizer_layout()`` says where in the optimizer's tensors each run of them lies. Costs a dense and
    a local position per element this rank holds (int32 below 2**31 elements)."""
    mine = [p for p in engine.module.parameters() if p.requires_grad]
    layout = engine.step.optimizer_layout()
    names = _dense_names(engine)
    if engine.policy is None:  # dp / ZeRO only: the local model is the dense one
        table = DenseTable([(n, tuple(p.shape)) for n, p in engine.module.named_parameters() if p.requires_grad])
    else:
        table = DenseTable([(n, tuple(p.shape)) for n, p in engine.dense_twin.named_parameters()])
    dtype = torch.int32 if table.total < 2 ** 31 - 1 else torch.int64
    starts = [0]
    for t, _ in layout:
        starts.append(starts[-1] + t.numel())
    runs_of: dict[int, list] = {}
    for k, (_, runs) in enumerate(layout):
        for p, start, length, at in runs:
            runs_of.setdefault(id(p), []).append((k, start, length, at))
    parts: dict[int, list] = {}  # dense parameter -> [(dense positions, local positions)]
    for p in mine:  # one parameter's index at a time, and only where it is split
        name = names.get(id(p))
        if name not in table.index:
            raise RuntimeError(f"colab_kit.checkpoint: this rank's parameter {name} is not one of the dense "
                               "model's; the engine's sharding changed without this module")
        placed, j = engine.placement_table[p], table.index[name]
        flat = None
        if placed.shards or placed.transposed:
            flat = placed.local_index(table.shapes[name], engine.mesh).reshape(-1).to(dtype)
            if flat.numel() != p.numel():
                raise RuntimeError(f"colab_kit.checkpoint: the placement of {name} gives {flat.numel()} elements, "
                                   f"the rank holds {p.numel()}: its layer declared a wrong placement")
        for k, start, length, at in runs_of.get(id(p), ()):
            local = torch.arange(starts[k] + at, starts[k] + at + length, dtype=dtype)
            dense = torch.arange(start, start + length, dtype=dtype) if flat is None else flat[start:start + length]
            parts.setdefault(j, []).append((dense, local))
        del flat
    held = {}
    for j, chunks in sorted(parts.items()):
        held[table.names[j]] = (torch.cat([d for d, _ in chunks]), torch.cat([lp for _, lp in chunks]))
        chunks.clear()
    return LocalSpace([t for t, _ in layout], held, table, dtype)


def rectangles(dense_pos: torch.Tensor, shape2d: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """The rectangles ``(row, col, rows, cols)`` covering the flat positions ``dense_pos`` of a
    ``shape2d`` tensor: bands of equal rows, runs of columns in each band.

    >>> rectangles(torch.tensor([2, 3, 6, 7, 10, 11]), (3, 4))      # columns 2-3 of 3 rows
    [(0, 2, 3, 2)]
    >>> rectangles(torch.tensor([3, 4, 5, 6, 7]), (2, 4))           # a ZeRO piece: 1 + 4 elements
    [(0, 3, 1, 1), (1, 0, 1, 4)]
    """
    r, c = shape2d
    mask = torch.zeros(r * c, dtype=torch.bool)
    mask[dense_pos] = True
    return mask_rectangles(mask.view(r, c))


def mask_rectangles(mask: torch.Tensor) -> list[tuple[int, int, int, int]]:
    if not bool(mask.any()):
        return []
    r = mask.shape[0]
    change = torch.ones(r, dtype=torch.bool)
    change[1:] = (mask[1:] != mask[:-1]).any(1)
    bands = change.nonzero().flatten().tolist() + [r]
    out = []
    for a, b in zip(bands[:-1], bands[1:]):
        row = torch.cat([torch.zeros(1, dtype=torch.int8), mask[a].to(torch.int8), torch.zeros(1, dtype=torch.int8)])
        d = row[1:] - row[:-1]
        for s, e in zip((d == 1).nonzero().flatten().tolist(), (d == -1).nonzero().flatten().tolist()):
            out.append((a, s, b - a, e - s))
    return out


def owners(held_by_rank: list[list], shape2d: tuple[int, int]) -> list[list[tuple[int, int, int, int]]]:
    """For each rank (in order), the rectangles it writes: what it holds that no lower rank holds.
    Raises if some element is held by no rank (a layout this module does not understand)."""
    r, c = shape2d
    covered = torch.zeros(r, c, dtype=torch.bool)
    out = []
    for rects in held_by_rank:
        mask = torch.zeros(r, c, dtype=torch.bool)
        for a, b, n, m in rects:
            mask[a:a + n, b:b + m] = True
        out.append(mask_rectangles(mask & ~covered))
        covered |= mask
    if not bool(covered.all()):
        raise RuntimeError(f"colab_kit.checkpoint: {int((~covered).sum())} elements of a tensor {list(shape2d)} are "
                           "held by no rank")
    return out
