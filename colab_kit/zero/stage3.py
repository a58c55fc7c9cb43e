"""ZeRO stage 3 (P_os+g+p): parameters, gradients and optimizer states all sharded over dp (dp x sp under
sequence parallelism, ``stage0.reduction_axis``: read dp as dp x sp below).

Each rank keeps 1/dp of every parameter (``chunks.Chunk``): one chunk per unit (``colab_kit.zero.units``):
the embeddings, each transformer block, the tail (final norm and head). A unit's parameters are gathered
just before it runs and freed after; the forward of unit i prefetches unit i+1 (its all-gather runs while
unit i computes), the backward of block i prefetches the unit before it. Once every gradient of a chunk has
arrived in backward, it is reduce-scattered (async, overlapping the backward of the units before it) and
its parameters are freed again. The optimizer steps this rank's shards; nothing is gathered after the step:
the next forward gathers what it uses. A model built on the meta device is made piece by piece: each chunk
writes only this rank's piece of each parameter from its recipe (``colab_kit.sharded_init``), so no rank
ever holds the whole model, at start-up either (``colab_kit.memory.startup_bytes``).

What one rank of dp=2 sees in a step of a GPT with blocks b0, b1 (E = embeddings, T = tail: ln_f and
head), one microbatch::

    forward   gather E, prefetch b0 | embeddings run | b0's pre-hook: free E | b0 runs, prefetch b1 |
              free b0 | b1 runs, prefetch T | free b1 | T runs (kept whole into its backward)
    backward  T's grads (autograd's own tensors) complete: reduce-scatter T, free T |
              b1's output gradient: gather b1, prefetch b0 | b1 backward | b1 grads complete:
              reduce-scatter b1 (async), free b1 | b0: likewise, prefetch E |
              b0's input gradient: gather E | embeddings' grads complete: reduce-scatter E, free E
    step      optimizer over this rank's shards (one flat piece per chunk)

Per step and microbatch: an all-gather per block and for E in forward and another in backward, one for T,
and one reduce-scatter per chunk: the paper's 1.5x the traffic of data parallelism (an all-reduce moves two
chunk sizes per rank, stage 3 three; T is gathered once, as FSDP2 keeps the last unit for its backward).
With ``microbatches > 1`` every microbatch reduce-scatters its gradients into the shards (accumulated
there, fp32), so no rank ever holds a whole model's gradient; a chunk whose parameters got no gradient in a
microbatch is reduced at ``finish()`` (with zeros for what got none), on every rank alike.

Between steps a rank holds 4P/N parameter bytes, 4P/N gradient bytes and K P/N optimizer
bytes (fp32, P parameters on this rank before ZeRO, N = dp x sp): the ZeRO paper's 16P/N with Adam.
Inside a step, beyond that, at most: E or T and a block whole, or two blocks (one used, one prefetched:
``colab_kit.memory.gathered_bytes``, equal to the measured ``peak_gathered``), one block's gradient buffer,
one block's reduce-scatter in flight (the previous block's buffer; it is waited for before the next one
starts, which costs no overlap: one process group runs its collectives in order anyway) and autograd's
gradients of T. E's buffer is made only when its last gradient (at the very end of backward) has arrived.
A 128k vocabulary at d 8192 would otherwise keep 2B parameters whole through the step (both tables); here
the token table is whole only around the embeddings' forward and backward, the head around the tail's.
A head tied to the token table lives in E's chunk, which T then needs too: gathered for T's forward and
backward, freed in between. (tests/ranks/test_zero3.py and test_zero3_meta.py check the bounds; bench/zero.py
measures the in-step peak at 0.94-0.96 of FSDP2's on a GPT d=128 x 4, where FSDP2 gathers its root whole.)

Mixed precision: a block's gradient is reduced as an fp32 copy; the reduced piece is copied
straight into the (zeroed) 16-bit ``shard.grad`` on the step's first reduction (rounded first
and added only for later microbatches), with no 16-bit temporary. At the step each chunk's fp32
master gradient is made from its 16-bit piece and the piece's storage is released at once (its
values live on, widened, in the fp32 gradient); ``zero()`` gives it back, zeroed. So the step
holds 4P/N of gradients (FSDP2's fp32 sharded gradients), not 6P/N, and between steps the
paper's 2P/N is there again. The values are those of the 16-bit pieces: parity is unchanged.

Expert parallelism (``ep > 1``): the ranks of a dp group hold different experts, so a block's expert tensors
(``Shard(0)`` on ep) cannot share its dense chunk. Each unit (the rest, a block) is one chunk, or two when it
has expert tensors: its dense parameters over dp and its experts over edp, whose summed gradient is divided by
dp as ``ExpertSplit`` does (``colab_kit.zero.split.chunk_units``). The unit's hooks gather (and prefetch) and
free both; each chunk is reduce-scattered when its own gradients are complete, a unit's two at once.
Worked example, ``ParallelConfig(dp=4, ep=2, zero=3)``, a GPT of 2 blocks with 4 experts each, rank 2
(dp 2, edp 1, ep 0: ``colab_kit.mesh``)::

    chunk                 its parameters                    over (group of rank 2)   rank 2 keeps
    0 rest                embeddings, ln_f, head            dp  [0 1 2 3]            piece 2 of 4
    1 blocks.0            attention, LNs, router, shared    dp  [0 1 2 3]            piece 2 of 4
    2 blocks.0.experts    experts 0, 1 (w_in, b_in, ...)    edp [0 2]                piece 1 of 2
    3, 4                  the same for blocks.1
    block 0 runs          gather 1 and 2 -> the block whole with experts 0, 1 (on ranks 1, 3: experts 2, 3)
    its backward          grads of 1 reduce-scattered over dp / 4; of 2 over edp [0 2] / 4

Clipping counts each element once (a piece is held by one rank), checkpoints map the expert pieces through
their ``Shard(0)`` placement (``colab_kit.checkpoint.layout``), offload places each chunk on its own.

Hooks: a forward pre-hook and a forward hook on each block (the policy's ``blocks``) and on the
model, a tensor hook on each block's output (its backward is next), and a post-accumulate-grad
hook on every parameter. A model without a policy is one chunk, gathered for the whole step.
With recompute (``colab_kit.recompute``) a block's own hooks fire once, around the forward;
its recomputation in backward runs after the output hook gathered it. Pipeline parallelism is
refused with zero=3 (see ``engine.unsupported``).
"""
from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn as nn

from ..config import Axis, ConfigError
from ..precision import MasterWeights
from .stage0 import folded_axes
from .stage1 import build_over, sum_slices
from .chunks import Chunk
from .split import chunk_units
from ..placement import PlacementTable
from .offload import ChunkPlacement
from .units import units_of, tied_to_embed
from .. import sharded_init

__all__ = ["ZeroStage3", "units_of"]  # units_of: colab_kit.zero.units


def _call(ref, method, *args):
    owner = ref()
    if owner is not None:
        return getattr(owner, method)(*args)


class ZeroStage3:
    """ZeRO stage 3 over ``axis`` for ``module``: the interface of ``ZeroStage1`` (``arm``,
    ``finish``, ``zero``, ``remove``, ``nbytes``, ``build_optimizer``, ``sync_replicated``,
    ``gather_params``), plus ``param_bytes()``, ``gathered()`` and ``live`` (the storages of the
    chunks whole right now, which the activation meter does not count)."""

    def __init__(self, module: nn.Module, mesh, axis: str = Axis.DP, events=None, prefetch: bool = True,
                 offload: str = "none", device_budget: int | None = None, blocks: nn.ModuleList | None = None,
                 placements=None, group_of=None, experts: bool = False, tail=()):
        self.module, self.mesh, self.axis = module, mesh, axis
        self.folds = folded_axes(axis, mesh)
        """Axes whose gradient sums the chunks' reduce-scatter already makes (sp over ``dp_sp``)."""
        self.placements = placements if placements is not None else PlacementTable(module)
        self.events = events if events is not None else []
        self.prefetch = prefetch
        _placeholders(module, mesh.device, self.placements)  # a meta model: each chunk makes only its piece
        tail = list(tail)
        units = units_of(module, blocks, tail)
        if group_of is not None:  # the user's param groups: each chunk ordered by group (colab_kit.zero.optimizer)
            for unit in units:
                unit.params = sorted(unit.params, key=group_of)
        if len({(p.dtype, p.device) for unit in units for p in unit.params}) > 1:
            raise ConfigError("ZeRO keeps parameters in flat chunks: they must share one dtype and device")
        self.chunks, self.units = chunk_units([(u.name, u.block, u.params) for u in units], mesh, axis,
                                              self.placements, experts)
        """``chunks``: every chunk in forward order; ``units[u]``: the indices of unit u's own chunks (the
        embeddings are unit 0, block i unit i + 1, the tail the last: ``colab_kit.zero.units``): one chunk, or with
        ``experts`` a block's dense chunk over ``axis`` and its expert chunk over edp (``chunk_units``)."""
        self.kinds = [u.kind for u in units]
        self.needs = [list(idx) for idx in self.units]
        """Per unit, the chunks gathered to run it: its own, and for a tail tied to the embeddings theirs too."""
        if self.kinds[-1] == "tail" and tied_to_embed(units, tail):
            self.needs[-1] += [i for i in self.units[0] if i not in self.needs[-1]]
        self.unit_of = [u for u, idx in enumerate(self.units) for _ in idx]
        self.placement = None
        """With ``offload`` 'cpu' or 'auto': where each chunk's states live, and the device account."""
        if offload != "none":
            outer = [n for n, k in zip(self.needs, self.kinds) if k != "block"]
            blocks_ = [n for n, k in zip(self.units, self.kinds) if k == "block"]
            self.placement = ChunkPlacement(self.chunks, offload, mesh.device, device_budget, blocks_, outer)
        self.shards = [c.shard for c in self.chunks]
        """This rank's pieces, one flat tensor per chunk: what the optimizer steps (in fp32)."""
        mixed = self.chunks[0].full.dtype in (torch.bfloat16, torch.float16)
        self.masters = MasterWeights(self.shards, device="cpu" if offload != "none" else None) if mixed else None
        """Mixed precision: fp32 masters of the 16-bit shards, what the optimizer steps
        (``colab_kit.precision``)."""
        if self.placement is not None:
            self.placement.keys = self.masters.params if self.masters is not None else self.shards
        self.live: set[int] = set()
        self._inflight: list[Chunk] = []  # chunks whose reduce-scatter may still run
        self.peak_gathered = 0
        """Most bytes of whole chunks at once during the last step (its peak of gathered parameters)."""
        self._peak = 0
        self.t0 = time.perf_counter()
        ref = weakref.ref(self)
        self._hooks = [module.register_forward_pre_hook(partial(_call, ref, "_pre_forward", 0)),
                       module.register_forward_hook(partial(_call, ref, "_post_forward", 0))]
        for u, unit in enumerate(units):
            if unit.block is not None:
                self._hooks += [unit.block.register_forward_pre_hook(partial(_call, ref, "_block_starts", u),
                                                                     with_kwargs=True),
                                unit.block.register_forward_hook(partial(_call, ref, "_post_forward", u))]
            if unit.kind == "tail":
                self._hooks += [m.register_forward_pre_hook(partial(_call, ref, "_pre_forward", u)) for m in tail]
        for c in self.chunks:
            for p in c.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(partial(_call, ref, "_on_grad", c.index)))
        self._sums = self._replicated_slices()

    # ------------------------------------------------------------------ gather / free
    def _gather(self, i: int, async_op: bool = False) -> None:
        c, place = self.chunks[i], self.placement
        if c.state == "free":
            if place is not None:
                place.hold(f"gathered {c.name}", c.nbytes)
            c.gather(async_op=True, source=place.staged(i) if place is not None else None)
            self.live.add(c.storage_ptr())
            whole = sum(k.nbytes for k in self.chunks if k.state != "free")
            self._peak = max(self._peak, whole)
        if not async_op:
            c.wait()
            if place is not None:
                place.unstage(i)

    def _free(self, i: int) -> None:
        c = self.chunks[i]
        self.live.discard(c.storage_ptr())
        c.free()
        if self.placement is not None:
            self.placement.unstage(i)
            self.placement.release(f"gathered {c.name}")

    def _prepare_grads(self, i: int) -> None:
        c = self.chunks[i]
        if self.placement is not None and c.grad_full is None:  # its buffer, and the fp32 copy it is reduced in
            wide = 0 if c.full.dtype == torch.float32 else 4 * c.size
            self.placement.hold(f"gradient of {c.name}", c.nbytes + wide)
        c.prepare_grads()

    def _pre_forward(self, u: int, _module, _args) -> None:
        """Unit u (0: the model, i + 1: block i, the last: the tail) is about to run: gather what it needs,
        prefetch the next unit's."""
        nxt = u + 1
        if self.kinds[u] == "block" and self.kinds[u - 1] == "embed":  # the embeddings ran: free them
            for i in self.needs[u - 1]:
                self._free(i)
        for i in self.needs[u]:
            self._gather(i, async_op=True)
        for i in self.needs[u]:
            self._gather(i)
        if self.prefetch and nxt < len(self.units):
            for i in self.needs[nxt]:
                self._gather(i, async_op=True)
            if self.placement is not None and nxt + 1 < len(self.units):  # its shard's copy runs beside u
                for i in self.needs[nxt + 1]:
                    self.placement.stage_ahead(i)

    def _block_starts(self, u: int, module, args, kwargs) -> None:
        """Block ``u - 1``'s forward pre-hook: ``_pre_forward``; on the first block in training, a hook on its
        input hidden states, whose gradient arrives just before the embeddings' backward (gather them then)."""
        self._pre_forward(u, module, args)
        if self.kinds[u - 1] == "embed" and torch.is_grad_enabled():
            for t in (*args, kwargs.get("hidden_states"), *kwargs.values()):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(partial(_call, weakref.ref(self), "_pre_backward", u - 1))
                    break

    def _post_forward(self, u: int, _module, _args, out) -> None:
        training = torch.is_grad_enabled()
        if u == 0:  # the model's own hook: the embeddings and the tail (or, without blocks, everything)
            for unit, kind in enumerate(self.kinds):
                if kind == "block":
                    continue
                for i in self.units[unit]:
                    if training and self.placement is not None:  # autograd's gradients, at most the chunk
                        self.placement.hold(f"gradient of {self.chunks[i].name}", self.chunks[i].nbytes)
                    if not training:
                        self._free(i)
            if not training and self.placement is not None:  # no backward follows: nothing kept in flight
                self.placement.drain()
            return
        for i in self.units[u]:
            self._free(i)
        if training:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(partial(_call, weakref.ref(self), "_pre_backward", u))
                    break

    def _pre_backward(self, u: int, _grad) -> None:
        """Unit u's backward is next (its output's gradient has arrived): after the last block's, the tail's
        backward is over (free what it needed); gather u, prefetch the unit before it."""
        if u + 1 < len(self.kinds) and self.kinds[u + 1] == "tail":
            for i in self.needs[u + 1]:
                if self.chunks[i].state != "free":
                    self._free(i)
        for i in self.needs[u]:
            self._gather(i, async_op=True)
        for i in self.needs[u]:
            self._gather(i)
            if self.kinds[u] == "block":
                self._prepare_grads(i)
        if self.prefetch and u >= 1 and self.kinds[u - 1] in ("block", "embed"):
            for i in self.needs[u - 1]:
                self._gather(i, async_op=True)
            if self.placement is not None and u >= 2 and self.kinds[u - 2] in ("block", "embed"):
                for i in self.needs[u - 2]:
                    self.placement.stage_ahead(i)

    def _on_grad(self, i: int, _param) -> None:
        c = self.chunks[i]
        c.ready += 1
        if c.ready == len(c.params):
            self._reduce(c)

    def _reduce(self, c: Chunk) -> None:
        keep = [k for k in self._inflight if k is not c and self.unit_of[k.index] == self.unit_of[c.index]]
        for k in self._inflight:  # one unit's reduce-scatters in flight: the previous unit's buffers go first
            if not any(k is j for j in keep):
                self._settle(k)
        self._inflight = keep
        if c.grad_full is None and self.placement is not None:  # R: its flat buffer beside autograd's tensors
            wide = 0 if c.full.dtype == torch.float32 else 4 * c.size
            self.placement.hold(f"gradient of {c.name}", 2 * c.nbytes + wide)
        start = time.perf_counter() - self.t0
        c.reduce_grads()
        if self.placement is not None:
            wide = 0 if c.full.dtype == torch.float32 else 4 * c.size
            self.placement.hold(f"gradient of {c.name}", c.nbytes + wide)
        self._free(c.index)
        self.events.append({"name": f"reduce_scatter {c.name}", "kind": "comm", "start": start,
                            "end": time.perf_counter() - self.t0})
        self._inflight.append(c)

    def _settle(self, c: Chunk) -> None:
        """Wait for ``c``'s reduce-scatter, add its piece into the shard's gradient, drop its buffer."""
        if self.placement is not None and c.reducing and self.placement.where[c.index] == "host":
            self.placement.transfers["to_host"] += 4 * c.piece  # the reduced fp32 piece, added on the host
        place = self.placement
        c.finish_reduce(place.copies if place is not None and place.where[c.index] == "host" else None)
        if self.placement is not None:
            self.placement.release(f"gradient of {c.name}")

    # ------------------------------------------------------------------ the engine's interface
    def arm(self, sync: bool, t0: float | None = None) -> None:
        """Before each microbatch's backward: count gradients afresh (every microbatch reduces)."""
        if t0 is not None:
            self.t0 = t0
        for c in self.chunks:
            c.ready = 0

    def finish(self) -> None:
        """Reduce what backward did not complete (parameters without a gradient), wait for every
        reduce-scatter, free every chunk."""
        for c in self.chunks:
            if c.has_grads() or (c.ready and c.ready < len(c.params)):
                self._reduce(c)
        for c in self._inflight + self.chunks:
            self._settle(c)
            self._free(c.index)
        self._inflight = []
        if self.placement is not None:  # every gradient piece landed on the host, no shard copy in flight
            self.placement.drain()
        if self.masters is not None:  # the step's fp32 gradients, made from the 16-bit reduced pieces,
            for master, c in zip(self.masters.params, self.chunks, strict=True):  # each piece released once
                grad = c.shard_grad()
                master.grad = grad.to(device=master.device, dtype=torch.float32).view_as(master)
                storage = grad.untyped_storage()
                if storage.resizable():  # widened (its values are the fp32 ones); back at zero()
                    storage.resize_(0)

    def master_bytes(self) -> int:
        return self.masters.nbytes if self.masters is not None else 0

    def ready(self, param: torch.Tensor) -> None:
        """Only a pipeline's zero-bubble W tells a gradient part a gradient is ready, and ZeRO-3 runs without
        a pipeline (``boost`` refuses the pair): nothing calls it."""
        raise RuntimeError("ZeRO-3 runs without a pipeline: no W action tells it a gradient is ready")

    def zero(self) -> None:
        for c in self.chunks:
            g = c.shard_grad()
            if g.untyped_storage().nbytes() < g.numel() * g.element_size():  # released at finish()
                g.untyped_storage().resize_(g.numel() * g.element_size())
            g.zero_()
            c.fresh = True
        self.peak_gathered, self._peak = self._peak, 0  # after the step: its peak is known

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def gather_params(self) -> None:
        """Nothing: stage 3 gathers a chunk when the model next uses it."""

    @contextmanager
    def gathered(self):
        """Every parameter whole inside the block (to read or save the model), freed after::

            with engine.data_parallel.gathered():
                state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        """
        for c in self.chunks:
            self._gather(c.index)
        try:
            yield
        finally:
            for c in self.chunks:
                self._free(c.index)

    @property
    def nbytes(self) -> int:
        return sum(c.grad_bytes() for c in self.chunks)

    def param_bytes(self) -> int:
        """This rank's shards plus the chunks whole right now."""
        return sum(c.shard.numel() * c.shard.element_size() + (c.nbytes if c.state != "free" else 0)
                   for c in self.chunks)

    def build_optimizer(self, optimizer_factory) -> torch.optim.Optimizer:
        """``optimizer_factory(self.shards)``, checked to step exactly these tensors, elementwise."""
        optimizer = build_over(self.masters.params if self.masters is not None else self.shards, optimizer_factory)
        self.set_optimizer(optimizer)
        return optimizer

    def set_optimizer(self, optimizer, keys=None) -> None:
        """The optimizer whose states the placement moves with each chunk; ``keys[i]``: the tensors it steps
        for chunk i (its piece, or one view per param group the piece spans: ``colab_kit.zero.optimizer``)."""
        if self.placement is not None:
            self.placement.optimizer, self.placement.state_keys = optimizer, keys

    def optimizer_layout(self) -> list[tuple[torch.Tensor, list[tuple]]]:
        """``(tensor, runs)`` per tensor the optimizer steps (this rank's piece of each chunk, or its
        fp32 master), as ``DataParallel.optimizer_layout``; a piece's padding is in no run."""
        steps = self.masters.params if self.masters is not None else self.shards
        out: list[tuple[torch.Tensor, list[tuple]]] = []
        for t, c in zip(steps, self.chunks):
            a, b, runs = c.rank * c.piece, (c.rank + 1) * c.piece, []
            for p in c.params:
                off = c.offsets[id(p)]
                lo, hi = max(off, a), min(off + p.numel(), b)
                if lo < hi:
                    runs.append((p, lo - off, hi - lo, lo - a))
            out.append((t, runs))
        return out

    def host_share(self) -> float:
        """The share of this rank's chunk elements whose states the placement put on the host."""
        if self.placement is None:
            return 0.0
        total = sum(c.piece for c in self.chunks)
        return sum(c.piece for c, w in zip(self.chunks, self.placement.where) if w == "host") / max(total, 1)

    def host_bytes(self, optimizer) -> dict:
        """Bytes by category on the host side (chunks the placement put there)."""
        return self.placement.host_bytes(optimizer) if self.placement is not None else {}

    # ------------------------------------------------------------------ tensor parallelism
    def _replicated_slices(self) -> dict[str, list[tuple[int, int, int]]]:
        """Per axis, the (chunk, lo, hi) slices of this rank's pieces that hold marked parameters."""
        sums: dict[str, list[tuple[int, int, int]]] = {}
        for c in self.chunks:
            a, b = c.rank * c.piece, (c.rank + 1) * c.piece
            for p in c.params:
                start = c.offsets[id(p)]
                lo, hi = max(start, a), min(start + p.numel(), b)
                for axis in self.placements.partial(p):
                    if self.mesh.size(axis) > 1 and axis not in self.folds and lo < hi:
                        sums.setdefault(axis, []).append((c.index, lo - a, hi - a))
        return sums

    def sync_replicated(self) -> None:
        """The tensor plan's gradient sums over replicated axes, on this rank's reduced pieces."""
        pieces = self.masters.grads if self.masters is not None else [c.shard.grad for c in self.chunks]
        sum_slices(pieces, self._sums, self.mesh)



def _placeholders(module: nn.Module, device, table: PlacementTable) -> None:
    """Each trainable parameter still meta (a model built on meta: ``parallelize`` left it so) becomes a
    placeholder on ``device`` (``sharded_init.placeholder``: no bytes, its recipe), in every module that
    holds it and in ``table``; its chunk then writes only this rank's piece of it (``Chunk``)."""
    made: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is None or not p.is_meta or not p.requires_grad or not sharded_init.has_recipe(p):
                continue
            if id(p) not in made:
                made[id(p)] = sharded_init.placeholder(p, device)
                table.replace(p, made[id(p)])
            mod._parameters[name] = made[id(p)]
