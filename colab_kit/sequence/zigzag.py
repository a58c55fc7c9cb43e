"""How a sequence is laid out over the ``sp`` ranks: the zigzag split and the contiguous one.

Both cut the sequence of ``t`` tokens into ``2 * sp`` equal chunks of ``c = t / (2 sp)``
tokens and give every rank two of them, back to back along the sequence dim:

``"zigzag"`` (ring attention's layout)
    rank ``r`` holds chunks ``r`` and ``2 sp - 1 - r``: one early, one late chunk. Under
    the causal mask an early chunk attends to little and a late one to much, so every
    rank gets the same work (Brandon et al.'s striped / zigzag balance, used by
    ring-flash-attention and Megatron's context parallelism).
``"contiguous"`` (Ulysses' layout)
    rank ``r`` holds chunks ``2r`` and ``2r + 1``: plainly the ``r``-th ``t / sp`` tokens.

Worked example, ``t = 8`` tokens over ``sp = 2`` (4 chunks of 2 tokens)::

    tokens            0 1 | 2 3 | 4 5 | 6 7
    chunk              0     1     2     3
    zigzag      rank 0: chunks 0, 3 -> tokens [0 1 6 7]      rank 1: chunks 1, 2 -> tokens [2 3 4 5]
    contiguous  rank 0: chunks 0, 1 -> tokens [0 1 2 3]      rank 1: chunks 2, 3 -> tokens [4 5 6 7]

    >>> x = torch.arange(8).view(1, 8)
    >>> split_sequence(x, 0, 2), split_sequence(x, 1, 2)
    (tensor([[0, 1, 6, 7]]), tensor([[2, 3, 4, 5]]))
    >>> unsplit_sequence([split_sequence(x, r, 2) for r in range(2)])
    tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    >>> sequence_positions(1, 2, 8)
    tensor([2, 3, 4, 5])
    >>> split_sequence(torch.zeros(1, 10), 0, 2)  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    colab_kit.config.ConfigError: a sequence of 10 tokens does not split over sp=2 ranks:
        ... use a multiple of 4 (8 or 12)

A sequence length that does not split is refused here, before any collective runs.
"""
from __future__ import annotations

import torch

from ..config import ConfigError

__all__ = ["LAYOUTS", "chunk_ids", "check_length", "split_sequence", "unsplit_sequence", "sequence_positions",
           "gathered_order"]

LAYOUTS = ("zigzag", "contiguous")


def chunk_ids(rank: int, sp: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two chunks (of ``2 sp``) that ``rank`` holds, in the order they sit on the rank.

    >>> [chunk_ids(r, 3) for r in range(3)], chunk_ids(1, 3, "contiguous")
    ([(0, 5), (1, 4), (2, 3)], (2, 3))
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    if not 0 <= rank < sp:
        raise ValueError(f"rank {rank} is outside an sp axis of size {sp} (0..{sp - 1})")
    return (rank, 2 * sp - 1 - rank) if layout == "zigzag" else (2 * rank, 2 * rank + 1)


def check_length(t: int, sp: int, layout: str = "zigzag") -> int:
    """The chunk size ``t / (2 sp)``; a ``ConfigError`` (a ValueError) naming the multiple to use otherwise."""
    m = 2 * sp
    if t % m == 0 and t > 0:
        return t // m
    below, above = (t // m) * m, (t // m + 1) * m
    near = " or ".join(str(v) for v in (below, above) if v > 0)
    raise ConfigError(f"a sequence of {t} tokens does not split over sp={sp} ranks: the {layout} layout cuts it "
                      f"into 2*sp = {m} equal chunks, so use a multiple of {m} ({near})")


def split_sequence(x: torch.Tensor, rank: int, sp: int, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``dim`` (the sequence dim: 1 for ``[b, t, ...]``), concatenated."""
    c = check_length(x.shape[dim], sp, layout)
    return torch.cat([x.narrow(dim, i * c, c) for i in chunk_ids(rank, sp, layout)], dim=dim)


def unsplit_sequence(pieces: list[torch.Tensor], dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """The whole sequence from every rank's piece (in rank order): the inverse of ``split_sequence``."""
    sp = len(pieces)
    chunks: dict[int, torch.Tensor] = {}  # chunk id -> its tokens; every rank holds two
    for r, piece in enumerate(pieces):
        first, second = piece.chunk(2, dim=dim)
        a, b = chunk_ids(r, sp, layout)
        chunks[a], chunks[b] = first, second
    return torch.cat([chunks[i] for i in range(2 * sp)], dim=dim)


def sequence_positions(rank: int, sp: int, t: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Global positions (0..t-1) of this rank's tokens, in their local order: for position embeddings."""
    c = check_length(t, sp, layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(rank, sp, layout)])


def gathered_order(sp: int, t: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Global positions of the sequence that every rank's piece makes when put back to back in rank order.

    This is what an all-to-all over the sp axis returns along the sequence: under the zigzag
    layout it is not the natural order. ``gathered.index_select(dim, order.argsort())`` puts
    it into natural order, ``natural.index_select(dim, order)`` back again.

    >>> gathered_order(2, 8)
    tensor([0, 1, 6, 7, 2, 3, 4, 5])
    """
    return torch.cat([sequence_positions(r, sp, t, layout, device) for r in range(sp)])
