"""ZeRO stages 1 and 2 over the dp axis (Rajbhandari et al. 2020, arXiv 1910.02054); with sequence parallelism
over the dp x sp ranks (``dp_sp``, ``stage0.reduction_axis``): read dp as dp x sp below.

Plain data parallelism keeps on every dp rank the whole optimizer state and the whole
reduced gradient, although each rank then makes the same update. ZeRO cuts the update
into dp pieces: each rank keeps the optimizer state of its piece only, steps that piece,
and the updated pieces are gathered back into every rank's full parameters.

- stage 1 (P_os): optimizer states sharded; gradients are held whole.
- stage 2 (P_os+g): gradients sharded too: after the reduction only this rank's piece is kept.

Layout. Gradients fill buckets during backward exactly as in ``DataParallel`` (reverse
parameter order, about two buckets; one where a host's CPU ranks share its cores). Each bucket is padded to a multiple
of dp and is cut into dp equal pieces; rank r owns piece r of every bucket. Parameters are moved into one
flat buffer with the same layout as the gradients (each ``param.data`` a view into it), so
a bucket of gradients and its bucket of parameters cover the same elements. In DTensor's
words, per bucket over the dp axis: parameters Replicate; gradients Partial after backward,
Shard(0) after the reduce-scatter; optimizer states Shard(0).

Worked example, dp=2, two buckets of 10 and 7 elements (the second padded to 8)::

    flat space      bucket 0: [0, 10)            bucket 1: [10, 18)  (17 used, 1 padding)
    rank 0 owns     [0, 5)                       [10, 14)            -> shard tensors of 5 and 4
    rank 1 owns     [5, 10)                      [14, 18)

    backward        bucket 1 complete -> reduce-scatter (async): rank r gets its 4 summed elements
                    bucket 0 complete -> reduce-scatter (async): rank r gets its 5
    finish()        wait both (a bucket with a parameter that got no gradient is launched here)
    step            optimizer.step() over this rank's two shard tensors only
    gather          all-gather bucket 0 and bucket 1: every rank's updated piece -> full parameters

Per step and rank, a bucket of S bytes sends (n-1)/n S in its reduce-scatter and (n-1)/n S
in its all-gather: the bytes of one ring all-reduce (2 (n-1)/n S), as the paper says.
That is what NCCL moves, and what the comm records count. torch's gloo backend runs a
reduce-scatter as an all-reduce of a copy of the input, keeping one block, so on CPU
ranks a ZeRO step really moves an all-reduce plus an all-gather (FSDP2 on gloo alike).
Both collectives run in place here (output inside input, or input inside output), which
NCCL documents and gloo allows (it copies through its own buffers).

The optimizer. ``optimizer_factory`` is called with this rank's shard tensors: one flat
tensor per bucket, a view into the parameter buffer (so stepping it updates this rank's
piece of the parameters in place), whose ``.grad`` is this rank's piece of the reduced
gradient. An elementwise optimizer (SGD with momentum, Adam, AdamW, ...) makes the same
update on a flat piece as on each parameter. One that looks at a whole parameter would not:
LAMB and LARS scale each parameter's update by the ratio of its norms, Adafactor factors a
matrix's second moment by rows and columns; on a flat piece those are norms of a piece of
several parameters. ``check_optimizer`` refuses the ones torch ships (LBFGS, SparseAdam,
Adafactor, Muon) and any optimizer not known to be elementwise (``colab_kit.zero.optimizer``). A user's
optimizer with param groups (``boost(model, optimizer, cfg)``) keeps them: each bucket is ordered by
group, and a piece that spans two groups is stepped as one view per group (``colab_kit.zero.optimizer``).

Memory (fp32, P parameters, dp = n), what ``nbytes`` and ``engine.memory()`` report:

- stage 1: grads 4P (the full buffer; this rank's reduced piece is a view into it,
  reduced in place), optimizer states K*P/n.
- stage 2: grads 4P/n between steps (the pieces). Inside the step each bucket's full storage
  exists only from its first gradient to the end of its own reduce-scatter, and every microbatch
  is reduced (``colab_kit.zero.stage2.ZeroStage2``, the subclass ``ck.boost`` builds for zero=2).

Mixed precision (``colab_kit.precision``): the buffers above are 16-bit; each bucket is
reduce-scattered as an fp32 copy, the fp32 pieces are the ``.grad`` of this rank's fp32
``masters`` (the optimizer's tensors, 4P/n, counted as "optimizer"); stage 2 keeps its
reduced piece in 16 bits (2P/n). After the step the masters are copied into the 16-bit pieces.

Composition. With tensor parallelism the parameters are this rank's tp shards, sharded
again over the dp group of this tp coordinate. A parameter whose gradient the tensor plan
sums over a replicated axis (``Partial()`` in the placement table) is summed on this rank's piece, after the
dp reduction: sums over different groups commute, and every rank of one tp group holds the
same layout and the same dp coordinate, hence the same pieces (checked once at start). The sequence plan's
sums over sp are the reduction's own (``folds``: it runs over dp x sp). With
pipeline parallelism each pp rank shards its own stages' parameters over its dp group; the
executor drives ``arm``/``finish`` as for ``DataParallel``.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..config import Axis, ConfigError
from .stage0 import DataParallel
from ..measure import optimizer_bytes, tensor_bytes
from .optimizer import ELEMENTWISE, check_elementwise
from ..precision import MasterWeights

__all__ = ["ZeroStage1", "check_optimizer", "ELEMENTWISE"]


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that cannot step flat pieces: one that needs whole parameters, or one not known
    to be elementwise (``colab_kit.zero.optimizer.elementwise`` declares a user's class)."""
    check_elementwise(optimizer, "ZeRO steps flat pieces of several parameters")


def build_over(tensors, optimizer_factory) -> torch.optim.Optimizer:
    """``optimizer_factory(tensors)`` (this rank's flat pieces, or their fp32 masters), checked to
    step exactly these tensors, with an elementwise optimizer (``check_optimizer``)."""
    tensors = list(tensors)
    optimizer = optimizer_factory(list(tensors))
    given = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if given != {id(s) for s in tensors}:
        raise ConfigError("with ZeRO, optimizer_factory(params) must build the optimizer over exactly the "
                          "tensors it is given (this rank's flat pieces), e.g. lambda ps: torch.optim.AdamW(ps)")
    check_optimizer(optimizer)
    return optimizer


def sum_slices(pieces, sums: dict, mesh) -> None:
    """The tensor plan's gradient sums over replicated axes, on flat pieces: ``sums`` maps an axis to
    the ``(piece, lo, hi)`` slices that hold marked parameters; one flat all-reduce per axis."""
    for axis, slices in sums.items():
        grads = [pieces[i][lo:hi] for i, lo, hi in slices]
        # on the mesh's device whatever the pieces' (offloaded ones live on the host): one buffer, one all-reduce
        flat = torch.cat([g.to(mesh.device) for g in grads])
        comm.all_reduce(flat, mesh, axis, tag="replicated grads")
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()])
            off += g.numel()


def _padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


class ZeroStage1(DataParallel):
    """``DataParallel`` for ZeRO stage 1 or 2: reduce-scatter instead of all-reduce, pieces for the optimizer.

    The same interface as ``DataParallel`` (``arm``, ``finish``, ``zero``, ``remove``, ``nbytes``),
    so the engine and the pipeline executor drive it alike, plus ``shards`` (this rank's flat
    tensors, for the optimizer), ``build_optimizer``, ``sync_replicated`` (tensor-parallel sums
    on the pieces) and ``gather_params`` (after the step).
    """

    def __init__(self, params, mesh, axis: str = Axis.DP, bucket_bytes: int | None = None, events=None,
                 stage: int = 1, offload: str = "none", placements=None, group_of=None):
        if stage not in (1, 2):
            raise ConfigError(f"ZeroStage1 runs ZeRO stage 1 or 2, got {stage}")
        params = [p for p in params if p.requires_grad]
        super().__init__(params, mesh, axis, bucket_bytes, events, placements, group_of)  # buckets, order, hooks
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ConfigError("ZeRO keeps parameters in one flat buffer: they must share one dtype and device")
        self.stage, self.rank = stage, mesh.rank(axis)
        n, r = self.size, self.rank
        used = [sum(p.numel() for p in b.params) for b in self.buckets]
        self.sizes = [_padded(u, n) for u in used]
        self.padding = sum(s - u for s, u in zip(self.sizes, used))
        offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self._offset = {}  # id(param) -> (bucket index, offset in the flat space)
        dtype, device = self.flat.dtype, self.flat.device
        self.param_flat = torch.zeros(sum(self.sizes), dtype=dtype, device=device)
        with torch.no_grad():
            for b, off in zip(self.buckets, offsets):
                for p in b.params:
                    view = self.param_flat[off:off + p.numel()]
                    view.copy_(p.detach().reshape(-1))
                    p.data = view.view_as(p)
                    self._offset[id(p)] = (b.index, off)
                    off += p.numel()
        self._param_buckets = list(self.param_flat.split(self.sizes))
        self._ranges = [(off + r * s // n, off + (r + 1) * s // n) for off, s in zip(offsets, self.sizes)]
        self.shards = [nn.Parameter(self.param_flat[a:b]) for a, b in self._ranges]
        """This rank's pieces of the parameters, one flat tensor per bucket (views: stepping them updates the model)."""
        self.offload = offload
        mixed = dtype in (torch.bfloat16, torch.float16)
        self.masters = (MasterWeights(self.shards, device="cpu" if offload == "cpu" else None)
                        if mixed or offload == "cpu" else None)
        """Mixed precision: fp32 masters of the pieces, what the optimizer steps (colab_kit.precision).
        ``offload="cpu"`` (ZeRO-Offload): the masters live on the host, fp32 included, so the
        optimizer's states and its update are there too; the parameters stay on the device."""
        # mixed precision: the fp32 reduced pieces of this step
        self._reduced: list[torch.Tensor | None] = [None] * len(self.shards)
        del self.flat  # stage 0's buffer goes before the padded one is made
        self._attach()
        if stage == 1:  # reduced in place: this rank's piece of the full gradient buffer
            self._pieces = [self.flat[a:b] for a, b in self._ranges]
        else:
            self._grad_shard: torch.Tensor | None = torch.zeros(sum(b - a for a, b in self._ranges), dtype=dtype,
                                                                device=device)
            self._pieces = list(self._grad_shard.split([b - a for a, b in self._ranges]))
        if self.masters is None:
            for shard, piece in zip(self.shards, self._pieces):
                shard.grad = piece
        self._sums = self._replicated_slices(params)

    def host_bytes(self, optimizer) -> dict:
        """offload='cpu': the optimizer's states and the masters it steps are on the host."""
        if self.offload != "cpu":
            return {}
        return {"optimizer": optimizer_bytes(optimizer) + self.masters.nbytes}

    def _build_masters(self, params):
        return None  # over this rank's pieces, once they exist (below)

    # ------------------------------------------------------------------ gradient buffer
    def _attach(self) -> None:
        """Make the full (padded) gradient buffer and point every ``param.grad`` into it."""
        self.flat = torch.zeros(sum(self.sizes), dtype=self.param_flat.dtype, device=self.param_flat.device)
        for b, buf in zip(self.buckets, self.flat.split(self.sizes)):
            b.buffer, off = buf, 0
            for p in b.params:
                p.grad = buf[off:off + p.numel()].view_as(p)
                off += p.numel()

    @property
    def nbytes(self) -> int:
        """Gradient bytes held now: the full buffer (stage 1)."""
        return tensor_bytes([self.flat])

    def _launch(self, bucket) -> None:
        i, out, buffer = bucket.index, self._pieces[bucket.index], bucket.buffer
        assert buffer is not None  # stage 1 keeps every bucket's buffer
        if self.masters is not None:  # mixed precision: reduce-scatter an fp32 copy into an fp32 piece
            buffer = bucket.staged = buffer.float()
            out = self._reduced[i] = torch.empty(out.numel(), dtype=torch.float32, device=out.device)
        if self.divisor != 1:
            buffer.div_(self.divisor)
        if self.size == 1:
            comm.reduce_scatter_into(out, buffer, self.mesh, self.axis)  # a copy (stage 2, mixed) or nothing
            return
        start = time.perf_counter() - self.t0

        def record():
            self.events.append({"name": f"reduce_scatter bucket {i}", "kind": "comm", "start": start,
                                "end": time.perf_counter() - self.t0})

        bucket.pending = comm.reduce_scatter_into(out, buffer, self.mesh, self.axis, async_op=True,
                                                  tag=f"grad bucket {i}", then=record)

    def finish(self) -> None:
        """Wait for every reduce-scatter (launching a bucket that got no gradient)."""
        super().finish()  # mixed precision: sets the masters' gradients (_masters_grads)
        if self.masters is None:
            for shard, piece in zip(self.shards, self._pieces):  # again: a user's optimizer.zero_grad() drops them
                shard.grad = piece

    def _masters_grads(self) -> None:
        """Mixed precision: the fp32 reduced pieces become the masters' gradients. Stage 2 keeps its
        reduced piece in 16 bits (2 Psi / N, the paper's; see colab_kit.precision), the master's
        fp32 gradient made from it for this step."""
        for b in self.buckets:
            b.staged = None
        if self.stage == 2:
            for piece, reduced in zip(self._pieces, self._reduced):
                assert reduced is not None  # every bucket was reduced this step
                piece.copy_(reduced)
            self.masters.set_grads(self._pieces)
        else:
            self.masters.set_grads(self._reduced)
        self._reduced = [None] * len(self.shards)

    def zero(self) -> None:
        self.flat.zero_()

    # ------------------------------------------------------------------ optimizer
    def build_optimizer(self, optimizer_factory) -> torch.optim.Optimizer:
        """``optimizer_factory(self.shards)`` (mixed precision: their fp32 masters), checked to step
        exactly these tensors elementwise."""
        return build_over(self.masters.params if self.masters is not None else self.shards, optimizer_factory)

    def optimizer_layout(self) -> list[tuple[torch.Tensor, list[tuple]]]:
        """``(tensor, runs)`` per tensor the optimizer steps (this rank's piece of each bucket, or its
        fp32 master): the parameters' elements inside the piece (``DataParallel.optimizer_layout``);
        a piece's padding is in no run."""
        steps = self.masters.params if self.masters is not None else self.shards
        out = []
        for i, (t, (a, b)) in enumerate(zip(steps, self._ranges)):
            runs = []
            for p in self.buckets[i].params:
                off = self._offset[id(p)][1]
                lo, hi = max(off, a), min(off + p.numel(), b)
                if lo < hi:
                    runs.append((p, lo - off, hi - lo, lo - a))
            out.append((t, runs))
        return out

    def gather_params(self) -> None:
        """All-gather every bucket's updated pieces into the full parameters (in place, buckets in flight together)."""
        pending = [comm.all_gather_into(out, shard.detach(), self.mesh, self.axis, async_op=True,
                                        tag=f"param bucket {i}")
                   for i, (out, shard) in enumerate(zip(self._param_buckets, self.shards))]
        for p in pending:
            p.wait()

    # ------------------------------------------------------------------ tensor parallelism
    def _replicated_slices(self, params) -> dict[str, list[tuple[int, int, int]]]:
        """Per axis, the (piece, lo, hi) slices of this rank's pieces that belong to marked parameters."""
        sums: dict[str, list[tuple[int, int, int]]] = {}
        for p in params:
            axes = [a for a in self.placements.partial(p) if self.mesh.size(a) > 1 and a not in self.folds]
            if not axes:
                continue
            i, start = self._offset[id(p)]
            a, b = self._ranges[i]
            lo, hi = max(start, a), min(start + p.numel(), b)
            for axis in axes:
                if lo < hi:
                    sums.setdefault(axis, []).append((i, lo - a, hi - a))
        if any(self.placements.partial(p) for p in params) and self.mesh.size(Axis.TP) > 1:
            self._check_same_layout(params)
        return sums

    def _check_same_layout(self, params) -> None:
        """Every rank of the tensor group must cut its flat space alike (a tiny all-reduce, once)."""
        sig = torch.tensor([len(params), sum(self.sizes), sum((j + 1) * p.numel() for j, p in enumerate(params))],
                           dtype=torch.int64, device=self.param_flat.device)
        both = torch.cat([sig, -sig])
        comm.all_reduce(both, self.mesh, Axis.TP, op=dist.ReduceOp.MAX, tag="zero layout check")
        if not torch.equal(both[:3], -both[3:]):
            raise ConfigError("ZeRO with tensor parallelism needs the same parameter shapes on every tp rank; "
                              "this tensor plan gives different ones: use zero=0 with it")

    def sync_replicated(self) -> None:
        """The tensor plan's gradient sums (``tensor.sync_grads``), on this rank's reduced pieces
        (mixed precision: on the masters' fp32 gradients)."""
        sum_slices(self.masters.grads if self.masters is not None else self._pieces, self._sums, self.mesh)

