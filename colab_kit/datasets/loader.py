"""``ShardedLoader``: the same global batches on every dp rank, each rank yielding only its rows.

The loader walks a map-style dataset in global batches of ``batch_size`` samples (all dp ranks
together). Epoch ``e`` visits the samples in the order ``torch.randperm(len(ds),
generator=seeded(seed, e))``; global batch ``k`` of the epoch is that order's samples
``k*B .. (k+1)*B``, and dp rank ``r`` takes the contiguous block ``r*B/dp .. (r+1)*B/dp`` of it:
exactly the rows the engine keeps when it is handed the global batch. Worked example, 8 samples,
``batch_size=4``, dp=2 (epoch 0's order is [4, 0, 7, 3, 2, 5, 1, 6])::

    global batch 0 = samples [4, 0, 7, 3]:  dp rank 0 yields [4, 0], rank 1 yields [7, 3]
    global batch 1 = samples [2, 5, 1, 6]:  dp rank 0 yields [2, 5], rank 1 yields [1, 6]
    then epoch 1, in a new order

    >>> ds = [(torch.tensor([i, i]), torch.tensor(i)) for i in range(8)]   # sample i is (ids, i)
    >>> rank1 = ShardedLoader(ds, 4, dp_size=2, dp_rank=1)
    >>> batch = next(rank1)
    >>> x, y = batch
    >>> y, x.shape, batch.global_rows
    (tensor([7, 3]), torch.Size([2, 2]), 4)
    >>> [rank1.indices(0, k) for k in range(rank1.steps_per_epoch)]
    [[7, 3], [1, 6]]

``for batch in loader`` runs to the end of the current epoch; ``next(loader)`` (or
``loader.next_batch()``) never stops, going on into the next epoch. ``state_dict()`` is the
position (epoch, global batch within it); a loader given it by ``load_state_dict`` yields what
the saved one would have yielded next. The position counts global batches, so a state saved
with one dp size continues at the same global sample on another: after 3 global batches at dp=2
a dp=4 loader starts at global batch 3 and each rank takes its quarter of it.
"""
from __future__ import annotations

import operator

import torch

from ..config import Axis, ConfigError

__all__ = ["ShardedLoader", "LocalBatch", "seeded", "split_batch"]


def split_batch(batch: torch.Tensor, parts: int, index: int, what: str = "dp") -> torch.Tensor:
    """Rows ``index*B/parts .. (index+1)*B/parts`` of ``batch`` (dim 0): a dp rank's rows of the global batch
    (the block ``ShardedLoader`` yields), or microbatch ``index`` of ``parts``.

    >>> split_batch(torch.arange(8), 2, 1).tolist(), split_batch(torch.arange(8), 4, 0, "microbatches").tolist()
    ([4, 5, 6, 7], [0, 1])
    """
    rows = batch.shape[0]
    if rows % parts:
        raise ValueError(f"a global batch of {rows} rows does not split evenly over {what}={parts}: "
                         f"use a batch size that is a multiple of {parts} (e.g. {parts * max(1, rows // parts)})")
    size = rows // parts
    return batch[index * size:(index + 1) * size]


def seeded(seed: int, epoch: int) -> torch.Generator:
    """The generator of epoch ``epoch``'s order: seeded with ``seed + epoch``, as
    ``DistributedSampler`` seeds its own, so both visit the samples in the same order."""
    return torch.Generator().manual_seed(seed + epoch)


class LocalBatch(tuple):
    """``(inputs, targets)``: this dp rank's rows of a global batch of ``global_rows`` rows.
    A plain 2-tuple otherwise (``x, y = batch``); the engine reads ``global_rows`` to know that it was
    handed local rows, not the global batch."""

    global_rows: int

    def __new__(cls, inputs, targets, global_rows: int):
        batch = super().__new__(cls, (inputs, targets))
        batch.global_rows = global_rows
        return batch

    def __reduce__(self):
        return LocalBatch, (self[0], self[1], self.global_rows)

    def __repr__(self) -> str:
        return f"LocalBatch({len(self[0])} of {self.global_rows} rows, inputs {tuple(self[0].shape)}, " \
               f"targets {tuple(self[1].shape)})"


def _multiples(n: int, m: int) -> str:
    """Multiples of ``m`` near ``n``: 'such as 8 or 12'."""
    below = n // m * m
    return " or ".join(str(k) for k in (below, below + m) if k > 0 and k != n)


def _check(n: int, batch_size: int, dp_size: int, dp_rank: int, microbatch_rows: int) -> None:
    for name, value in (("dp_size", dp_size), ("microbatch_rows", microbatch_rows)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if not 0 <= dp_rank < dp_size:
        raise ConfigError(f"dp_rank={dp_rank} is out of range for dp_size={dp_size}: use 0 .. {dp_size - 1}")
    m = dp_size * microbatch_rows
    over = f"dp={dp_size}" + (f" x microbatch_rows={microbatch_rows}" if microbatch_rows > 1 else "")
    if batch_size < 1 or batch_size % m:
        raise ConfigError(f"batch_size={batch_size} does not split over {over}: use a multiple of {m} "
                          f"such as {_multiples(max(batch_size, 1), m)}")
    if n < batch_size:
        fits = n // m * m
        raise ConfigError(f"the dataset has {n} samples, fewer than one global batch of {batch_size}: "
                          + (f"use batch_size={fits} or a larger dataset" if fits else "use a larger dataset"))


def _collate(items) -> list[torch.Tensor]:
    if not all(isinstance(it, (tuple, list)) and len(it) == 2 for it in items):
        raise TypeError(f"ShardedLoader needs samples that are pairs (inputs, targets), got {type(items[0])}")
    return [torch.stack([torch.as_tensor(it[k]) for it in items]) for k in (0, 1)]


class ShardedLoader:
    """Global batches of ``batch_size`` samples of ``dataset``; this dp rank yields rows
    ``dp_rank*B/dp .. (dp_rank+1)*B/dp`` of each as a ``LocalBatch`` (see the module docstring).

    ``dp_size``, ``dp_rank``: given explicitly (``for_engine`` reads them off an engine): a rank that
    forgot its dp rank would silently train on rank 0's rows. ``shuffle``: a new order every epoch
    (``seeded(seed, epoch)``), else 0, 1, 2, ... every epoch. ``drop_last``: drop the samples after the
    last whole batch (every sample at most once per epoch); False keeps them in a last batch filled
    up with the epoch's first samples (every sample at least once). ``microbatch_rows``: the local
    rows must split into this many microbatches (``for_engine`` passes ``config.microbatches``).
    ``batch_size`` must be a multiple of ``dp_size * microbatch_rows`` and at most ``len(dataset)``.
    """

    def __init__(self, dataset, batch_size: int, *, dp_size: int, dp_rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True, microbatch_rows: int = 1):
        batch_size, dp_size, dp_rank = operator.index(batch_size), operator.index(dp_size), operator.index(dp_rank)
        _check(len(dataset), batch_size, dp_size, dp_rank, operator.index(microbatch_rows))
        self.dataset, self.batch_size, self.dp_size, self.dp_rank = dataset, batch_size, dp_size, dp_rank
        self.shuffle, self.seed, self.drop_last, self.microbatch_rows = shuffle, seed, drop_last, microbatch_rows
        n = len(dataset)
        self.steps_per_epoch = n // batch_size if drop_last else -(-n // batch_size)
        self.epoch, self.batch_index = 0, 0  # the position: the next global batch to yield
        self._order_of: tuple[int | None, torch.Tensor | None] = (None, None)  # (epoch, its sample order)

    @classmethod
    def for_engine(cls, engine, dataset, batch_size: int, **kw) -> ShardedLoader:
        """A loader for ``engine``'s dp rank: ``dp_size=engine.config.dp``, ``dp_rank=engine.mesh.rank("dp")``,
        ``microbatch_rows=engine.config.microbatches``; ``kw``: the other options (shuffle, seed, drop_last)."""
        kw.setdefault("microbatch_rows", engine.config.microbatches)
        return cls(dataset, batch_size, dp_size=engine.config.dp, dp_rank=engine.mesh.rank(Axis.DP), **kw)

    def _order(self, epoch: int) -> torch.Tensor:
        if self._order_of[0] != epoch:
            n = len(self.dataset)
            self._order_of = (epoch, torch.randperm(n, generator=seeded(self.seed, epoch)) if self.shuffle
                              else torch.arange(n))
        order = self._order_of[1]
        assert order is not None  # made above for this epoch
        return order

    def global_indices(self, epoch: int, batch: int) -> list[int]:
        """The samples of global batch ``batch`` of epoch ``epoch``, all dp ranks' rows in order."""
        order, b = self._order(epoch), self.batch_size
        rows = order[batch * b:(batch + 1) * b]
        return torch.cat([rows, order[:b - len(rows)]]).tolist()  # a short last batch (drop_last=False) is filled up

    def indices(self, epoch: int, batch: int) -> list[int]:
        """This rank's samples of global batch ``batch`` of epoch ``epoch``: its block of the global ones."""
        local = self.batch_size // self.dp_size
        return self.global_indices(epoch, batch)[self.dp_rank * local:(self.dp_rank + 1) * local]

    def next_batch(self) -> LocalBatch:
        """This rank's rows of the next global batch; after an epoch's last, the next epoch's first."""
        inputs, targets = _collate([self.dataset[i] for i in self.indices(self.epoch, self.batch_index)])
        self.batch_index += 1
        if self.batch_index == self.steps_per_epoch:
            self.epoch, self.batch_index = self.epoch + 1, 0
        return LocalBatch(inputs, targets, self.batch_size)

    __next__ = next_batch

    def __iter__(self):
        """The rest of the current epoch (all of it from a fresh loader)."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def __len__(self) -> int:
        return self.steps_per_epoch

    def state_dict(self) -> dict:
        """Where the loader is: the next global batch (``epoch``, ``batch`` within it) and what the
        position means (``seed``, ``batch_size``, ``dp_size`` it was saved at, dataset ``len``)."""
        return {"epoch": self.epoch, "batch": self.batch_index, "seed": self.seed, "batch_size": self.batch_size,
                "dp_size": self.dp_size, "len": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``. It must come from a loader with the same ``batch_size``, seed and
        dataset length (else the position would name other samples); its dp size may differ."""
        mine = self.state_dict()
        for key in ("batch_size", "len", "seed"):
            if state.get(key) != mine[key]:
                raise ConfigError(f"the loader state was saved with {key}={state.get(key)} and this loader has "
                                  f"{key}={mine[key]}: build the loader with the saved run's batch_size, seed and "
                                  f"dataset to continue it")
        epoch, batch = operator.index(state["epoch"]), operator.index(state["batch"])
        if epoch < 0 or not 0 <= batch < self.steps_per_epoch:
            raise ConfigError(f"the loader state's position epoch={epoch}, batch={batch} is not one of this loader's "
                              f"(batch 0 .. {self.steps_per_epoch - 1} of an epoch)")
        self.epoch, self.batch_index = epoch, batch

    def __repr__(self) -> str:
        return (f"ShardedLoader({len(self.dataset)} samples, global batch {self.batch_size}, dp rank "
                f"{self.dp_rank} of {self.dp_size}, epoch {self.epoch} batch {self.batch_index} of "
                f"{self.steps_per_epoch})")
