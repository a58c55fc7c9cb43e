"""Where each element a rank holds lives in the dense model, as tiles: a few ints per rectangle, none per element.

``local_space(engine)`` reads the engine's placement table (``colab_kit.placement``): each
parameter's declared placement (its ``Shard`` axes per dense dim, 2D's transposed ``[in, out]``
blocks, 3D's pieces, fused q/k/v parts) gives the runs of dense indices the rank holds per dim
(``Placed.local_ranges``), whatever the mode. The grads object's ``optimizer_layout()`` then says
which run of the parameter's flat elements each optimizer tensor holds (the parameter itself, a
ZeRO piece of a bucket or chunk, or its fp32 master). The two together are *tiles*: a rectangle
of the dense tensor's 2-D store (``store_shape``: 1-D as ``[1, n]``, ``[d0, d1 * ...]`` above 2-D)
and where it lies in optimizer tensor ``k``: a start and a stride per dense row and column, so it
is read and written as a strided view (``as_strided``), a slice, never through an index per
element. Sequence parallelism and recomputation change no parameter. The placements are tested
against every rank's real shards (``tests/ranks/test_placement.py``).

Worked example, GPT d_model=32 (4 layers) under ``ParallelConfig(dp=2, tp=2, zero=1)``; ranks are
``2 * dp + tp``, each optimizer tensor is the rank's ZeRO piece of one flat bucket (14,208 elements).
``blocks.1.mlp.fc2.weight`` ``[32, 128]`` is split by columns over tp (a tp rank 1 block is dense
columns 64-127, ``[32, 64]``), and the bucket's dp halves meet at row 3 of it::

    rank (dp, tp)   tiles of blocks.1.mlp.fc2.weight: dense rect (row, col, rows, cols), k, offset, strides
    0    (0, 0)     (0, 0, 3, 64)    in tensor 0 at 14016, strides (64, 1): rows 0-2 of columns 0-63
    1    (0, 1)     (0, 64, 3, 64)   in tensor 0 at 14016, strides (64, 1)
    2    (1, 0)     (3, 0, 29, 64)   in tensor 0 at 0, strides (64, 1): rows 3-31
    3    (1, 1)     (3, 64, 29, 64)  in tensor 0 at 0, strides (64, 1)

Each rank keeps 25 to 29 such tiles for the model's 53 tensors (1,600 to 1,856 bytes), where the
per-element map kept 113,664 bytes (14,208 elements x 8). A ZeRO cut inside a row adds a partial-row
tile. Under 2D (``transposed``) a tile's strides are ``(1, cols)``: a dense row is a local column.
Owners (``rects.owners``): of every region held by several ranks (dp copies without ZeRO, LayerNorms
over tp, ...) the lowest global rank writes it, decided on every rank from the same all-gathered
list of held rectangles.

What a rank keeps: 8 ints per tile (``LocalSpace.nbytes()``), a few tiles per parameter (one per
run of dense rows times run of columns times ZeRO cut, at most 3 x 3 for a fused, ZeRO-cut weight).
The per-element maps this replaced kept a dense and a local int32 position per element (8 bytes x
``LocalSpace.numel()``). A 66.6B GPT (d_model 8192, 80 layers, vocab 128256) under dp=8 tp=8
zero=3, rank 0: 325 tiles, 20,800 bytes, where the per-element map took 8,353,808,384 bytes
(``tests/ranks/test_checkpoint_scale.py``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..zero.optimizer import local_names
from .rects import flat_rects, intersect, mask_rectangles, overlap, owners, rectangles, segments, store_shape

__all__ = ["DenseTable", "LocalSpace", "Tile", "local_space", "rectangles", "mask_rectangles", "owners",
           "store_shape"]


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


class Tile(NamedTuple):
    """A rectangle ``(row, col, rows, cols)`` of a dense tensor's 2-D store, held in optimizer tensor ``k``:
    dense element ``(row + i, col + j)`` is at flat position ``offset + i * srow + j * scol`` of it."""
    row: int
    col: int
    rows: int
    cols: int
    k: int
    offset: int
    srow: int
    scol: int

    @property
    def rect(self) -> tuple[int, int, int, int]:
        return (self.row, self.col, self.rows, self.cols)


class LocalSpace:
    """This rank's optimizer tensors ``T_k`` and, per dense tensor, the tiles of it they hold (module docstring).

    ``tiles(name)``: its tiles; ``read`` / ``write`` move a dense rectangle's values out of / into tensors
    shaped like ``self.tensors`` (the parameters, or an optimizer state) by strided views."""

    def __init__(self, tensors: list[torch.Tensor], tiles: dict[str, list[Tile]], table: DenseTable):
        self.tensors, self.table, self._tiles = tensors, table, tiles
        for name, ts in tiles.items():
            if overlap([t.rect for t in ts], store_shape(table.shapes[name])):
                raise RuntimeError(f"colab_kit.checkpoint: an element of {name} appears twice among this rank's "
                                   "optimizer tensors; the layout is not one this module understands")

    def tiles(self, name: str) -> list[Tile]:
        return self._tiles.get(name, [])

    def tensor_ids(self, name: str) -> list[int]:
        """Which of ``self.tensors`` hold elements of ``name`` (sorted)."""
        return sorted({t.k for t in self.tiles(name)})

    def numel(self) -> int:
        """Elements this rank holds (what a per-element map would index: 8 bytes each with int32)."""
        return sum(t.rows * t.cols for ts in self._tiles.values() for t in ts)

    def nbytes(self) -> int:
        """Bytes of this rank's map: 8 ints of 8 bytes per tile. Grows with the tensors and their cuts, not
        with their elements (Python's objects hold a constant factor more; a packed int64 array this)."""
        return 8 * len(Tile._fields) * sum(len(ts) for ts in self._tiles.values())

    @staticmethod
    def _view(tensor: torch.Tensor, t: Tile, rect, write: bool) -> torch.Tensor:
        flat = tensor.detach().view(-1) if write else tensor.detach().reshape(-1)
        off = t.offset + (rect[0] - t.row) * t.srow + (rect[1] - t.col) * t.scol
        return flat.as_strided(rect[2:], (t.srow, t.scol), flat.storage_offset() + off)

    def read(self, values: list, name: str, rect) -> torch.Tensor:
        """The values of dense rectangle ``rect`` of ``name`` (all of it held here), on the CPU, ``[rows, cols]``."""
        out = None
        for t in self.tiles(name):
            part = intersect(t.rect, rect)
            if part is None:
                continue
            src = self._view(values[t.k], t, part, write=False)
            if out is None:
                out = torch.empty(rect[2:], dtype=src.dtype)
            r, c = part[0] - rect[0], part[1] - rect[1]
            out[r:r + part[2], c:c + part[3]] = src.cpu()
        return out if out is not None else torch.empty(rect[2:])

    @torch.no_grad()
    def write(self, values: list, name: str, block: torch.Tensor, origin=(0, 0)) -> None:
        """Store into ``values`` (in place) every held element of ``name`` that ``block`` has: a 2-D piece of
        the dense store whose first element is dense ``origin`` (the whole tensor by default)."""
        rect = (origin[0], origin[1], block.shape[0], block.shape[1])
        for t in self.tiles(name):
            part = intersect(t.rect, rect)
            if part is None:
                continue
            dst = self._view(values[t.k], t, part, write=True)
            r, c = part[0] - origin[0], part[1] - origin[1]
            dst.copy_(block[r:r + part[2], c:c + part[3]])


def _col_runs(shape: tuple, runs: list) -> list[tuple[int, int]]:
    """The runs of 2-D store columns (dims 1.. flattened) that the per-dim ``runs`` of dims 1.. select, in
    local order; trailing whole dims make one unit, so a weight whose dims 1.. are whole is one run."""
    unit, d = 1, len(shape)
    while d > 1 and runs[d - 1] == [(0, shape[d - 1])]:
        d, unit = d - 1, unit * shape[d - 1]
    starts = [0]
    for e in range(d - 1):  # dims before the last cut one: every index (only a tensor above 2-D cut inside)
        stride = math.prod(shape[e + 1:])
        starts = [s + i * stride for s in starts for a, n in runs[e] for i in range(a, a + n)]
    out: list[tuple[int, int]] = []
    for s in starts:
        for a, n in runs[d - 1]:
            at, length = s + a * unit, n * unit
            if out and out[-1][0] + out[-1][1] == at:
                out[-1] = (out[-1][0], out[-1][1] + length)
            elif length:
                out.append((at, length))
    return out


def _store_runs(shape: tuple, runs: list) -> tuple[list, list]:
    """``(row runs, column runs)`` of the 2-D store that per-dim ``runs`` select (``store_shape``'s cut)."""
    if len(shape) == 0:
        return [(0, 1)], [(0, 1)]
    if len(shape) == 1:
        return [(0, 1)], runs[0]
    return runs[0], _col_runs(shape[1:], runs[1:])


def param_tiles(shape, runs, transposed: bool, k: int, start: int, length: int, at: int) -> list[Tile]:
    """The tiles of a parameter whose block is the product of ``runs`` (per dense dim, ``local_ranges``) of a
    dense ``shape`` (``dense.T``'s block when ``transposed``) whose flat elements ``[start, start + length)``
    lie at ``[at, at + length)`` of optimizer tensor ``k``.

    >>> for t in param_tiles((4, 6), [[(0, 4)], [(3, 3)]], False, 0, 2, 7, 10):  # columns 3-5; block elements 2-8
    ...     print(t)
    Tile(row=0, col=5, rows=1, cols=1, k=0, offset=10, srow=3, scol=1)
    Tile(row=1, col=3, rows=2, cols=3, k=0, offset=11, srow=3, scol=1)
    """
    row_runs, col_runs = _store_runs(tuple(shape), runs)
    n_rows, n_cols = sum(n for _, n in row_runs), sum(n for _, n in col_runs)
    base, out = at - start, []
    if transposed:  # the local block is [cols, rows]: a local row is a dense column
        for lr, lc, ln, lm in flat_rects(start, length, n_rows):
            for loc_r, dc, nc in segments(lr, ln, col_runs):
                for loc_c, dr, nr in segments(lc, lm, row_runs):
                    out.append(Tile(dr, dc, nr, nc, k, base + loc_r * n_rows + loc_c, 1, n_rows))
        return out
    for lr, lc, ln, lm in flat_rects(start, length, n_cols):
        for loc_r, dr, nr in segments(lr, ln, row_runs):
            for loc_c, dc, nc in segments(lc, lm, col_runs):
                out.append(Tile(dr, dc, nr, nc, k, base + loc_r * n_cols + loc_c, n_cols, 1))
    return out


def _dense_names(engine) -> dict[int, str]:
    """id(parameter) -> its name in the dense model (``colab_kit.zero.optimizer.local_names``)."""
    return local_names(engine.module)


def local_space(engine) -> LocalSpace:
    """This rank's optimizer tensors and the tiles of the dense model they hold (module docstring).

    Each parameter's runs of dense indices come from its placement (``engine.placement_table``,
    ``Placed.local_ranges``), then the grads object's ``optimizer_layout()`` says where in the optimizer's
    tensors each run of its flat elements lies. Costs a few tiles per parameter, none per element."""
    mine = [p for p in engine.module.parameters() if p.requires_grad]
    layout = engine.step.optimizer_layout()
    names = _dense_names(engine)
    if engine.policy is None:  # dp / ZeRO only: the local model is the dense one
        table = DenseTable([(n, tuple(p.shape)) for n, p in engine.module.named_parameters() if p.requires_grad])
    else:
        table = DenseTable([(n, tuple(p.shape)) for n, p in engine.dense_twin.named_parameters()])
    runs_of: dict[int, list] = {}
    for k, (_, runs) in enumerate(layout):
        for p, start, length, at in runs:
            runs_of.setdefault(id(p), []).append((k, start, length, at))
    tiles: dict[str, list[Tile]] = {}
    for p in mine:
        name = names.get(id(p))
        if name not in table.index:
            raise RuntimeError(f"colab_kit.checkpoint: this rank's parameter {name} is not one of the dense "
                               "model's; the engine's sharding changed without this module")
        placed, shape = engine.placement_table[p], table.shapes[name]
        runs = placed.local_ranges(shape, engine.mesh)
        held = math.prod(sum(n for _, n in r) for r in runs)
        if held != p.numel() or (placed.transposed and len(shape) != 2):
            raise RuntimeError(f"colab_kit.checkpoint: the placement of {name} gives {held} elements, "
                               f"the rank holds {p.numel()}: its layer declared a wrong placement")
        for k, start, length, at in runs_of.get(id(p), ()):
            tiles.setdefault(name, []).extend(param_tiles(shape, runs, placed.transposed, k, start, length, at))
    return LocalSpace([t for t, _ in layout], {n: tiles[n] for n in table.names if n in tiles}, table)
