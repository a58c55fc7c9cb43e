"""Collectives that record themselves: every call lands in the mesh's ``CommLog``.

Each record is one collective on one rank: the op, the mesh axis it ran on,
the bytes this rank contributed and the seconds from launch until the result
was ready (for async calls, until ``wait()`` returned). Inside each rank of a dp group of 4::

    comm.all_reduce(grad_bucket, mesh, "dp")   # a 4 KiB bucket
    mesh.log.records[-1]
    # CommRecord(op='all_reduce', axis='dp', bytes=4096, seconds=0.0003, tag='', wire=6144)

The record itself needs no ranks::

    >>> log = CommLog()
    >>> log.add("all_reduce", "dp", 4096, 0.0003, n=4)
    CommRecord(op='all_reduce', axis='dp', bytes=4096, seconds=0.0003, tag='', wire=6144)

Two byte counts per record, because they answer different questions:

``bytes`` (payload)
    what this rank hands to the collective: the tensor it passes in. This is the unit
    of the paper's per-layer formulas (``tensor.linear_comm_bytes``) and it does not
    depend on how the backend moves data. all_reduce, broadcast, reduce, send, recv:
    the tensor (on every rank, the receivers of a broadcast too); all_gather: this
    rank's piece ``s``; reduce_scatter and all_to_all: the whole input ``S`` before it
    is split.
``wire`` (bytes this rank sends, ring / pipelined-chain model, group of n ranks)
    all_reduce ``2 (n-1)/n * S``, reduce_scatter ``(n-1)/n * S``, all_gather
    ``(n-1) * s`` (= ``(n-1)/n`` of the gathered result), broadcast and reduce
    ``(n-1)/n * S`` (a chain forwards S n-1 times; averaged per rank), send ``S``,
    recv ``0``; all_to_all ``(n-1)/n * S`` (it keeps its own block). This is what a link
    carries, so it compares across ops and modes.

Worked example, a 4 KiB tensor on a dp group of 4 ranks::

    all_reduce      bytes 4096   wire 6144     (2 * 3/4 * 4096)
    all_gather      bytes 4096   wire 12288    (3 pieces sent; result 16 KiB)
    reduce_scatter  bytes 4096   wire 3072     (3/4 of the input)

The package: ``records`` (CommRecord, CommLog, wire_bytes), ``waiting`` (finish, Pending, the
hang flag's Aborted), ``collectives``, ``p2p`` (isend, irecv, sendrecv) and ``groups`` (the
autograd functions of a tensor-parallel group); every name is used as ``comm.<name>``.
"""
from __future__ import annotations

from .collectives import (all_gather, all_gather_into, all_reduce, all_to_all, all_to_all_v, broadcast, reduce,
                          reduce_scatter, reduce_scatter_into)
from .groups import copy_to_group, gather_from_group, reduce_from_group, split_to_group
from .p2p import P2PPending, irecv, isend, sendrecv
from .records import CommLog, CommRecord, wire_bytes
from . import rules  # registers the nccl_rules backend with torch.distributed
from .waiting import ABORT_POLL, Aborted, Pending, WaitTimeout, finish

__all__ = ["Aborted", "WaitTimeout", "ABORT_POLL", "CommRecord", "CommLog", "wire_bytes", "all_reduce", "broadcast",
           "all_gather", "reduce_scatter", "reduce", "Pending", "copy_to_group", "reduce_from_group",
           "gather_from_group", "split_to_group", "P2PPending", "isend", "irecv", "sendrecv", "reduce_scatter_into",
           "all_gather_into", "all_to_all", "all_to_all_v", "finish", "rules"]
