"""Whether the ranks were handed the same batch: ``agree_on_batch``, at the first training step and the first
evaluation of an engine, and at every ``generate`` (its prompts and settings), before anything reads them.

Every rank passes the same global batch and the engine gives each its rows (or, with ``local=True``, the
ranks of one dp coordinate pass the same rows). A loader that hands each rank a batch of its own (a
``DistributedSampler`` over every rank instead of over dp, an unseeded shuffle, a per-rank seed) does not
fail: each rank takes its rows of a different batch, so under dp the step trains on a mixture, and under tp,
sp or pp the ranks that share a row compute one layer on different inputs. Nothing in the losses says so.

So each rank reduces its batch to a fingerprint (per tensor: dtype, shape, and sums of its values, one of
them weighted by position so that a reordering shows: exact integer sums of an integer tensor's bytes, float64
sums of a floating one, matched within ``FLOAT_RTOL`` so that a value one rounding off on another CPU or GPU
still counts as the same) and the ranks all-gather them: one
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

import math
import zlib

import torch
import torch.distributed as dist

from ..comm.collectives import torch_all_gather_single
from ..config import Axis

__all__ = ["FINGERPRINT", "fingerprint", "agree_on_batch"]

SLOT = 6
"""int64s per tensor: its dtype and shape, how it is compared, and four sums (``_exact_sums`` / ``_float_sums``)."""
FINGERPRINT = 1 + 2 * SLOT
"""int64s per rank: the batch's kind, then a ``SLOT`` for each of its two parts."""

FLOAT_RTOL = 1e-6
"""How far two floating tensors' sums may differ, relative to the sums of their magnitudes, and still count as
one batch (for 16- and 8-bit floats, their own epsilon): a value one rounding off on another rank (its mean
taken in another order, on another CPU or GPU) moves a sum by at most that much of it; another batch, or the
same rows in another order, by far more."""

_CHUNK = 1 << 22  # elements summed at a time (32 MiB as int64 or float64): the check's memory stays small
_EXACT, _FLOATING = 1, 16  # a floating tensor's kind is _FLOATING + its element size (its tolerance: _rtol)
_NOT_A_TENSOR, _UNREADABLE = 0, -1


def _code(text: str) -> int:
    """A number for ``text``, the same in every process (Python's ``hash`` of a str is salted per process)."""
    return zlib.crc32(text.encode())


def _chunks(flat: torch.Tensor, dtype: torch.dtype):
    """``(values, weights)`` of ``flat`` a chunk at a time, in ``dtype``; weight ``1 + i mod 65521`` at position i."""
    for start in range(0, flat.numel(), _CHUNK):
        v = flat[start:start + _CHUNK].to(dtype)
        w = (torch.arange(start, start + v.numel(), device=v.device, dtype=torch.int64) % 65521 + 1).to(dtype)
        yield v, w


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a plain strided tensor: a sparse one densified, a quantized one as its integers."""
    t = t.detach()
    if t.is_sparse or t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    return t


def _exact_sums(t: torch.Tensor) -> list[int]:
    """Sums of ``t``'s bytes read as 16-bit integers, plain and weighted by position: each term is below 2^31 in
    magnitude, so neither overflows an int64 for fewer than 2^32 pieces, and integer sums do not depend on the
    order a device adds them in: equal tensors give equal sums anywhere."""
    flat = t.contiguous().reshape(-1)
    raw = (flat.to(torch.uint8) if flat.dtype == torch.bool else flat).view(torch.uint8)
    if raw.numel() % 2 == 0 and raw.storage_offset() % 2:  # a view at an odd byte: read 16 bits from a copy
        raw = raw.clone()
    pieces = raw.view(torch.int16) if raw.numel() % 2 == 0 else raw
    plain = weighted = 0
    for v, w in _chunks(pieces, torch.int64):
        plain += int(v.sum())
        weighted += int((v * w).sum())
    return [_EXACT, plain, weighted, 0, 0]


def _float_sums(t: torch.Tensor) -> list[int]:
    """Plain and position-weighted sums of a floating tensor in float64, and the same of its magnitudes, as
    their bits (compared within ``_rtol`` by ``_same_slot``); the exact byte sums where one is not finite (a NaN
    or an infinity in the batch: compared bit for bit)."""
    flat = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)
    plain = weighted = size = wsize = 0.0
    for v, w in _chunks(flat, torch.float64):
        plain += float(v.sum())
        weighted += float((v * w).sum())
        size += float(v.abs().sum())
        wsize += float((v.abs() * w).sum())
    if not all(math.isfinite(x) for x in (plain, weighted, size, wsize)):
        return _exact_sums(t)
    bits = torch.tensor([plain, weighted, size, wsize], dtype=torch.float64).view(torch.int64).tolist()
    return [_FLOATING + t.element_size(), *bits]


def _rtol(kind: int) -> float:
    """The tolerance of a floating tensor of ``kind``: ``FLOAT_RTOL``, or the epsilon of a 16- or 8-bit float."""
    return max(FLOAT_RTOL, {2: 2.0 ** -7, 1: 2.0 ** -2}.get(kind - _FLOATING, 0.0))


def fingerprint(batch) -> torch.Tensor:
    """``FINGERPRINT`` int64s that tell two batches apart (with overwhelming likelihood) whatever ``batch`` is: a
    pair of tensors, a tensor, anything else (named by its type). Integer and bool tensors by their bytes;
    floating ones by float64 sums, so that a rounding apart still matches (``_rtol``). A tensor whose values
    cannot be read here (a meta tensor, say) is marked so, and every rank refuses alike."""
    items = list(batch)[:2] if isinstance(batch, (tuple, list)) else [batch]
    out = [_code(type(batch).__name__) + 16 * len(items) if isinstance(batch, (tuple, list)) else 0]
    for k in range(2):
        item = items[k] if k < len(items) else None
        if torch.is_tensor(item):
            try:
                t = _dense(item)
                sums = _float_sums(t) if t.is_floating_point() or t.is_complex() else _exact_sums(t)
            except Exception as exc:  # noqa: BLE001 - refused by every rank after the gather, not raised alone here
                sums = [_UNREADABLE, _code(type(exc).__name__), 0, 0, 0]
            out += [_code(f"{item.dtype}{tuple(item.shape)}"), *sums]
        else:
            out += [_code(type(item).__name__), _NOT_A_TENSOR, 0, 0, 0, 0]
    return torch.tensor(out, dtype=torch.int64)


_SLOTS = (slice(1, 1 + SLOT), slice(1 + SLOT, 1 + 2 * SLOT))  # each part's numbers in a fingerprint


def _same_slot(a: torch.Tensor, b: torch.Tensor) -> bool:
    kind = int(a[1])
    if not torch.equal(a[:2], b[:2]) or kind < _FLOATING:
        return torch.equal(a, b)
    x, y = a[2:].view(torch.float64).tolist(), b[2:].view(torch.float64).tolist()
    rtol = _rtol(kind)
    return (abs(x[0] - y[0]) <= rtol * max(x[2], y[2]) and abs(x[1] - y[1]) <= rtol * max(x[3], y[3])
            and abs(x[2] - y[2]) <= rtol * max(x[2], y[2]) and abs(x[3] - y[3]) <= rtol * max(x[3], y[3]))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return int(a[0]) == int(b[0]) and all(_same_slot(a[sl], b[sl]) for sl in _SLOTS)


def _malformed(row: torch.Tensor) -> bool:
    """Whether a fingerprint's batch is no pair of readable tensors (a bare tensor, a tensor not read here)."""
    return int(row[0]) == 0 or any(int(row[sl][1]) in (_NOT_A_TENSOR, _UNREADABLE) for sl in _SLOTS)


def _differs(a: torch.Tensor, b: torch.Tensor, names: tuple[str, str]) -> str:
    parts = [name for name, sl in zip(names, _SLOTS) if not _same_slot(a[sl], b[sl])]
    return " and ".join(parts) + (" differ" if len(parts) > 1 else " differs") if parts else "the batch's kind differs"


def _gather(out: torch.Tensor, mine: torch.Tensor) -> None:
    """Every rank's ``mine`` into ``out``, over the world, outside the comm records."""
    torch_all_gather_single(out, mine)


def agree_on_batch(batch, mesh, local: bool, what: str = "train_step", rule: str | None = None,
                   names: tuple[str, str] = ("inputs", "targets")) -> None:
    """Refuse (ValueError, on every rank) where ranks that must hold the same batch were handed different ones:
    every rank (``local=False``), or the ranks of one dp coordinate (``local=True``). One all-gather; a world of
    one rank checks nothing. ``rule``: what the error says must hold instead (a batch's rule by default);
    ``names``: what the error calls the batch's two parts."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return
    mine = fingerprint(batch).to(mesh.device)  # never raises: a rank that did would leave the others waiting
    table = torch.empty(world * FINGERPRINT, dtype=torch.int64, device=mesh.device)
    _gather(table, mine)
    rows = table.view(world, FINGERPRINT).cpu()
    groups: dict[int, list[int]] = {}
    for r in range(world):
        groups.setdefault(mesh.layout.coords(r)[Axis.DP] if local else 0, []).append(r)
    for ranks in groups.values():
        first = ranks[0]
        odd = [r for r in ranks[1:] if not _same(rows[r], rows[first])]
        if odd and any(_malformed(rows[r]) for r in [first, *odd]):
            bad = sorted(r for r in ranks if _malformed(rows[r]))
            raise ValueError(f"{what}: ranks {bad} passed no pair of tensors their peers could compare (a bare tensor, "
                             f"something else, or a tensor whose values cannot be read here, such as a meta one), "
                             f"while ranks {sorted(set(ranks) - set(bad))} passed {names[0]} and {names[1]}: every "
                             f"rank passes the same pair of tensors ({names[0]}, {names[1]})")
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
