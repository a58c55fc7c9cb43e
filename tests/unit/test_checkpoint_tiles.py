"""The checkpoint's tiles (``colab_kit.checkpoint.layout``, ``rects``), in one process, against per-element truth.

1. ``param_tiles`` of a placement (row, column and 2D transposed blocks, fused q/k/v parts, a tensor above
   2-D) cut by any ZeRO run gives exactly the (dense position, local position) pairs of the per-element map
   the checkpoint used to build (``Placed.local_index``); a wrong stride or a dropped part fails it.
2. ``owners`` on its compressed grid gives what the old dense mask gave, on random layouts.
3. ``LocalSpace.read`` / ``write`` move values through strided views: a dense tensor written into a
   rank's tensors and read back is itself where the rank holds it, and nothing else is touched.
4. The map's bytes do not grow with the elements: the same tiles for a block 64 times larger, while the
   per-element map (8 bytes per element) grows 64 times.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from colab_kit.checkpoint.layout import DenseTable, LocalSpace, Tile, _store_runs, param_tiles
from colab_kit.checkpoint.rects import flat_rects, mask_rectangles, owners, store_shape
from colab_kit.placement import Placed


class Mesh:
    """What ``Placed`` asks of a mesh: each axis's size and this rank's index on it."""

    def __init__(self, **axes):
        self.axes = axes

    def size(self, axis):
        return self.axes[axis][0]

    def rank(self, axis):
        return self.axes[axis][1]


def expand(tiles, shape) -> list[tuple[int, int]]:
    """(dense flat position, local flat position) of every element of ``tiles`` (one tensor, k = 0)."""
    cols = store_shape(shape)[1]
    out = []
    for t in tiles:
        for i in range(t.rows):
            for j in range(t.cols):
                out.append(((t.row + i) * cols + t.col + j, t.offset + i * t.srow + j * t.scol))
    return sorted(out)


CASES = [  # (dense shape, placement, mesh)
    ((12, 8), Placed(((0, ("tp",)),)), Mesh(tp=(2, 1))),                                  # row block
    ((12, 8), Placed(((1, ("tp",)),)), Mesh(tp=(4, 2))),                                  # column block
    ((12, 8), Placed(((1, ("tp_row",)), (0, ("tp_col",))), transposed=True),              # 2D: W.T's tile
     Mesh(tp_row=(2, 1), tp_col=(2, 0))),
    ((24, 8), Placed(((0, ("tp",)),), parts=3), Mesh(tp=(2, 1))),                          # fused q | k | v
    ((8,), Placed(((0, ("tp",)),)), Mesh(tp=(4, 3))),                                     # a vector
    ((6, 4, 5), Placed(((0, ("tp",)),)), Mesh(tp=(2, 0))),                                # above 2-D, dim 0
    ((3, 4, 6), Placed(((2, ("tp",)),)), Mesh(tp=(2, 1))),                                # above 2-D, cut inside
    ((12, 8), Placed(((0, ("a", "b")),)), Mesh(a=(2, 1), b=(3, 2))),                      # two axes on one dim
    ((12, 8), Placed(), Mesh()),                                                          # whole
]


@pytest.mark.parametrize("shape, placed, mesh", CASES, ids=range(len(CASES)))
def test_tiles_are_the_per_element_map(shape, placed, mesh):
    index = placed.local_index(shape, mesh).reshape(-1).tolist()  # local flat -> dense flat, element by element
    runs = placed.local_ranges(shape, mesh)
    n = len(index)
    assert math.prod(sum(length for _, length in r) for r in runs) == n
    rows, cols = _store_runs(shape, runs)
    rng = random.Random(0)
    cuts = [(0, n)] + [tuple(sorted(rng.sample(range(n + 1), 2))) for _ in range(20)]  # ZeRO pieces of the block
    for a, b in cuts:
        at = 7  # where the piece starts in the optimizer tensor
        tiles = param_tiles(shape, runs, placed.transposed, 0, a, b - a, at)
        want = sorted((index[i], at + i - a) for i in range(a, b))
        assert expand(tiles, shape) == want, (shape, placed, a, b)
        assert len(tiles) <= 3 * len(rows) * len(cols), tiles  # a ZeRO cut's 3 row pieces x the block's runs
    if placed.transposed or placed.parts > 1:  # the comparison can fail: without the transpose or the parts
        wrong = Placed(placed.shards, placed.partial)
        tiles = param_tiles(shape, wrong.local_ranges(shape, mesh), False, 0, 0, n, 0)
        assert expand(tiles, shape) != sorted((d, i) for i, d in enumerate(index))


def _old_owners(held_by_rank, shape2d):
    """The dense-mask algorithm the checkpoint ran before (one bool per element)."""
    r, c = shape2d
    covered, out = torch.zeros(r, c, dtype=torch.bool), []
    for rects in held_by_rank:
        mask = torch.zeros(r, c, dtype=torch.bool)
        for a, b, n, m in rects:
            mask[a:a + n, b:b + m] = True
        out.append(mask_rectangles(mask & ~covered))
        covered |= mask
    return out, int((~covered).sum())


def test_owners_on_the_compressed_grid_equal_the_dense_mask():
    rng = random.Random(1)
    for _ in range(200):
        shape = (rng.randint(1, 9), rng.randint(1, 9))
        held = []
        for _ in range(rng.randint(1, 4)):
            rects = []
            for _ in range(rng.randint(0, 3)):
                a, b = rng.randrange(shape[0]), rng.randrange(shape[1])
                rects.append((a, b, rng.randint(1, shape[0] - a), rng.randint(1, shape[1] - b)))
            held.append(rects)
        want, missing = _old_owners(held, shape)
        if missing:
            with pytest.raises(RuntimeError, match=f"{missing} elements of a tensor .* held by no rank"):
                owners(held, shape)
        else:
            assert owners(held, shape) == want, (held, shape)


def test_flat_rects_cover_the_run():
    for start in range(0, 20):
        for length in range(0, 20):
            got = sorted((r * 5 + c + j) for r0, c, n, m in flat_rects(start, length, 5)
                         for r in range(r0, r0 + n) for j in range(m))
            assert got == list(range(start, start + length))


def _space(dense_shape, placed, mesh, pieces):
    """A rank's tensors (one per ZeRO piece of the block) and their LocalSpace, for one dense tensor ``w``."""
    runs = placed.local_ranges(dense_shape, mesh)
    tensors, tiles = [], []
    for k, (a, b) in enumerate(pieces):
        tensors.append(torch.full((b - a,), -1.0))
        tiles += param_tiles(dense_shape, runs, placed.transposed, k, a, b - a, 0)
    return LocalSpace(tensors, {"w": tiles}, DenseTable([("w", dense_shape)]))


def test_read_and_write_move_values_by_views():
    shape, mesh = (12, 8), Mesh(tp_row=(2, 1), tp_col=(2, 0))
    placed = Placed(((1, ("tp_row",)), (0, ("tp_col",))), transposed=True)
    dense = torch.randn(shape)
    local = placed.local(dense, Mesh(tp_row=(2, 1), tp_col=(2, 0))).reshape(-1)  # what the rank really holds
    space = _space(shape, placed, mesh, [(0, 5), (5, 19), (19, local.numel())])  # three ZeRO pieces
    space.write(space.tensors, "w", dense)
    assert torch.equal(torch.cat(space.tensors), local)
    for t in space.tiles("w"):  # each tile read back is the dense rectangle
        assert torch.equal(space.read(space.tensors, "w", t.rect), dense[t.row:t.row + t.rows, t.col:t.col + t.cols])
    block = dense[2:5, 1:7]  # a piece of the dense tensor only: the rest of the rank's elements keep their values
    before = [x.clone() for x in space.tensors]
    space.write(space.tensors, "w", block * 0, origin=(2, 1))
    changed = sum(int((x != y).sum()) for x, y in zip(space.tensors, before))
    held = {d for d, _ in expand(space.tiles("w"), shape)}
    assert changed == len(held & {r * 8 + c for r in range(2, 5) for c in range(1, 7)}) > 0


def test_overlapping_tiles_are_refused():
    tiles = [Tile(0, 0, 2, 2, 0, 0, 2, 1), Tile(1, 1, 1, 1, 0, 4, 1, 1)]
    with pytest.raises(RuntimeError, match="appears twice"):
        LocalSpace([torch.zeros(5)], {"w": tiles}, DenseTable([("w", (4, 4))]))


def test_the_map_does_not_grow_with_the_elements():
    """A fused q | k | v weight cut by rows over tp and in two ZeRO pieces: the same tiles at 64 times the
    elements. The
    per-element map (a dense and a local int32 per element, what the checkpoint held before) grows 64 times,
    past the bound the tiles stay under: this bound fails the old map."""
    placed, mesh = Placed(((0, ("tp",)),), parts=3), Mesh(tp=(2, 1))
    sizes = {}
    for d in (64, 512):
        shape = (3 * d, d)
        n = math.prod(shape) // 2
        space = _space(shape, placed, mesh, [(0, n // 3 + 5), (n // 3 + 5, n)])
        sizes[d] = space.nbytes(), 8 * space.numel()
    (small, old_small), (big, old_big) = sizes[64], sizes[512]
    assert small == big <= 64 * 18  # at most 3 rows' cuts x 3 parts x 2 pieces tiles of 64 bytes
    assert old_big == 64 * old_small and old_small > 64 * 18
