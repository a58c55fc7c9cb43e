"""``nccl_rules``: a torch.distributed backend that plays NCCL's rules over gloo.

gloo forgives what NCCL does not: it matches messages by tag, lets a pair's sends and receives
pass each other, takes CPU tensors into any group, and runs collectives that differ between ranks
as long as the bytes line up. A program that leans on any of that trains on CPU ranks and hangs
(or corrupts data) on GPUs. This backend runs every call on gloo after checking it against NCCL's
rules (``group.RulesGroup``): tags ignored, a pair's unbatched messages one at a time in issue
order, the same collectives in the same order on every rank, tensors on the job's device.

It is the default of ``ck.launch``, the notebook cluster's CPU ranks and the test suite; plain
``"gloo"`` stays available (``ck.launch(fn, n, backend="gloo")``, ``Cluster(backend="gloo")``)::

    import colab_kit as ck
    ck.launch(train, 4)                      # rank r: dist.get_backend() == "nccl_rules"
    ck.launch(train, 4, backend="gloo")      # gloo's own forgiving semantics

Inside a rank, ``batch_isend_irecv(ops)`` posts sends and receives as one group (NCCL's
``ncclGroupStart/End``; what ``torch.distributed.batch_isend_irecv`` does on NCCL), and
``pending()`` lists what this rank has issued and not completed, for hang reports.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from .group import LIVE, RulesGroup
from .pairs import RuleBroken

__all__ = ["BACKEND", "RuleBroken", "RulesGroup", "register", "batch_isend_irecv", "is_rules", "pending",
           "device_type"]

BACKEND = "nccl_rules"
"""The backend's name, for ``init_process_group``."""


def device_type() -> str:
    """The device every tensor of this process's rules groups must be on: ``COLAB_KIT_RULES_DEVICE`` (``cpu``
    by default; ``cuda`` when several ranks share one GPU and their tensors travel through host buffers)."""
    return os.environ.get("COLAB_KIT_RULES_DEVICE") or "cpu"


def _create(opts, backend_options=None):
    ranks = list(opts.global_ranks_in_group) or None
    return RulesGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, ranks, device_type(),
                      name=str(opts.group_id))


def register() -> str:
    """Make ``nccl_rules`` known to ``torch.distributed`` (idempotent), and route torch's own
    ``batch_isend_irecv`` on a rules group to this module's (``_route_torch_batches``); returns the name."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    _route_torch_batches()
    return BACKEND


_TORCH_BATCH = dist.distributed_c10d.batch_isend_irecv
"""torch's own ``batch_isend_irecv``, kept before ``_route_torch_batches`` puts ours in its place."""


def _route_torch_batches() -> None:
    """``torch.distributed.batch_isend_irecv`` (and ``distributed_c10d``'s, where torch's pipelining and other
    libraries find it) becomes ``batch_isend_irecv`` below: a batch on a rules group is one NCCL group, as on
    NCCL, instead of separate messages that rule 2 would hold back; any other group goes to torch's own,
    unchanged. Without this a library that batches its exchanges, as ``torch.distributed.pipelining``'s
    schedules do, waits forever on CPU ranks where NCCL would not (docs/nccl.md)."""
    for module in (dist, dist.distributed_c10d):
        if getattr(module, "batch_isend_irecv", None) is _TORCH_BATCH:
            module.batch_isend_irecv = batch_isend_irecv  # type: ignore[attr-defined]  # torch.distributed re-exports it


def is_rules(group) -> bool:
    return isinstance(group, RulesGroup)


def batch_isend_irecv(ops: list) -> list:
    """``torch.distributed.batch_isend_irecv`` that keeps NCCL's grouping on a rules group.

    torch runs a batch of a Python process group as separate sends and receives, which under
    rule 2 would wait on each other (a ring of two ranks, each sending first, would hang); here a
    rules group gets them as one ``RulesGroup.batch``. Other groups go to torch's function."""
    if not ops:
        return []
    group = ops[0].group or dist.distributed_c10d._get_default_group()
    if not isinstance(group, RulesGroup):
        return _TORCH_BATCH(ops)
    dist.distributed_c10d._check_p2p_op_list(ops)  # torch's own check: P2POps, all on one group
    items = []
    for op in ops:
        kind = "send" if op.op in (dist.isend, dist.send) else "recv"
        peer = getattr(op, "group_peer", None)
        items.append((kind, op.tensor, peer if peer is not None else dist.get_group_rank(group, op.peer)))
    return group.batch(items)


def pending() -> list[str]:
    """Every operation this process issued on a rules group and that has not completed, by group."""
    out = []
    for g in list(LIVE):
        mine = g.pending()
        if mine:
            out.append(f"group of ranks {g._ranks}: " + "; ".join(mine))
    return out


register()
