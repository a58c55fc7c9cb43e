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
  collective), so the node's NICs are shared among its ``G / k`` groups: a ring collective's wire bytes ``W``
  per rank go at ``k`` rails, ``W / (k x node NICs x bus_efficiency[1] / G)``, as NCCL spreads a group's
  channels over the NICs next to its ``k`` GPUs (nccl-tests#119: 3 nodes of 8 A100 reach 85-96 GB/s bus
  bandwidth of a node's 100), and no faster than NVLink; a dp group of one rank per node (tp = 8) meets one
  rail (25 GB/s x 0.9 on DGX A100), a pure dp group of 8 per node all eight. An all-to-all's and a send's
  off-node bytes go at the rank's own rail (every rank of the node sends its own);
- the ring's latency is its hops (``n - nodes`` NVLink hops, ``nodes`` network hops, twice for an all-reduce);
  all-reduce across nodes may take NCCL's tree instead (``2 log2(nodes)`` network hops and a chain of ``k``
  NVLink hops, the ring's bandwidth bound: NCCL's two trees reach about the ring's bus bandwidth)
  when faster, as NCCL's tuner picks; all-gather and reduce-scatter are rings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...comm.records import wire_bytes
from ...config import Axis
from .hardware import Hardware

__all__ = ["Group", "latency", "placement", "seconds", "stride"]


@dataclass(frozen=True)
class Group:
    """Where one group of an axis lies: ``size`` ranks, ``per_node`` of them on each node it spans."""
    size: int
    per_node: int
    nodes: int


def stride(config, axis: str) -> tuple[int, int]:
    """``(size, stride)`` of a group of ``axis``: a mesh axis (``dp_sp``: dp and sp together, the ranks that hold
    the same parameters, over which gradients are reduced), "ep" / "edp" (the dp x sp block folded as
    ``[edp, ep]``, ep fastest: an ep group is ``ep`` neighbours of that block, an edp group ``ep`` of them apart)
    or a tensor sub-axis (``mesh``'s names)."""
    tp, sp, dp = config.tp, config.sp, config.dp
    q = config.tp_q
    table: dict[str, tuple[int, int]] = {
             Axis.TP: (tp, 1), Axis.SP: (sp, tp), Axis.DP: (dp, tp * sp), Axis.PP: (config.pp, tp * sp * dp),
             Axis.DP_SP: (dp * sp, tp), Axis.EP: (config.ep, tp), Axis.EDP: (dp * sp // config.ep, tp * config.ep),
             Axis.TP_COL: (q, 1), Axis.TP_ROW: (q, q), Axis.TP_DEP: (config.tp_depth, q * q),
             Axis.TP_OUT: (q, 1), Axis.TP_WT: (q, q), Axis.TP_IN: (q, q * q)}
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
    bw = max(wire / (share * group.per_node), wire / nv)  # the group's k rails, NVLink inside the node
    ring = passes * ((n - group.nodes) * lat_nv + group.nodes * lat_net) + bw
    if op != "all_reduce":
        return ring
    tree = 2 * (math.log2(group.nodes) * lat_net + group.per_node * lat_nv) + bw
    return min(ring, tree)


def latency(op: str, group: Group, hw: Hardware) -> float:
    """The latency part of one ring collective ``op`` over ``group`` (``seconds`` of a payload that costs no
    bandwidth): what each further collective of a payload split into pieces adds (DeepSpeed 2021's
    per-tensor gathers, ``planner.cluster.stack``). A ring of ``n`` ranks on ``nodes`` nodes waits ``n - nodes``
    NVLink hops and ``nodes`` network hops, twice for an all-reduce; grows with the ranks.

    >>> from colab_kit.planner.cluster.hardware import HARDWARE
    >>> round(latency("all_gather", Group(1536, 8, 192), HARDWARE["8xA100-80GB"]) * 1e3, 2)  # ms
    5.95
    """
    n = group.size
    if n <= 1:
        return 0.0
    lat_nv, lat_net = hw.intra[0], hw.inter[0]
    if group.nodes <= 1:
        return (n - 1) * lat_nv * (2 if op == "all_reduce" else 1)
    return (2 if op == "all_reduce" else 1) * ((n - group.nodes) * lat_nv + group.nodes * lat_net)
