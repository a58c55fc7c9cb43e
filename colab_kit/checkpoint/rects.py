"""Rectangle arithmetic on a dense tensor stored 2-D: what a rank holds, what it writes, and where.

Everything here costs a few ints per rectangle, never one per element. A rectangle is
``(row, col, rows, cols)`` of a tensor's 2-D store (``store_shape``). ``owners`` decides which
rank writes each region several ranks hold on a *compressed grid*: only the row and column
boundaries of the rectangles given are kept, so a ``[128256, 8192]`` table held by 64 ranks is a
grid of at most ~130 x 130 cells, not a 1 GB mask. ``flat_rects`` cuts a run of a tensor's flat
elements (a ZeRO piece) into at most 3 rectangles of its rows; ``segments`` finds where an
interval of local indices falls among the runs of dense indices a rank holds.

Worked example, ``ParallelConfig(dp=2, tp=2)``, a ``[96, 32]`` weight split by rows over tp: ranks
0 and 2 hold ``(0, 0, 48, 32)``, ranks 1 and 3 ``(48, 0, 48, 32)``; ``owners`` gives rank 0 and
rank 1 their rectangle and ranks 2 and 3 nothing (their copies are written by a lower rank).
"""
from __future__ import annotations

import math

import torch

__all__ = ["store_shape", "rectangles", "mask_rectangles", "owners", "flat_rects", "segments", "intersect",
           "overlap"]


def store_shape(shape) -> tuple[int, int]:
    """The 2-D shape a dense tensor is cut in: ``[4, 6] -> (4, 6)``, ``[8] -> (1, 8)``, ``[] -> (1, 1)``."""
    shape = tuple(shape)
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    return (shape[0], math.prod(shape[1:]))


def rectangles(dense_pos: torch.Tensor, shape2d: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """The rectangles ``(row, col, rows, cols)`` covering the flat positions ``dense_pos`` of a
    ``shape2d`` tensor: bands of equal rows, runs of columns in each band (a helper for position
    lists; the checkpoint itself never makes one).

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
    """The rectangles of a boolean matrix's True cells: bands of equal rows, runs of columns in each."""
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


def _grid(rect_lists: list[list], shape2d: tuple[int, int]):
    """The row and column boundaries of every rectangle given (and of the tensor), and a function
    rectangle -> its cells' slices on that compressed grid."""
    r, c = shape2d
    rows = sorted({0, r, *(x for rects in rect_lists for a, _, n, _ in rects for x in (a, a + n))})
    cols = sorted({0, c, *(x for rects in rect_lists for _, b, _, m in rects for x in (b, b + m))})
    ri, ci = {v: i for i, v in enumerate(rows)}, {v: i for i, v in enumerate(cols)}

    def cells(rect):
        a, b, n, m = rect
        return slice(ri[a], ri[a + n]), slice(ci[b], ci[b + m])
    return rows, cols, cells


def owners(held_by_rank: list[list], shape2d: tuple[int, int]) -> list[list[tuple[int, int, int, int]]]:
    """For each rank (in order), the rectangles it writes: what it holds that no lower rank holds.
    Raises if some element is held by no rank (a layout this module does not understand).

    >>> owners([[(0, 0, 2, 4)], [(0, 0, 2, 4)], [(1, 0, 1, 4)]], (2, 4))     # a dp copy writes nothing
    [[(0, 0, 2, 4)], [], []]
    """
    held_by_rank = [[t for t in rects if t[2] and t[3]] for rects in held_by_rank]
    rows, cols, cells = _grid(held_by_rank, shape2d)
    covered = torch.zeros(len(rows) - 1, len(cols) - 1, dtype=torch.bool)
    out = []
    for rects in held_by_rank:
        mask = torch.zeros_like(covered)
        for rect in rects:
            mask[cells(rect)] = True
        out.append([(rows[i], cols[j], rows[i + n] - rows[i], cols[j + m] - cols[j])
                    for i, j, n, m in mask_rectangles(mask & ~covered)])
        covered |= mask
    if not bool(covered.all()):
        area = torch.tensor(rows).diff()[:, None] * torch.tensor(cols).diff()[None, :]
        raise RuntimeError(f"colab_kit.checkpoint: {int(area[~covered].sum())} elements of a tensor "
                           f"{list(shape2d)} are held by no rank")
    return out


def overlap(rects: list, shape2d: tuple[int, int]) -> int:
    """How many elements of a ``shape2d`` tensor two or more of ``rects`` share (0: they tile disjointly).

    >>> overlap([(0, 0, 2, 2), (1, 1, 2, 2)], (4, 4)), overlap([(0, 0, 2, 2), (2, 0, 1, 2)], (4, 4))
    (1, 0)
    """
    rects = [t for t in rects if t[2] and t[3]]
    rows, cols, cells = _grid([rects], shape2d)
    count = torch.zeros(len(rows) - 1, len(cols) - 1, dtype=torch.int64)
    for rect in rects:
        count[cells(rect)] += 1
    area = torch.tensor(rows).diff()[:, None] * torch.tensor(cols).diff()[None, :]
    return int((area * (count - 1).clamp(min=0)).sum())


def flat_rects(start: int, length: int, cols: int) -> list[tuple[int, int, int, int]]:
    """The rectangles of a ``[*, cols]`` matrix that its flat elements ``[start, start + length)`` cover:
    a partial first row, full rows, a partial last row (at most 3).

    >>> flat_rects(3, 10, 4)
    [(0, 3, 1, 1), (1, 0, 2, 4), (3, 0, 1, 1)]
    """
    out: list[tuple[int, int, int, int]] = []
    end = start + length
    if length <= 0 or cols <= 0:
        return out
    row, col = divmod(start, cols)
    if col:
        m = min(cols - col, length)
        out.append((row, col, 1, m))
        start, row = start + m, row + 1
    full = (end - start) // cols
    if full > 0:
        out.append((row, 0, full, cols))
        start, row = start + full * cols, row + full
    if end > start:
        out.append((row, 0, 1, end - start))
    return out


def segments(lo: int, n: int, runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Where local indices ``[lo, lo + n)`` fall among ``runs`` ``(dense start, length)`` laid end to end:
    ``(local start, dense start, length)`` per piece.

    >>> segments(10, 12, [(0, 16), (32, 16)])                   # local 10-21: dense 10-15, then 32-37
    [(10, 10, 6), (16, 32, 6)]
    """
    out, at = [], 0
    for dense, length in runs:
        a, b = max(lo, at), min(lo + n, at + length)
        if a < b:
            out.append((a, dense + a - at, b - a))
        at += length
    return out


def intersect(x, y):
    """The rectangle two rectangles share, or None."""
    r, c = max(x[0], y[0]), max(x[1], y[1])
    n, m = min(x[0] + x[2], y[0] + y[2]) - r, min(x[1] + x[3], y[1] + y[3]) - c
    return (r, c, n, m) if n > 0 and m > 0 else None
