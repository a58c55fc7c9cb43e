"""Data parallelism: split the batch over ``dp``, all-reduce gradients in buckets.

Each dp rank runs the whole model on ``1/dp`` of the global batch. Gradients
live in one flat buffer cut into buckets (``param.grad`` is a view into its
bucket, DDP's ``gradient_as_bucket_view``: autograd accumulates straight into it,
nothing is copied in or out); when the last gradient of a bucket has been
accumulated during backward, that bucket is scaled by ``1/dp`` and its
all-reduce starts at once, overlapping the rest of the backward pass (the
bucketing of PyTorch DDP, Li et al. 2020, arXiv 2006.15704). ``finish()`` waits
for all of them.

Worked example, dp=2, global batch of 8 rows, two buckets::

    rank 0: rows 0..3 -> backward -> bucket 0 (head, ln_f, last blocks) ready -> all_reduce starts
                                  -> bucket 1 (earlier blocks, embeddings) ready -> all_reduce starts
            finish(): wait both; every grad now holds (g_rank0 + g_rank1) / 2
    rank 1: rows 4..7, the same buckets in the same order

Buckets fill in reverse parameter order, the order backward produces gradients.
By default a bucket holds about half of the gradients (at least 64 KiB, at most
DDP's 25 MB), so even a small model overlaps communication with backward. Not
more buckets than that: each all-reduce has a fixed cost (about 0.2 ms of the
launching thread's CPU, measured inside a step: Python, dispatch and caches gone
cold under backward's kernels), and on CPU ranks gloo's threads share the cores
with backward, so overlap saves little there. Measured with 2 CPU ranks on 2
cores, GPT d=128 x 4 layers (3.4 MB of gradients): 4 buckets 0-7% slower per
step than 2, one bucket per tensor (53) 17% slower; DDP forms 2 for that model.
Where a host runs more ranks than it has cores (``launch.ranks_share_cores``), CPU ranks
fill one bucket: no core is free to run an all-reduce beside backward
(``default_bucket_bytes``).
"""
from __future__ import annotations

import time
import weakref
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..config import Axis
from .. import comm
from ..precision import MasterWeights
from ..launch import ranks_share_cores
from ..placement import PlacementTable
from ..tensor import sync_grads

if TYPE_CHECKING:
    from .offload import ChunkPlacement

__all__ = ["DataParallel", "GradientPart", "default_bucket_bytes", "fill_buckets", "folded_axes", "reduction_axis"]


def reduction_axis(config) -> str:
    """The axis data parallelism reduces the dense gradients over and ZeRO shards over: ``dp``, or with
    sequence parallelism ``dp_sp`` (``ParallelConfig.zero_ranks``), where the sp ranks' sum of their token
    shares joins the mean over dp in one collective.

    >>> from colab_kit.config import ParallelConfig
    >>> reduction_axis(ParallelConfig(dp=2, zero=1)), reduction_axis(ParallelConfig(dp=2, sp=2, zero=1))
    ('dp', 'dp_sp')
    """
    return Axis.DP_SP if config.sp > 1 else Axis.DP


def folded_axes(axis: str, mesh) -> tuple[str, ...]:
    """The axes whose gradient sums a reduction over ``axis`` includes: ``(sp,)`` over ``dp_sp`` with sp > 1."""
    return (Axis.SP,) if axis == Axis.DP_SP and mesh.size(Axis.SP) > 1 else ()


def default_bucket_bytes(total: int, shared_cores: bool = False) -> int:
    """Bucket size for ``total`` gradient bytes: about two buckets (the first overlaps backward), 64 KiB to
    DDP's 25 MB cap; one bucket (to the same cap) where the host's ranks share its cores
    (``shared_cores``, ``launch.ranks_share_cores``): no core is free to run an all-reduce beside backward,
    so it only takes turns with it. Measured by hand once (engine timelines): dp=4 on 2 cores (the 4-block
    test GPT, 0.84 MB of gradients), two buckets 19.1 ms a step, one 17.3. ``ck.plan`` counts the all-reduces per step
    from it::

        >>> default_bucket_bytes(840_000), default_bucket_bytes(840_000, shared_cores=True)
        (420000, 840000)
    """
    return min(25 << 20, max(64 << 10, total if shared_cores else total // 2))


def fill_buckets(nbytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """The buckets, as indices into ``nbytes`` (each parameter's bytes, in the model's order): filled in
    reverse order (the order backward produces gradients), a bucket closed once it holds ``bucket_bytes``
    or more, so it runs over by up to a parameter; the rest is the last bucket. ``DataParallel`` buckets its
    gradients so, and ``ck.plan`` counts the all-reduces with it::

        >>> fill_buckets([4, 4, 8, 2], 6)
        [[3, 2], [1, 0]]
    """
    groups, group, held = [], [], 0
    for i in reversed(range(len(nbytes))):
        group.append(i)
        held += nbytes[i]
        if held >= bucket_bytes:
            groups.append(group)
            group, held = [], 0
    if group:
        groups.append(group)
    return groups


class _Bucket:
    """``params`` whose gradients are views into ``buffer``, one slice of the flat gradient buffer."""

    # ZeRO 2's bookkeeping of a bucket made at its first gradient (``ZeroStage2`` sets them)
    slots: dict[int, tuple[int, int]]
    used: int
    written: set[int]
    launched: bool

    def __init__(self, index: int, params: list[torch.nn.Parameter], buffer: torch.Tensor):
        self.index, self.params = index, params
        self.buffer: torch.Tensor | None = buffer  # ZeRO 2: None outside backward
        self.ready = 0
        self.pending: Any = None  # the bucket's collective in flight
        self.staged: torch.Tensor | None = None  # mixed precision: the fp32 copy that is reduced (colab_kit.precision)
        offset = 0
        for p in params:
            p.grad = buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


def _deliver(buckets_ref, bucket, param) -> None:
    buckets = buckets_ref()
    if buckets is not None:
        buckets._on_grad(bucket, param)


class DataParallel:
    """Flat gradient buckets over ``axis`` with all-reduce overlapped with backward.

    ``arm(sync)`` before each backward: with ``sync=False`` (an earlier microbatch
    of gradient accumulation) gradients only accumulate. ``finish()`` after the
    last backward waits for every bucket; ``zero()`` clears them for the next step.

    With 16-bit parameters (mixed precision, ``colab_kit.precision``) gradients still accumulate
    in the 16-bit buckets, but each bucket is reduced as an fp32 copy that becomes the ``.grad``
    of the fp32 ``masters`` (the optimizer is built over them: ``build_optimizer``) until ``zero()``.
    """

    def __init__(self, params, mesh, axis: str = Axis.DP, bucket_bytes: int | None = None, events=None,
                 placements=None, group_of=None):
        self.mesh, self.axis = mesh, axis
        self.placements = placements if placements is not None else PlacementTable()
        """The engine's ``PlacementTable``: which gradients are ``Partial()`` over a tensor or sequence axis."""
        self.size = mesh.size(axis)
        self.divisor = mesh.size(Axis.DP)
        """What each reduced gradient is divided by: dp, for the mean over the data-parallel replicas, whatever
        ``axis`` is (over ``dp_sp`` the sp ranks' shares of the same rows are summed; experts reduced over edp
        already hold the tokens of their whole ep group: ``colab_kit.zero.split``)."""
        self.folds = folded_axes(axis, mesh)
        """Axes whose ``Partial()`` gradient sums this reduction already makes (sp, reduced over ``dp_sp``):
        the tensor plan's sums (``tensor.sync_grads``) skip them."""
        self.events = events if events is not None else []
        params = [p for p in params if p.requires_grad]
        self._params = params
        if bucket_bytes is None:
            shared = mesh.device.type == "cpu" and ranks_share_cores()  # GPU ranks overlap on their devices
            bucket_bytes = default_bucket_bytes(sum(p.numel() * p.element_size() for p in params), shared)
        groups = [[params[i] for i in g] for g in fill_buckets([p.numel() * p.element_size() for p in params],
                                                                bucket_bytes)]
        if group_of is not None:  # the user's param groups: each bucket ordered by group (colab_kit.zero.optimizer)
            groups = [sorted(g, key=group_of) for g in groups]
        # one contiguous buffer for every gradient (bucket after bucket), so zeroing is one call
        # and each bucket's all-reduce runs on a contiguous slice of it (DDP's gradient_as_bucket_view)
        sizes = [sum(p.numel() for p in g) for g in groups]
        self.flat = torch.zeros(sum(sizes), dtype=params[0].dtype if params else torch.float32, device=mesh.device)
        self.buckets: list[_Bucket] = [_Bucket(i, g, buf)
                                       for i, (g, buf) in enumerate(zip(groups, self.flat.split(sizes)))]
        self._sync = True
        # one hook per parameter, bound to its bucket: the hot path is a counter and a compare
        # bound through a weak reference: a hook lives in C++, where the garbage collector cannot see
        # a cycle, so a strong one would keep the buckets (and the mesh's groups) of a dropped engine.
        # Kept with one bucket too: launched from the last hook, its collective starts before backward
        # returns; launched from finish() instead, dp=4 / dp=4 ZeRO-1 / dp=2 x pp=2 on 2 cores stepped
        # 1.6% / 2.2% / 5.3% slower (the 4-block test GPT, 12 alternating rounds, by hand once)
        self._hooks = [p.register_post_accumulate_grad_hook(partial(_deliver, weakref.ref(self), b))
                       for b in self.buckets for p in b.params]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}  # for ready()
        self.t0 = time.perf_counter()
        self.masters = self._build_masters(params)
        """fp32 master weights when the parameters are 16-bit (colab_kit.precision), else None."""

    def _build_masters(self, params):
        low = self.flat.dtype in (torch.bfloat16, torch.float16)
        return MasterWeights(params, table=self.placements) if low else None

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def master_bytes(self) -> int:
        """Bytes of the fp32 master weights (counted as "optimizer" by ``engine.memory()``)."""
        return self.masters.nbytes if self.masters is not None else 0

    def arm(self, sync: bool, t0: float | None = None) -> None:
        self._sync = sync
        if t0 is not None:
            self.t0 = t0
        for b in self.buckets:
            b.ready = 0

    def ready(self, param: torch.Tensor) -> None:
        """``param.grad`` is complete for this backward: what its post-accumulate-grad hook does, for
        code that adds into ``.grad`` itself rather than through autograd (the zero-bubble W's
        ``addmm`` in place, ``tensor.zero_bubble``). Call it once per parameter and backward."""
        bucket = self._bucket_of.get(id(param))
        if bucket is not None:
            self._on_grad(bucket, param)

    def _on_grad(self, bucket: _Bucket, _param: torch.Tensor) -> None:
        if self._sync:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        buffer = bucket.buffer
        assert buffer is not None  # stages 0 and 1 keep every bucket's buffer
        if self.masters is not None:  # mixed precision: reduce an fp32 copy, the masters' gradient
            buffer = bucket.staged = buffer.float()
        if self.divisor != 1:
            buffer.div_(self.divisor)
        if self.size == 1:
            return
        start = time.perf_counter() - self.t0
        index = bucket.index

        def record():
            self.events.append({"name": f"all_reduce bucket {index}", "kind": "comm", "start": start,
                                "end": time.perf_counter() - self.t0})

        bucket.pending = comm.all_reduce(buffer, self.mesh, self.axis, async_op=True,
                                         tag=f"grad bucket {index}", then=record)

    def finish(self) -> None:
        """Wait for every bucket; launch any whose parameters got no gradient this step."""
        for b in self.buckets:
            if b.pending is None and self._sync and b.ready < len(b.params):
                self._launch(b)
        for b in self.buckets:
            if b.pending is not None:
                b.pending.wait()
                b.pending = None
        if self.masters is not None and self._sync:
            self._masters_grads()

    def _masters_grads(self) -> None:
        """Mixed precision: each master's ``.grad`` is its view of its bucket's reduced fp32 copy."""
        views = {}
        for b in self.buckets:
            off = 0
            assert b.staged is not None  # made by _launch when there are masters
            for p in b.params:
                views[id(p)] = b.staged[off:off + p.numel()]
                off += p.numel()
        self.masters.set_grads([views[id(p)] for p in self.masters.model])

    def sync_replicated(self) -> None:
        """Mixed precision with a tensor plan: its gradient sums, on the masters' fp32 gradients."""
        sync_grads(None, self.mesh, self.masters.table, skip=self.folds)

    def build_optimizer(self, optimizer_factory) -> torch.optim.Optimizer:
        """``optimizer_factory`` over the fp32 masters (mixed precision) or the parameters."""
        params = self.masters.params if self.masters is not None else list(self._params)
        return optimizer_factory(params)

    def set_optimizer(self, optimizer, keys=None) -> None:
        """Told the optimizer built over ``optimizer_layout()`` (``keys[i]``: the tensors it steps for entry
        i); the buckets keep nothing of it (ZeRO-3's placement does)."""

    def zero(self) -> None:
        self.flat.zero_()
        for b in self.buckets:
            b.staged = None

    def optimizer_layout(self) -> list[tuple[torch.Tensor, list[tuple]]]:
        """For each tensor the optimizer steps: ``(tensor, runs)``, a run ``(param, start, length, at)``
        saying that elements ``[start, start + length)`` of ``param.reshape(-1)`` are at ``[at, at + length)``
        of ``tensor.reshape(-1)`` (``colab_kit.checkpoint`` maps them to the dense model). Here each
        tensor is one parameter (or its fp32 master), whole."""
        steps = self.masters.params if self.masters is not None else self._params
        return [(t, [(p, 0, p.numel(), 0)]) for t, p in zip(steps, self._params)]

    # what the ZeRO parts add, declared here so the engine never probes for it (GradientPart)
    live = None
    """Storages the activation meter must not count (ZeRO-3's gathered chunks): none here."""
    placement = None
    """Where each ZeRO-3 chunk lives under offload (``colab_kit.zero.offload.ChunkPlacement``): none here."""

    def host_bytes(self, optimizer) -> dict:
        """Bytes by category kept on the host (ZeRO offload): none here."""
        return {}

    def param_bytes(self) -> int | None:
        """Parameter bytes this rank holds when the part owns them (ZeRO-3's shards); None: the module's own."""
        return None

    def host_share(self) -> float | None:
        """The share of optimizer states a ZeRO-3 placement put on the host; None: no placement by chunk."""
        return None

    def gathered(self):
        """A context in which every parameter is whole: they always are here."""
        return nullcontext()

    def gather_params(self) -> None:
        """After a step or a load, make the parameters whole again from the pieces: they are whole here."""

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


class GradientPart(Protocol):
    """What the engine asks of ``engine.data_parallel``: ``DataParallel`` (plain dp), and ZeRO's ``ZeroStage1``
    (stage 1), ``ZeroStage2`` and ``ZeroStage3`` (stage 3), which provide all of it. One training step on a
    rank, whatever the stage::

        dp.arm(sync=False, t0=t0)   # microbatches before the last: accumulate, reduce nothing
        dp.arm(sync=True, t0=t0)    # the last backward: reduce (all-reduce, or reduce-scatter) as it goes
        dp.finish()                 # wait for the reductions; the masters' fp32 gradients are set
        dp.sync_replicated()        # tensor-parallel sums over replicated axes (mixed precision)
        optimizer.step()            # built by dp.build_optimizer over what this rank steps
        dp.gather_params()          # ZeRO: the updated pieces back into whole parameters
        dp.zero()
    """
    t0: float                # when the current step began (perf_counter)
    folds: tuple[str, ...]   # axes whose partial sums the reduction makes (sp over dp_sp): ``folded_axes``

    @property
    def masters(self) -> MasterWeights | None: ...  # fp32 master weights under mixed precision, else None
    @property
    def live(self) -> set[int] | None: ...  # storages the activation meter must not count, or None
    @property
    def placement(self) -> ChunkPlacement | None: ...  # ZeRO-3's chunk placement under offload, or None

    def arm(self, sync: bool, t0: float | None = None) -> None: ...
    def ready(self, param: torch.Tensor) -> None: ...
    def finish(self) -> None: ...
    def zero(self) -> None: ...
    def remove(self) -> None: ...
    @property
    def nbytes(self) -> int: ...
    def master_bytes(self) -> int: ...
    def build_optimizer(self, optimizer_factory) -> torch.optim.Optimizer: ...
    def set_optimizer(self, optimizer, keys=None) -> None: ...
    def optimizer_layout(self) -> list: ...
    def sync_replicated(self) -> None: ...
    def gather_params(self) -> None: ...
    def host_bytes(self, optimizer) -> dict: ...
    def param_bytes(self) -> int | None: ...
    def host_share(self) -> float | None: ...
    def gathered(self) -> AbstractContextManager: ...

