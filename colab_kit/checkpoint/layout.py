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


def _sharded(config) -> bool:
    return config.tp > 1 or config.pp > 1


def _units(names: list[str], blocks: str = "blocks") -> list[list[str]]:
    """The replay's units: each block's parameters together (``blocks``: the policy's path of the
    blocks list), every other parameter alone."""
    units: dict[str, list[str]] = {}
    depth = blocks.count(".") + 2
    for n in names:
        parts = n.split(".")
        inside = n.startswith(blocks + ".") and len(parts) > depth
        key = ".".join(parts[:depth]) if inside else n
        units.setdefault(key, []).append(n)
    return list(units.values())


def _replay(engine, table: DenseTable, unit: set[str]):
    """This rank's parameters (in the engine's order) rebuilt from a float64 twin of the model whose
    parameters in ``unit`` hold their global dense indices; the others stay meta (nothing is made for
    them). The twin goes through the engine's own policy: the same tensor plan, the same pipeline split."""
    from ..init import _RECIPE, defer, meta_twin
    config, mesh, policy = engine.config, engine.mesh, engine.policy
    model = meta_twin(engine._twin).to(torch.float64)
    model.init_parameter = lambda name, out: out.copy_(_arange(table, name).view(out.shape))
    defer(model, config, mesh.rank("pp"), policy)
    for name, t in model.named_parameters():
        if name not in unit and hasattr(t, _RECIPE):
            delattr(t, _RECIPE)
    if config.tp > 1:
        from ..tensor import plan_for
        model = plan_for(mesh).parallelize(model, policy)
    if config.pp > 1:
        from ..pipeline.stage import split_model
        model = nn.ModuleList(split_model(model, config, mesh.rank("pp"), policy))
    out = []
    for p in model.parameters():  # cut by the plan: real; left whole: its name (the indices are an arange)
        recipe = getattr(p, _RECIPE, None) if p.is_meta else None
        out.append(p if recipe is None else recipe[1])
    return out


def _arange(table: DenseTable, name: str) -> torch.Tensor:
    off = table.offset[name]
    return torch.arange(off, off + table.numel[name], dtype=torch.float64).view(table.shapes[name])


def local_space(engine) -> LocalSpace:
    """This rank's optimizer tensors and the dense index of each of their elements (module docstring).

    The index model is replayed one unit at a time (a block, or one other parameter), so this costs
    one unit's local parameters in float64 at a time (and, inside the tensor plan, the dense float64
    tensor it cuts), plus the result: a dense and a local position per element (int32)."""
    mine = [p for p in engine.module.parameters() if p.requires_grad]
    layout = engine.grads.optimizer_layout()
    runs_of: dict[int, list] = {}
    for k, (t, runs) in enumerate(layout):
        for p, start, length, at in runs:
            runs_of.setdefault(id(p), []).append((k, start, length, at))
    if engine.policy is None or not _sharded(engine.config):  # the local model is dense (dp / ZeRO only)
        table = DenseTable([(n, tuple(p.shape)) for n, p in engine.module.named_parameters() if p.requires_grad])
        units, replay = [table.names], lambda unit: list(table.names)
    else:
        table = DenseTable([(n, tuple(p.shape)) for n, p in engine._twin.named_parameters()])
        units = _units(table.names, engine.policy.blocks)
        replay = lambda unit: _replay(engine, table, set(unit))  # noqa: E731
    dtype = torch.int32 if table.total < 2 ** 31 - 1 else torch.int64
    starts = [0]
    for t, _ in layout:
        starts.append(starts[-1] + t.numel())
    parts: dict[int, list] = {}  # dense parameter -> [(dense positions, local positions)]
    for unit in units:
        idx = replay(unit)
        shapes = [table.shapes[a] if isinstance(a, str) else tuple(a.shape) for a in idx]
        if len(idx) != len(mine) or any(a != tuple(b.shape) for a, b in zip(shapes, mine)):
            raise RuntimeError("colab_kit.checkpoint: the index model's parameters do not match this engine's "
                               f"({len(idx)} against {len(mine)}); the engine's sharding changed without this module")
        for p, values in zip(mine, idx):
            if not isinstance(values, str) and values.is_meta:
                continue
            flat = None if isinstance(values, str) else values.detach().reshape(-1)
            for k, start, length, at in runs_of.get(id(p), ()):
                local = torch.arange(starts[k] + at, starts[k] + at + length, dtype=dtype)
                if flat is None:  # a whole dense tensor: its positions are known without making them
                    parts.setdefault(table.index[values], []).append(
                        (torch.arange(start, start + length, dtype=dtype), local))
                    continue
                seg = flat[start:start + length]
                j = int(torch.searchsorted(table.starts, int(seg.min()), right=True)) - 1
                if int(seg.max()) < int(table.starts[j + 1]):  # one dense tensor (every plan cuts so)
                    parts.setdefault(j, []).append(((seg - float(table.starts[j])).to(dtype), local))
                    continue
                g = seg.to(torch.int64)
                owner = torch.searchsorted(table.starts, g, right=True) - 1
                for j in torch.unique(owner).tolist():
                    sel = owner == j
                    parts.setdefault(j, []).append(((g[sel] - table.starts[j]).to(dtype), local[sel]))
        del idx
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
