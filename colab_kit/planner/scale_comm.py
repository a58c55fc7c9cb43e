"""Collectives on a real cluster: a group's ranks placed on nodes by the rank order, priced as NCCL runs them.

The rank order is fixed (``colab_kit.mesh``): ``rank = ((pp_i * dp + dp_i) * sp + sp_i) * tp + tp_i``, so a
group of axis ``a`` is ``size`` ranks ``stride`` apart (tp: 1, sp: tp, dp: tp * sp, pp: tp * sp * dp; the
tensor modes' sub-axes inside the tp block: 2D col 1 / row q, 2.5D col 1 / row q / dep q^2, 3D out 1 /
wt q / in q^2). With G GPUs per node, ``k`` of its members share a node::

    k = size if stride * size <= G else max(1, G // stride)        nodes = ceil(size / k)

Worked example, tp=8 x pp=8 x dp=24 on DGX A100 (G = 8): a tp group is 8 ranks 1 apart, all on one node
(NVLink); a dp group is 24 ranks 8 apart, one per node on 24 nodes; a pp group 8 ranks 192 apart::

    >>> from colab_kit.config import ParallelConfig
    >>> c = ParallelConfig(dp=24, pp=8, tp=8)
    >>> [placement(c, a, 8) for a in ("tp", "dp", "pp")]
    [Group(size=8, per_node=8, nodes=1), Group(size=24, per_node=1, nodes=24), Group(size=8, per_node=1, nodes=8)]

Pricing (``seconds``), alpha-beta per algorithm, wire bytes per rank as ``comm.wire_bytes`` counts them:

- inside a node: NVLink each way at ``bus_efficiency[0]`` (nccl-tests' bus bandwidth), a latency per hop;
- across nodes: every GPU of a node talks across nodes at once (every group of the axis runs the same
  collective), so each rank's wire bytes ``W`` go at its own share of the node's NICs, its rail:
  ``W / (node NICs x bus_efficiency[1] / G)`` (25 GB/s x 0.9 on DGX A100); NVLink bounds the steps inside
  the node. This is the bound a group with one member per node meets; for a group with ``k > 1`` members per
  node NCCL's rings can pool the node's NICs (nccl-tests#119 measures ~90% of the node's NICs for 8 ranks a
  node), up to ``k`` times faster. The rail bound is kept: it is what Megatron-LM measured of ZeRO-3 across
  1,536 A100s (a third of tensor + pipeline parallelism's throughput), which pooling would not explain;
- the ring's latency is its hops (``n - nodes`` NVLink hops, ``nodes`` network hops, twice for an all-reduce);
  all-reduce across nodes may take NCCL's tree instead (``2 log2(nodes)`` network hops and a chain of ``k``
  NVLink hops, the ring's bandwidth bound: NCCL's two trees reach about the ring's bus bandwidth)
  when faster, as NCCL's tuner picks; all-gather and reduce-scatter are rings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..comm.records import wire_bytes
from .hardware import Hardware

__all__ = ["Group", "placement", "seconds", "stride"]


@dataclass(frozen=True)
class Group:
    """Where one group of an axis lies: ``size`` ranks, ``per_node`` of them on each node it spans."""
    size: int
    per_node: int
    nodes: int


def stride(config, axis: str) -> tuple[int, int]:
    """``(size, stride)`` of a group of ``axis``: a mesh axis, "dp+sp" (gradients: dp and sp together, the
    ranks that hold the same parameters), "ep" / "edp" (the dp x sp block folded as ``[edp, ep]``, ep
    fastest: an ep group is ``ep`` neighbours of that block, an edp group ``ep`` of them apart) or a tensor
    sub-axis (``mesh``'s names)."""
    tp, sp, dp = config.tp, config.sp, config.dp
    q = config.tp_q
    table = {"tp": (tp, 1), "sp": (sp, tp), "dp": (dp, tp * sp), "pp": (config.pp, tp * sp * dp),
             "dp+sp": (dp * sp, tp), "ep": (config.ep, tp), "edp": (dp * sp // config.ep, tp * config.ep),
             "tp_col": (q, 1), "tp_row": (q, q), "tp_dep": (config.tp_depth, q * q),
             "tp_out": (q, 1), "tp_wt": (q, q), "tp_in": (q, q * q)}
    return table[axis]


def placement(config, axis: str, gpus_per_node: int) -> Group:
    """The nodes a group of ``axis`` spans under the rank order (see the module docstring)."""
    size, step = stride(config, axis)
    return _place(size, step, gpus_per_node)


def _place(size: int, step: int, g: int) -> Group:
    if size <= 1:
        return Group(max(size, 1), 1, 1)
    k = size if step * size <= g else max(1, min(size, g // step))
    return Group(size, k, math.ceil(size / k))


def seconds(op: str, payload: float, group: Group, hw: Hardware) -> float:
    """Seconds of one collective ``op`` of ``payload`` bytes per rank over ``group`` (see the module
    docstring). ``op``: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, send."""
    n = group.size
    if payload <= 0 or (n <= 1 and op != "send"):
        return 0.0
    lat_nv, lat_net = hw.intra[0], hw.inter[0]
    nv = hw.intra[1] * hw.bus_efficiency[0]
    wire = float(wire_bytes(op, int(payload), n)) if op != "broadcast" else float(payload)
    if group.nodes <= 1:  # NVLink only
        if op == "send":
            return lat_nv + payload / nv
        hops = (n - 1) * (2 if op == "all_reduce" else 1)
        return hops * lat_nv + wire / nv
    share = hw.node_nic_bytes_per_s * hw.bus_efficiency[1] / hw.gpus_per_node  # this rank's rail
    if op == "send":
        return lat_net + payload / share
    if op == "all_to_all":  # the bytes for other nodes on the rank's rail, the rest on NVLink
        off = payload * (n - group.per_node) / n
        return lat_net + off / share + (wire - off) / nv
    passes = 2 if op == "all_reduce" else 1
    bw = max(wire / share, wire / nv)
    ring = passes * ((n - group.nodes) * lat_nv + group.nodes * lat_net) + bw
    if op != "all_reduce":
        return ring
    tree = 2 * (math.log2(group.nodes) * lat_net + group.per_node * lat_nv) + bw
    return min(ring, tree)
