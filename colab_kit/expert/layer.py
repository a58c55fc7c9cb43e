"""Expert parallelism: each rank holds ``E / ep`` experts of a layer, and tokens travel to them by all-to-all.

``ExpertParallel`` takes the place of a layer's ``Experts`` (``colab_kit.models.experts``) and keeps its
interface: ``forward(rows, counts)`` with ``rows`` in expert-major order over all ``E`` experts and ``counts``
rows per expert, returning the experts' outputs in the same order. So the router, capacity, losses and
combine of the MoE layer run unchanged on this rank's tokens; only the expert compute moves (GShard's
dispatch and combine, Lepikhin et al. 2020, as torchtitan's and Megatron-Core's all-to-all dispatchers).

One forward on ep rank ``r`` of ``ep`` (experts ``r E/ep .. (r+1) E/ep - 1`` here)::

    1. counts [E] -> [ep, E/ep]: rows for each rank's experts; all_to_all of the counts: got [ep, E/ep],
       the rows each source sends for each of this rank's experts
    2. dispatch: all_to_all_v of the rows (rank j's block is contiguous: expert-major order)
    3. the received rows are source-major; a stable sort by local expert makes them expert-major
       (inside an expert: source order, then each source's order), the local experts run on them
    4. back to source-major, combine: all_to_all_v with the sizes swapped; the rows come back in the
       order they left

Worked example, E=4, ep=2, rank 0 routes counts [2 0 1 1], rank 1 counts [0 3 0 2]::

    rank 0 sends [2 0] rows to itself, [1 1] to rank 1; rank 1 sends [0 3] to rank 0, [0 2] to itself
    rank 0 receives [[2 0], [0 3]]: 2 rows of rank 0 for expert 0, 3 of rank 1 for expert 1
             expert-major: expert 0 <- rank 0's 2 rows; expert 1 <- rank 1's 3 rows (counts [2 3])
    rank 1 receives [[1 1], [0 2]]: expert 2 <- rank 0's 1 row; expert 3 <- rank 0's 1, rank 1's 2

Both expert-parallel layers (this one and ``colab_kit.expert.hf``'s ``HFExpertParallel``) are built of the
two helpers here: ``slice_experts`` (the cut: this rank's slice of each stacked tensor, ``Shard(0)`` on ep) and
``dispatch_combine`` (steps 1-4 around the local experts' math, which each layer hands in).

Every row is computed by the same expert weights as in one process, and the backward runs the same
exchanges in reverse (``AllToAll``): the expert weights' gradients hold the contributions of the tokens of
every rank of the ep group; the expert-data-parallel group (``edp``) sums them (``colab_kit.zero``).
A rank or an expert that receives no row computes on zero rows: its weights get a zero gradient.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn as nn

from ..config import Axis
from .. import comm
from ..models.experts import Experts, expert_compute, EXPERT_COMPUTE
from ..placement import declare
from ..sharded_init import cut

__all__ = ["AllToAll", "ExpertParallel", "expert_major", "slice_experts", "dispatch_combine", "Exchanged"]

WEIGHTS = ("w_in", "b_in", "w_out", "b_out")


class AllToAll(torch.autograd.Function):
    """``AllToAll.apply(rows, send, recv, mesh, axis, tag)``: ``comm.all_to_all_v`` forward; backward the
    same exchange with ``send`` and ``recv`` swapped (GShard's dispatch and combine are each other's
    transpose)."""

    @staticmethod
    def forward(ctx, rows, send, recv, mesh, axis, tag):
        ctx.args = (send, recv, mesh, axis, tag)
        return comm.all_to_all_v(rows, send, recv, mesh, axis, tag=tag)

    @staticmethod
    def backward(ctx, grad):
        send, recv, mesh, axis, tag = ctx.args
        return comm.all_to_all_v(grad, recv, send, mesh, axis, tag=tag + " backward"), None, None, None, None, None


def expert_major(got: torch.Tensor) -> torch.Tensor:
    """The order that takes rows received source-major (``got [sources, experts]`` rows per block) to
    expert-major (inside an expert: source order, then arrival order): a stable sort by expert.

        >>> expert_major(torch.tensor([[1, 2], [1, 0]]))   # rows: s0e0 | s0e1 s0e1 | s1e0
        tensor([0, 3, 1, 2])
    """
    sources, experts = got.shape
    block = torch.repeat_interleave(torch.arange(sources * experts, device=got.device), got.reshape(-1))
    return torch.sort(block % experts, stable=True).indices


def slice_experts(into: nn.Module, experts: nn.Module, names: Sequence[str], mesh, axis: str) -> tuple[int, int]:
    """Register on ``into`` this rank's ``E / ep`` experts of each stacked tensor ``names`` of ``experts`` (dim 0
    the expert; same names, same ``requires_grad``), each declared ``Shard(0)`` on ``axis``; cut from
    ``sharded_init.cut``: a meta tensor stays meta (with a recipe: made later, one dense tensor alive at a time).
    Returns ``(first, local)``: this rank's first expert and how many it holds.

    E=8, ep=4, rank 2: ``w_in [8, d, f]`` -> ``into.w_in [2, d, f]`` (experts 4 and 5), returns ``(4, 2)``."""
    local = getattr(experts, names[0]).shape[0] // mesh.size(axis)
    first = mesh.rank(axis) * local
    for name in names:
        with torch.no_grad():  # a meta tensor stays meta (made later, alone, if it has a recipe)
            mine = cut(getattr(experts, name), lambda d: d[first:first + local])
        into.register_parameter(name, nn.Parameter(mine, requires_grad=getattr(experts, name).requires_grad))
        declare(into, name, {0: axis})
    return first, local


class Exchanged(NamedTuple):
    """What ``dispatch_combine`` returns."""

    out: torch.Tensor
    """The experts' outputs of the rows, back on this rank in the order the rows left: ``[M, d]``."""
    last: dict
    """Rows: ``send`` to / ``recv`` from each ep rank, ``local`` per local expert."""
    traffic: dict
    """Bytes of the dispatch: ``sent`` to / ``received`` from each ep rank (a layer's ``sent`` / ``received``
    records, ``colab_kit.expert.records``)."""


def dispatch_combine(rows: torch.Tensor, counts: torch.Tensor,
                     compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], mesh, axis: str) -> Exchanged:
    """GShard's dispatch and combine around this rank's experts (steps 1-4 of the module docstring): ``rows
    [M, d]`` in expert-major order over all ``E`` experts, ``counts [E]`` rows per expert, travel to the ep ranks
    holding their experts (the counts by ``comm.all_to_all``, "expert counts"; the rows by ``AllToAll``, "expert
    dispatch"), are made expert-major (``expert_major``) and run through ``compute(rows, local)`` (the local
    experts' math, ``local [E / ep]`` rows per local expert), and their outputs go back source-major and home
    ("expert combine"). Same call on every rank of the ep group.

    Rank 0 of the module docstring's example, ``d`` = 4 in fp32 (16 bytes a row): ``last`` ``{"send": [2, 2],
    "recv": [2, 3], "local": [2, 3]}``, ``traffic`` ``{"sent": [32, 32], "received": [32, 48]}``."""
    per_rank = counts.view(mesh.size(axis), -1)
    got = comm.all_to_all(per_rank.contiguous(), mesh, axis, split_dim=0, cat_dim=0,
                          tag="expert counts")  # [sources, local experts]
    held = got.tolist()  # the split sizes all_to_all_v takes on the host: read once, beside the local counts
    send, recv, per_expert = per_rank.sum(1).tolist(), [sum(r) for r in held], [sum(c) for c in zip(*held)]
    arrived = AllToAll.apply(rows, send, recv, mesh, axis, "expert dispatch")
    order = expert_major(got)
    out = compute(arrived[order], got.sum(0))
    back = out[torch.argsort(order)]  # source-major again
    row = rows.shape[-1] * rows.element_size()
    return Exchanged(AllToAll.apply(back, recv, send, mesh, axis, "expert combine"),  # no host read after compute
                     {"send": send, "recv": recv, "local": per_expert},
                     {"sent": [n * row for n in send], "received": [n * row for n in recv]})


class ExpertParallel(nn.Module):
    """This rank's ``E / ep`` experts of a layer (its slice of the stacked tensors, ``Shard(0)`` on ``ep``) and
    the all-to-all around them; a drop-in for ``Experts`` (see the module docstring)."""

    def __init__(self, experts: Experts, mesh, axis: str = Axis.EP):
        super().__init__()
        self.mesh, self.axis, self.n, self.d, self.f = mesh, axis, experts.n, experts.d, experts.f
        self.first, self.local = slice_experts(self, experts, WEIGHTS, mesh, axis)
        self.last: dict = {}
        """The last forward's rows: ``send`` / ``recv`` per ep rank, and ``local`` rows per local expert."""
        self.traffic: dict = {}
        """The last forward's dispatch bytes: ``sent`` to / ``received`` from each ep rank (the MoE layer's
        records read it: ``colab_kit.expert.records``)."""

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, how: str | None = None) -> torch.Tensor:
        def compute(got: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
            return expert_compute(got, local, self.w_in, self.b_in, self.w_out, self.b_out, how or EXPERT_COMPUTE)

        out, self.last, self.traffic = dispatch_combine(rows, counts, compute, self.mesh, self.axis)
        return out

    def extra_repr(self) -> str:
        return (f"experts {self.first}..{self.first + self.local - 1} of {self.n} (d {self.d}, f {self.f}) "
                f"over {self.axis}={self.mesh.size(self.axis)}")
