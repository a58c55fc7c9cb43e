"""A collective's fingerprint: what rule 3 compares between the ranks of a group (``group.RulesGroup``).

Twelve integers: the op, the dtype, an extra (the reduce op, the root, or both), the number of dims and up to 8
dims. Where ranks may legitimately hold different shapes (an all-to-all with uneven splits) the dim that
differs is written as -1. Worked example::

    >>> import torch
    >>> row = fingerprint("all_reduce", torch.ones(2, 2), reduce_code(torch.distributed.ReduceOp.SUM))
    >>> row[:6], describe(row)
    ([0, 0, 0, 2, 2, 2], 'all_reduce(sum) float32[2, 2]')
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .pairs import DTYPES, RuleBroken

__all__ = ["WIDTH", "fingerprint", "describe", "differs", "reduce_code"]

_OPS = ["all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_coalesced",
        "all_gather_single", "reduce_scatter", "reduce_scatter_single", "all_to_all_single", "all_to_all",
        "gather", "scatter", "barrier"]
_DTYPES = DTYPES  # the envelopes' table (``pairs``)
_REDUCE = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"]
WIDTH = 12  # fingerprint: op, dtype, extra, ndim, 8 dims
_OP_CODE = {op: i for i, op in enumerate(_OPS)}
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


def reduce_code(op) -> int:
    for i, name in enumerate(_REDUCE):
        if op == getattr(dist.ReduceOp, name.upper()):
            return i
    return len(_REDUCE)


def fingerprint(op: str, t: torch.Tensor | None, extra: int = 0, shape=None) -> list[int]:
    """The fingerprint of collective ``op`` on tensor ``t`` (``shape`` instead of ``t``'s where given)."""
    dims = list(shape if shape is not None else (t.shape if t is not None else ()))
    dtype = _DTYPE_CODE.get(t.dtype, -1) if t is not None else -1
    return [_OP_CODE[op], dtype, extra, len(dims)] + (dims + [0] * 8)[:8]


def describe(row: list[int]) -> str:
    """A fingerprint in words: ``all_reduce(sum) float32[2, 2]``, ``broadcast(root 1) float32[4]``."""
    op, dtype, extra, nd = row[:4]
    name = _OPS[op] if 0 <= op < len(_OPS) else f"op {op}"
    if name in ("all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_single"):
        name += f"({_REDUCE[extra] if extra < len(_REDUCE) else extra})"
    elif name in ("broadcast", "gather", "scatter"):
        name += f"(root {extra})"
    elif name == "reduce":
        name += f"(root {extra >> 4}, {_REDUCE[extra & 15] if (extra & 15) < len(_REDUCE) else extra & 15})"
    if name == "barrier":
        return name
    kind = str(_DTYPES[dtype]).removeprefix("torch.") if 0 <= dtype < len(_DTYPES) else "?"
    dims = ["*" if d < 0 else str(d) for d in row[4:4 + nd]]
    return f"{name} {kind}[{', '.join(dims)}]"


def differs(ranks: list[int], seq: int, rows: list) -> RuleBroken:
    """The error of collective ``seq`` of the group of ``ranks`` whose ranks' fingerprints ``rows`` differ (None:
    that rank has not called it yet)."""
    return RuleBroken(
        f"nccl-rules: collective {seq} of the group of ranks {ranks} differs between ranks: "
        + "; ".join(f"rank {ranks[r]} " + ("has not called it yet" if row is None else f"called {describe(row)}")
                    for r, row in enumerate(rows))
        + ". Every rank of a group must call the same collectives in the same order with the same "
        "shapes and dtypes; NCCL would hang or mix up the data")
