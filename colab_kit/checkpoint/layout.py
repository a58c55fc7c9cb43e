"""Where each element a rank holds lives in the dense model: index maps, rectangles, owners.

``local_space(engine)`` replays the engine's sharding on an *index model*: ``GPT(cfg)`` on the
meta device in float64 whose every parameter is made (``colab_kit.init``'s recipes) holding
its own global dense indices, ``offset(name) + arange(numel)`` (exact below 2**53). The same
tensor plan (``plan.parallelize``, a fresh one on the engine's mesh: its ``from_dense``
constructors slice, transpose and copy, never compute) and the same pipeline split turn it
into this rank's parameters, so each local element carries the dense index it came from,
whatever the mode: 1D row/column blocks, 2D's transposed ``[in, out]`` blocks, 3D's pieces.
The grads object's ``optimizer_layout()`` then says which parameter elements each optimizer
tensor holds (the parameter itself, a ZeRO piece of a bucket or chunk, or its fp32 master),
and the index map follows them. Sequence parallelism and recomputation change no parameter.

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
import torch.nn as nn

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
        self.total = off
        self.starts = torch.tensor(offs + [off], dtype=torch.int64)

    def as_list(self) -> list:
        return [[n, list(self.shapes[n])] for n in self.names]


class LocalSpace:
    """This rank's optimizer tensors ``T_k`` seen as one flat space of ``sum(numel)`` positions.

    ``gidx``: per position, the global dense index of the element there (-1: ZeRO padding).
    ``held(name)`` -> (dense flat positions, local positions) of the elements of ``name`` here.
    """

    def __init__(self, tensors: list[torch.Tensor], gidx: torch.Tensor, table: DenseTable):
        self.tensors, self.gidx, self.table = tensors, gidx, table
        self.sizes = [t.numel() for t in tensors]
        self.starts = torch.tensor([0] + list(torch.tensor(self.sizes).cumsum(0).tolist()), dtype=torch.int64) \
            if tensors else torch.zeros(1, dtype=torch.int64)
        valid = (gidx >= 0).nonzero().flatten()
        g = gidx[valid]
        order = torch.argsort(g)
        self._sorted, self._pos = g[order], valid[order]
        if self._sorted.numel() > 1 and bool((self._sorted[1:] == self._sorted[:-1]).any()):
            raise RuntimeError("colab_kit.checkpoint: a dense element appears twice among this rank's optimizer "
                               "tensors; the layout is not one this module understands")

    def held(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        lo_g = self.table.offset[name]
        hi_g = lo_g + self.table.numel[name]
        lo = int(torch.searchsorted(self._sorted, lo_g))
        hi = int(torch.searchsorted(self._sorted, hi_g))
        return self._sorted[lo:hi] - lo_g, self._pos[lo:hi]

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
        k = torch.searchsorted(self.starts, pos, right=True) - 1
        for kk in torch.unique(k).tolist():
            sel = (k == kk).nonzero().flatten()
            yield kk, sel, pos[sel] - self.starts[kk]


def _index_model(engine) -> tuple[nn.Module, DenseTable]:
    """The engine's model rebuilt with dense indices for values, sharded as the engine sharded it."""
    from ..init import defer, materialize
    cfg, config, mesh = engine.model_cfg, engine.config, engine.mesh
    if cfg is None:  # not a GPT: tp = pp = 1 (boost refuses them otherwise), the local model is dense
        named = [(n, tuple(p.shape)) for n, p in engine.module.named_parameters() if p.requires_grad]
        table = DenseTable(named)
        model = nn.Module()
        model._ps = nn.ParameterList(nn.Parameter(_arange(table, n), requires_grad=False) for n, _ in named)
        return model, table
    from ..models import GPT
    model = GPT(cfg, device="meta").to(torch.float64)
    table = DenseTable([(n, tuple(p.shape)) for n, p in model.named_parameters()])
    model.init_parameter = lambda name, out: out.copy_(_arange(table, name).view(out.shape))
    defer(model, config, mesh.rank("pp"))
    if config.tp > 1:
        from ..tensor import plan_for
        model = plan_for(mesh).parallelize(model)
    if config.pp > 1:
        from ..pipeline.stage import split_model
        model = nn.ModuleList(split_model(model, config, mesh.rank("pp")))
    return materialize(model), table


def _arange(table: DenseTable, name: str) -> torch.Tensor:
    off = table.offset[name]
    return torch.arange(off, off + table.numel[name], dtype=torch.float64).view(table.shapes[name])


def local_space(engine) -> LocalSpace:
    """This rank's optimizer tensors and the dense index of each of their elements (module docstring)."""
    index_model, table = _index_model(engine)
    mine = [p for p in engine.module.parameters() if p.requires_grad]
    idx = list(index_model.parameters())
    if len(idx) != len(mine) or any(a.shape != b.shape for a, b in zip(idx, mine)):
        raise RuntimeError("colab_kit.checkpoint: the index model's parameters do not match this engine's "
                           f"({len(idx)} against {len(mine)}); the engine's sharding changed without this module")
    dtype = torch.int32 if table.total < 2 ** 31 - 1 else torch.int64
    of = {id(p): t.detach().reshape(-1).to(dtype) for p, t in zip(mine, idx)}
    del index_model, idx
    tensors, pieces = [], []
    for t, runs in engine.grads.optimizer_layout():
        g = torch.full((t.numel(),), -1, dtype=dtype)
        for p, start, length, at in runs:
            g[at:at + length] = of[id(p)][start:start + length]
        tensors.append(t)
        pieces.append(g)
    gidx = torch.cat(pieces).to(torch.int64) if pieces else torch.zeros(0, dtype=torch.int64)
    return LocalSpace(tensors, gidx, table)


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
