"""Sequence parallelism over the ``sp`` axis: the attention kernels of ``sp_mode`` "ring" and "ulysses".

* ``zigzag``: how the sequence is split over the ranks (``split_sequence``, ``unsplit_sequence``,
  ``sequence_positions``); ring attention uses the zigzag layout, Ulysses the contiguous one
  by default (and takes the zigzag one too).
* ``ring``: ``ring_attention`` (Li et al. 2021, online-softmax form, K/V passed around the ring).
* ``ulysses``: ``ulysses_attention`` (DeepSpeed-Ulysses, all-to-all to heads and back).

Inside a rank of ``ParallelConfig(sp=2)``, with ``q, k, v`` of the whole sequence ``[b, h, t, d]``::

    mesh = ck.ProcessMesh(cfg)
    r, sp = mesh.rank("sp"), mesh.size("sp")
    mine = [split_sequence(x, r, sp, dim=2) for x in (q, k, v)]   # rank 0: chunks 0, 3
    out = ring_attention(*mine, mesh)                              # this rank's rows, same layout
"""
from .ring import RingAttention, RingRecorder, merge_lse, ring_attention
from .ulysses import UlyssesAllToAll, check_heads, ulysses_attention
from .zigzag import (LAYOUTS, check_length, chunk_ids, gathered_order, sequence_positions, split_sequence,
                     unsplit_sequence)

__all__ = ["ring_attention", "RingAttention", "RingRecorder", "merge_lse", "ulysses_attention", "UlyssesAllToAll",
           "check_heads", "LAYOUTS", "chunk_ids", "check_length", "split_sequence", "unsplit_sequence",
           "sequence_positions", "gathered_order"]
