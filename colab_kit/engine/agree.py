"""Whether the ranks were handed the same batch: ``agree_on_batch``, at the first training step and the first
evaluation of an engine, and at every ``generate`` (its prompts and settings), before anything reads them.

Every rank passes the same global batch and the engine gives each its rows (or, with ``local=True``, the
ranks of one dp coordinate pass the same rows). A loader that hands each rank a batch of its own (a
``DistributedSampler`` over every rank instead of over dp, an unseeded shuffle, a per-rank seed) does not
fail: each rank takes its rows of a different batch, so under dp the step trains on a mixture, and under tp,
sp or pp the ranks that share a row compute one layer on different inputs. Nothing in the losses says so.

So each rank reduces its batch to a fingerprint (per tensor: dtype, shape, and two exact integer sums of
its bytes, one of them weighted by position so that a reordering shows) and the ranks all-gather them: one
all-gather (``all_gather_single``) of ``FINGERPRINT`` int64s per rank over the world, outside the step's comm
records (as the mesh's own set-up is). Every rank then sees the same table and refuses alike, before any
collective of the step, so a mismatch raises on every rank instead of hanging one. Worked example,
``ParallelConfig(dp=2, tp=2)`` on 4 ranks, rank 2 handed a batch of its own::

    engine.train_step(batch)        # on every rank
    ValueError: train_step: ranks [2] were handed a different batch from rank 0 (inputs and targets differ):
    every rank passes the same global batch and the engine gives each its rows: build the loader alike on
    every rank (the same data, the same seed), or hand each rank its dp share with engine.loader(dataset,
    batch_size) (a LocalBatch). Trained as given, each rank would take its rows of another batch: ...

A malformed batch on one rank only is reported the same way (its fingerprint differs), rather than one rank
raising ``check_batch``'s error while the others wait for it.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ..config import Axis

__all__ = ["FINGERPRINT", "fingerprint", "agree_on_batch"]

FINGERPRINT = 11
"""int64s per rank: the batch's kind, then per tensor (two at most) dtype and shape, element count, two sums."""

_CHUNK = 1 << 22  # 16-bit pieces summed at a time (32 MiB as int64): the check's memory stays small


def _code(text: str) -> int:
    """A number for ``text``, the same in every process (Python's ``hash`` of a str is salted per process)."""
    return zlib.crc32(text.encode())


def _sums(t: torch.Tensor) -> tuple[int, int]:
    """Exact sums of ``t``'s bytes read as 16-bit integers, plain and weighted by position (1 + i mod 65521).
    Each term is below 2^31 in magnitude, so neither sum overflows an int64 for fewer than 2^32 pieces, and
    integer sums do not depend on the order a device adds them in: equal tensors give equal sums anywhere."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    raw = flat.view(torch.uint8)
    pieces = raw.view(torch.int16) if raw.numel() % 2 == 0 else raw
    plain = weighted = 0
    for start in range(0, pieces.numel(), _CHUNK):
        v = pieces[start:start + _CHUNK].to(torch.int64)
        w = (torch.arange(start, start + v.numel(), device=v.device, dtype=torch.int64) % 65521) + 1
        plain += int(v.sum())
        weighted += int((v * w).sum())
    return plain, weighted


def fingerprint(batch) -> torch.Tensor:
    """``FINGERPRINT`` int64s that differ between two batches that differ (with overwhelming likelihood),
    whatever ``batch`` is: a pair of tensors, a tensor, anything else (named by its type)."""
    items = list(batch)[:2] if isinstance(batch, (tuple, list)) else [batch]
    out = [_code(type(batch).__name__) + 16 * len(items) if isinstance(batch, (tuple, list)) else 0]
    for k in range(2):
        item = items[k] if k < len(items) else None
        if torch.is_tensor(item):
            plain, weighted = _sums(item)
            out += [_code(f"{item.dtype}{tuple(item.shape)}"), item.numel(), plain, weighted, 1]
        else:
            out += [_code(type(item).__name__), 0, 0, 0, 0]
    return torch.tensor(out, dtype=torch.int64)


def _differs(a: torch.Tensor, b: torch.Tensor, names: tuple[str, str]) -> str:
    parts = [name for name, sl in zip(names, (slice(1, 6), slice(6, 11))) if not torch.equal(a[sl], b[sl])]
    return " and ".join(parts) + (" differ" if len(parts) > 1 else " differs") if parts else "the batch's kind differs"


def _gather(out: torch.Tensor, mine: torch.Tensor) -> None:
    """Every rank's ``mine`` into ``out``, over the world (torch 2.13 renamed ``all_gather_into_tensor``)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, mine)


def agree_on_batch(batch, mesh, local: bool, what: str = "train_step", rule: str | None = None,
                   names: tuple[str, str] = ("inputs", "targets")) -> None:
    """Refuse (ValueError, on every rank) where ranks that must hold the same batch were handed different ones:
    every rank (``local=False``), or the ranks of one dp coordinate (``local=True``). One all-gather; a world of
    one rank checks nothing. ``rule``: what the error says must hold instead (a batch's rule by default);
    ``names``: what the error calls the batch's two parts."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return
    mine = fingerprint(batch).to(mesh.device)
    table = torch.empty(world * FINGERPRINT, dtype=torch.int64, device=mesh.device)
    _gather(table, mine)
    rows = table.view(world, FINGERPRINT).cpu()
    groups: dict[int, list[int]] = {}
    for r in range(world):
        groups.setdefault(mesh.layout.coords(r)[Axis.DP] if local else 0, []).append(r)
    for ranks in groups.values():
        first = ranks[0]
        odd = [r for r in ranks[1:] if not torch.equal(rows[r], rows[first])]
        if odd:
            raise ValueError(f"{what}: ranks {odd} were handed a different batch from rank {first} "
                             f"({_differs(rows[first], rows[odd[0]], names)}): "
                             f"{rule or _rule(mesh, local, ranks)}")


_TRAINED_AS_GIVEN = ". Trained as given, each rank would take its rows of another batch: a loss of none of them"


def _rule(mesh, local: bool, ranks: list[int]) -> str:
    if local:
        return (f"with local=True the ranks of one dp coordinate (here ranks {ranks}, dp rank "
                f"{mesh.layout.coords(ranks[0])[Axis.DP]}) pass the same rows, their dp share: build each rank's "
                "loader over the dp size and dp rank (engine.loader(dataset, batch_size), or a "
                "DistributedSampler(num_replicas=dp, rank=dp rank)), not over every rank" + _TRAINED_AS_GIVEN)
    return ("every rank passes the same global batch and the engine gives each its rows: build the loader alike on "
            "every rank (the same data, the same seed), or hand each rank its dp share with "
            "engine.loader(dataset, batch_size) (a LocalBatch)" + _TRAINED_AS_GIVEN)
