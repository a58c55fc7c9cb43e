"""Data for the engine: built-in, deterministic, no download; and a loader that shards it over dp.

- ``SyntheticTokens``, ``ByteText``: global batches by step (``data.batch(step, b)``), the same on
  every rank (``colab_kit.datasets.synthetic``).
- ``TextCorpus``: bytes of text files as windows (vocabulary 256); ``TextCorpus.stdlib(seq_len)``
  reads the Python standard library's sources, which every machine of the same Python has.
- ``TokenFile``: a flat binary file of token ids (nanoGPT's ``.bin``), memory-mapped.
- ``Digits``: scikit-learn's 8x8 digits (shipped with it), for the ViT.
- ``ShardedLoader``: global batches of a map-style dataset, each dp rank yielding only its rows,
  epoch-seeded, resumable (``state_dict``); ``LocalBatch`` marks those rows; ``split_batch``: the rule
  that gives a dp rank its rows, and a microbatch its rows, everywhere in the engine.

Feeding the engine, two ways. ``ShardedLoader`` gives dp rank ``r`` the contiguous block
``r*B/dp .. (r+1)*B/dp`` of each global batch, the rows the engine itself would take::

    loader = ShardedLoader.for_engine(engine, TextCorpus.stdlib(seq_len=64), batch_size=32)
    for batch in loader:                 # one epoch; next(loader) goes on forever
        loss = engine.train_step(batch)  # a LocalBatch: this rank's rows of a 32-row global batch

A plain ``torch.utils.data.DataLoader`` works too, with ``DistributedSampler(ds,
num_replicas=engine.config.dp, rank=engine.mesh.rank("dp"), shuffle=True, seed=0,
drop_last=True)`` and ``batch_size=global_batch // dp``: it yields this rank's local rows, which
are handed over with ``engine.train_step(batch, local=True)``. The sampler deals the epoch's
order out round-robin (rank ``r`` gets positions ``r, r + dp, ...``) where ``ShardedLoader``
cuts it into blocks, so the ranks see other rows; but both use the same order (seeded with
``seed + epoch``), so each global batch holds the same samples and its mean loss, the
training loss, is the same. 8 samples, global batch 4, dp=2, epoch 0's order [4, 0, 7, 3, 2, 5, 1, 6]:

    >>> from torch.utils.data import DataLoader, DistributedSampler
    >>> ds = [(torch.tensor([i]), torch.tensor(i)) for i in range(8)]   # the target is the sample's id
    >>> def sampler_rows(rank):
    ...     s = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=0, drop_last=True)
    ...     return [y.tolist() for x, y in DataLoader(ds, batch_size=2, sampler=s)]
    >>> def loader_rows(rank):
    ...     return [y.tolist() for x, y in ShardedLoader(ds, 4, dp_size=2, dp_rank=rank, seed=0)]
    >>> loader_rows(0), loader_rows(1)          # blocks: [4, 0 | 7, 3], [2, 5 | 1, 6]
    ([[4, 0], [2, 5]], [[7, 3], [1, 6]])
    >>> sampler_rows(0), sampler_rows(1)        # round-robin: [4, 7 | 0, 3], [2, 1 | 5, 6]
    ([[4, 7], [2, 1]], [[0, 3], [5, 6]])
"""
from __future__ import annotations

from .images import Digits
from .loader import LocalBatch, ShardedLoader, seeded
from .synthetic import ByteText, SyntheticTokens
from .text import TextCorpus, TokenFile

__all__ = ["SyntheticTokens", "ByteText", "TextCorpus", "TokenFile", "Digits", "ShardedLoader", "LocalBatch",
           "seeded"]
