"""Two gradient parts under one interface: the dense parameters over dp (dp x sp under sequence parallelism,
``stage0.reduction_axis``), the experts over edp (``ep > 1``).

With expert parallelism the ranks of a dp group hold different experts, so one flat buffer reduced over dp
cannot carry both. ``ExpertSplit`` keeps two parts of the same ZeRO stage (``DataParallel``, 1 or 2): one
over ``dp`` for every parameter replicated there, one over ``edp`` for the expert tensors (``Shard(0)`` on
``ep`` in the placement table). Both divide by dp: an expert's gradient on a rank already holds the tokens
of every rank of its ep group (the all-to-all's backward brought them), and the sum over edp adds the other
groups', so the sum over edp divided by dp is the gradient of the mean loss, as for the dense weights.

Worked example, ``ParallelConfig(dp=4, ep=2, zero=1)``, rank 2 (edp 1, ep 0): the dense buckets are
reduce-scattered over dp ``[0 1 2 3]`` (a quarter of the optimizer states each); experts 0..E/2-1 over edp
``[0 2]`` (a half of those experts' states each). One optimizer steps both parts' pieces.

ZeRO-3 (``ZeroStage3``) splits the same way inside each unit it gathers (``chunk_units``): a block with expert
tensors becomes two chunks, its dense parameters over dp and its experts over edp (divisor dp), gathered,
freed and reduced together by the block's hooks.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

from ..config import Axis
from ..measure import optimizer_bytes
from ..placement import PlacementTable
from ..precision import MasterWeights
from .chunks import Chunk
from .stage1 import build_over

__all__ = ["ExpertSplit", "split_experts", "JoinedMasters", "chunk_units"]


def split_experts(params, table) -> tuple[list, list]:
    """``(dense, experts)``: the parameters whose placement shards them over ``ep``, and the others."""
    params = list(params)
    experts = [p for p in params if any(Axis.EP in axes for _, axes in table[p].shards)]
    ids = {id(p) for p in experts}
    return [p for p in params if id(p) not in ids], experts


def chunk_units(units, mesh, axis: str, table, experts: bool) -> tuple[list, list[list[int]]]:
    """ZeRO-3's chunks of ``units`` (``stage3.units_of``: ``(name, block, params)``, forward order) and, per
    unit, the indices of its chunks. ``experts`` (``ep > 1``): a unit's expert tensors (``split_experts``) go
    into a second chunk ``"<name>.experts"`` over ``edp``, divided by the size of ``axis`` (dp) as
    ``ExpertSplit`` does; without any, or without ``experts``, a unit is one chunk over ``axis``.

    Worked example, a GPT of 2 MoE blocks, ``ParallelConfig(dp=4, ep=2, zero=3)``::

        chunks  0 rest (over dp)  1 blocks.0 (dp)  2 blocks.0.experts (edp)  3 blocks.1 (dp)  4 blocks.1.experts
        units   [[0], [1, 2], [3, 4]]
    """
    chunks: list = []
    of_unit: list[list[int]] = []
    for name, _, params in units:
        dense, mine = split_experts(params, table) if experts else (params, [])
        parts = [(name, dense, axis)] + ([(f"{name}.experts", mine, Axis.EDP)] if mine else [])
        of_unit.append([])
        for label, ps, over in parts:
            if not ps and label == "tail":  # a tail whose only weight is tied to the embeddings': no chunk of its own
                continue
            c = Chunk(len(chunks), label, ps, mesh, over)
            of_unit[-1].append(c.index)
            chunks.append(c)
    return chunks, of_unit


class ExpertSplit:
    """A ``GradientPart`` (``colab_kit.zero.stage0``) made of ``dense`` (over dp) and ``experts`` (over edp):
    every call goes to both, the optimizer steps the pieces of both (see the module docstring)."""

    def __init__(self, dense, experts, zero: int):
        self.dense, self.experts, self.stage = dense, experts, zero
        self.parts = (dense, experts)
        self.folds = dense.folds  # the experts carry no sp partial (their ep declaration replaced it)
        self._owner = {id(p): part for part in self.parts for p in part._params}
        low = [p.masters for p in self.parts if p.masters is not None]
        self.masters = JoinedMasters(low) if low else None
        """Mixed precision: both parts' fp32 masters as one (what the optimizer and ``master_step`` see)."""

    t0 = property(lambda self: self.dense.t0)
    live = None
    placement = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def master_bytes(self) -> int:
        return sum(p.master_bytes() for p in self.parts)

    def arm(self, sync: bool, t0: float | None = None) -> None:
        for p in self.parts:
            p.arm(sync, t0)

    def ready(self, param: torch.Tensor) -> None:
        owner = self._owner.get(id(param))
        if owner is not None:
            owner.ready(param)

    def finish(self) -> None:
        for p in self.parts:
            p.finish()

    def zero(self) -> None:
        for p in self.parts:
            p.zero()

    def remove(self) -> None:
        for p in self.parts:
            p.remove()

    def optimizer_layout(self) -> list:
        return [entry for p in self.parts for entry in p.optimizer_layout()]

    def build_optimizer(self, optimizer_factory) -> torch.optim.Optimizer:
        """One optimizer over both parts' tensors (ZeRO: checked to step exactly them, elementwise)."""
        tensors = [t for t, _ in self.optimizer_layout()]
        return build_over(tensors, optimizer_factory) if self.stage else optimizer_factory(tensors)

    def set_optimizer(self, optimizer, keys=None) -> None:
        for p in self.parts:
            p.set_optimizer(optimizer, None)

    def sync_replicated(self) -> None:
        for p in self.parts:
            p.sync_replicated()

    def gather_params(self) -> None:
        for p in self.parts:
            p.gather_params()

    def host_bytes(self, optimizer) -> dict:
        """offload='cpu': the one optimizer's states and both parts' masters are on the host."""
        if getattr(self.dense, "offload", "none") != "cpu":
            return {}
        return {"optimizer": optimizer_bytes(optimizer) + self.master_bytes()}

    def param_bytes(self) -> int | None:
        return None

    def host_share(self) -> float | None:
        return None

    @contextmanager
    def gathered(self):
        with ExitStack() as stack:
            for p in self.parts:
                stack.enter_context(p.gathered())
            yield


class JoinedMasters(MasterWeights):
    """The fp32 masters of several gradient parts as one ``MasterWeights`` (their order: part after part); each
    part keeps setting its own masters' gradients, so ``set_grads`` splits its list the same way."""

    def __init__(self, parts: list[MasterWeights]):  # no super().__init__: the copies exist already
        self.parts = parts
        self.model = [t for p in parts for t in p.model]
        self.params = [m for p in parts for m in p.params]
        self.table = PlacementTable()
        for p in parts:
            for m in p.params:
                self.table.alias(m, m, p.table)

    def set_grads(self, grads) -> None:
        grads, at = list(grads), 0
        for p in self.parts:
            p.set_grads(grads[at:at + len(p.params)])
            at += len(p.params)
