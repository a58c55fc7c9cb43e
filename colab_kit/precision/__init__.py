"""Mixed precision: a 16-bit model, fp32 master weights, fp32 reductions, fp16 loss scaling.

``ParallelConfig(precision="bf16")`` (or ``"fp16"``) runs the recipe of Colossal-AI's
mixed-precision optimizer and of FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` (Micikevicius et al. 2018, arXiv 1710.03740):

1. the model's parameters, hence forward and backward, are in the 16-bit dtype
   (``to_compute_dtype``); the loss is taken on fp32 logits (``loss_in_fp32``);
2. gradients accumulate in 16 bits, in the gradient buckets (over microbatches too);
3. the dp reduction runs in fp32: each bucket is copied to fp32 and all-reduced (zero=0) or
   reduce-scattered (ZeRO 1/2) in fp32; the reduced fp32 gradient is the ``.grad`` of the
   fp32 master weights (``MasterWeights``), which the optimizer steps; it lives from the
   reduction to the end of the step, never between steps;
4. after the step the masters are copied into the 16-bit parameters (with ZeRO, this rank's
   piece, then the 16-bit parameters are all-gathered);
5. fp16 only: ``LossScaler`` multiplies the loss before backward; after the reduction the
   fp32 gradients are unscaled and checked for inf/nan, one all-reduce MAX over the whole
   world so that every rank decides alike; an overflow skips the step and halves the scale.

ZeRO stage 2 keeps this rank's reduced piece in 16 bits (the paper's 2 Psi / N, as
DeepSpeed's ``communication_data_type=fp32``: reduce in fp32, copy back into the 16-bit
partition); the sum still runs in fp32, and the master's fp32 gradient is made from the
piece at the step. An fp32 piece held between steps would be 4 Psi / N.

What each rank holds, dp=2, zero=1, bf16, AdamW, P parameters (flat space padded to 2)::

    rank r   params     the whole model in bf16 (2P bytes: ``param_flat``)
             grads      bf16 accumulation buffer, whole (2P)
             optimizer  fp32 master of piece r (4P/2) + Adam m, v of piece r (8P/2): 12P/2
    step     bucket (bf16) -> fp32 copy / 2 -> reduce-scatter -> fp32 piece r = master.grad
             AdamW on the master piece -> copied into bf16 piece r -> all-gather bf16 params

Parity. Against one process running the same recipe (``reference.train_single_process(...,
precision=...)``, the same code) the losses agree within ``TOLERANCE`` (relative), not 1e-5:
the parallel run adds the 16-bit partial gradients of each dp rank (and microbatch, in 16
bits) in fp32 in another order than one process's single matmul, and rounds them once more;
each gradient element then differs by about the unit roundoff u (bf16 2^-9 = 2.0e-3, fp16
2^-12 = 2.4e-4), and the 16-bit weights by an ulp here and there. The loss is a mean over
B*T token losses (128 in the tests), whose differences of either sign shrink to about
u / sqrt(128) = u / 11. TOLERANCE is u / 8: 2^-12 = 2.4e-4 for bf16, 2^-15 = 3.1e-5 for fp16.
Measured (tests/ranks/test_precision.py's configs: GPT d=32, 2 layers, batch 8 x 16, 5 steps, AdamW
and SGD+momentum; max over ranks and steps; measured once by hand, ``pytest tests/ranks/test_precision.py -s``
prints today's, and the test holds each to TOLERANCE):

    bf16  dp=2 zero 0 / 1      5.1e-5 (AdamW)  1.6e-5 (SGD)
          dp=2 zero 2          5.9e-5          1.5e-5
          dp=2 microbatches 2  5.9e-5          1.7e-5
          dp=2 tp=2 zero 2     3.9e-5          3.3e-5
          tp=4 2d              3.7e-5          5.2e-5      -> max 5.9e-5, 1/4 of the tolerance
    fp16  dp=2 zero 2          4.1e-6          2.7e-6
          dp=2 pp=2 zero 1     3.0e-6          3.7e-6      -> max 4.1e-6, 1/7 of the tolerance

The losses alone do not tell the recipe from fp32 training (the one-process bf16 recipe is
1.6e-4 from fp32's, inside the bf16 tolerance): the tests check the 16-bit dtypes besides.

API (shared by ``DataParallel``, ``ZeroStage1``, the one-process reference and ZeRO-3)::

    compute_dtype(precision) -> torch.dtype            # "fp32" / "bf16" / "fp16"
    to_compute_dtype(module, precision) -> module       # floating params and buffers, in place
    loss_in_fp32(loss_fn) -> loss_fn                    # casts 16-bit logits to fp32 first
    MasterWeights(tensors, device=None)                 # fp32 copies of 16-bit tensors (params or flat pieces)
        .params  .model  .grads  .set_grads(grads)  .drop_grads()  .copy_to_model()  .nbytes
    LossScaler(init_scale=2.**16, growth_factor=2., backoff_factor=.5, growth_interval=2000)
        .scale  .scale_loss(loss)  .unscale_and_check(grads, mesh=None) -> bool  .update(overflow) -> str
    master_step(optimizer, masters, scaler=None, mesh=None) -> {"skipped", "loss_scale", "note"}

A data-parallel part of the engine (``DataParallel``, ``ZeroStage1``, ZeRO-3's) that runs the recipe
has ``masters`` (a ``MasterWeights``, None in fp32), builds the optimizer over
``masters.params``, and leaves the masters' fp32 gradients set after ``finish()`` (with a tensor
plan, ``sync_replicated()`` then sums them over the replicated axes, in fp32); the engine
then calls ``master_step`` and ``engine.records`` gets its result. The scaler in one process::

    >>> scaler = LossScaler()                  # fp16: 2^16 at first, as torch.amp.GradScaler
    >>> scaler.update(overflow=True)
    'fp16 gradients overflowed (inf/nan): step skipped, loss scale 65536 -> 32768'
    >>> scaler.scale, scaler.update(overflow=False)
    (32768.0, '')
"""
from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import finish
from ..placement import PlacementTable

__all__ = ["COMPUTE_DTYPES", "TOLERANCE", "tolerance", "compute_dtype", "to_compute_dtype", "loss_in_fp32",
           "MasterWeights", "LossScaler", "master_step", "pinned_copy"]

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-5, "bf16": 2.0 ** -12, "fp16": 2.0 ** -15}
"""Relative loss tolerance against the one-process recipe (see the module docstring): a loss over 128 terms."""
UNIT_ROUNDOFF = {"bf16": 2.0 ** -9, "fp16": 2.0 ** -12}


def tolerance(precision: str, terms: int) -> float:
    """The relative loss tolerance for a loss that is a mean of ``terms`` terms (tokens, or images):
    ``sqrt(2) u / sqrt(terms)``, which is ``TOLERANCE`` at 128 terms; ViT's 8 images in bf16: 9.8e-4.

    >>> tolerance("bf16", 128) == TOLERANCE["bf16"]
    True
    """
    if precision == "fp32":
        return TOLERANCE["fp32"]
    return 2 ** 0.5 * UNIT_ROUNDOFF[precision] / terms ** 0.5


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"unknown precision {precision!r}: choose one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[precision]


def to_compute_dtype(module: nn.Module, precision: str) -> nn.Module:
    """Put ``module``'s floating parameters and buffers in the compute dtype, in place (the same
    Parameter objects, so attributes such as the tensor plan's marks stay)."""
    return module.to(compute_dtype(precision))


def loss_in_fp32(loss_fn):
    """``loss_fn`` on fp32 copies of its floating arguments: the softmax and the loss in fp32."""
    @functools.wraps(loss_fn, assigned=(), updated=())  # sets __wrapped__ only, as before
    def loss(logits, targets, *args, **kwargs):
        if logits.is_floating_point() and logits.dtype != torch.float32:
            logits = logits.float()
        return loss_fn(logits, targets, *args, **kwargs)
    return loss


def pinned_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` (in ``dtype``; by default its own) in pinned host memory, so that copies between it and a GPU run
    at the link's speed without the host waiting. Pinned by the allocator (``torch.empty(pin_memory=True)``),
    not by ``Tensor.pin_memory()``, whose storage cannot be resized: ZeRO-3 frees a widened 16-bit shard
    gradient with ``resize_(0)`` (stage 3's ``finish``)."""
    out = torch.empty(t.shape, dtype=dtype or t.dtype, pin_memory=True)
    out.copy_(t.detach())
    return out


class MasterWeights:
    """fp32 copies (``params``, what the optimizer steps) of 16-bit tensors (``model``).

    ``device``: where the copies live (default: the tensors' own); ``offload="cpu"`` puts them,
    hence the optimizer's states and its update, on the host (``colab_kit.zero``).

    ``tensors``: the model's parameters (zero=0, one process) or this rank's flat pieces
    (ZeRO). ``table``: the engine's ``PlacementTable``; ``self.table`` then places each master as its
    parameter (what the tensor plan's gradient sums read).
    """

    def __init__(self, tensors, device=None, table=None):
        self.model = list(tensors)
        self.pinned = device is not None and torch.device(device).type == "cpu" and any(
            t.is_cuda for t in self.model)
        """Host masters of GPU tensors (ZeRO-Offload): in pinned memory, so that each step's copies between
        them and the GPU (gradients down, updated values up) run at the link's speed, not through a bounce
        buffer of pageable memory. The copies stay blocking: the host steps the masters right after."""
        self.params = [nn.Parameter(pinned_copy(t, torch.float32) if self.pinned else
                                    t.detach().to(device=device, dtype=torch.float32, copy=True)) for t in self.model]
        self.table = PlacementTable()
        if table is not None:
            for m, t in zip(self.params, self.model):
                self.table.alias(m, t, table)

    @property
    def grads(self) -> list:
        return [m.grad for m in self.params]

    def set_grads(self, grads) -> None:
        """The masters' gradients (converted to fp32 where they are not), one per master."""
        for m, g in zip(self.params, grads, strict=True):
            m.grad = (pinned_copy(g, torch.float32) if self.pinned and g.is_cuda else
                      g.to(device=m.device, dtype=torch.float32)).view_as(m)

    def drop_grads(self) -> None:
        for m in self.params:
            m.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for m, t in zip(self.params, self.model):
            t.copy_(m.view_as(t))

    @property
    def nbytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.params)


class LossScaler:
    """fp16's dynamic loss scale, with ``torch.amp.GradScaler``'s defaults: start at 2^16, halve
    on an overflow (the step is skipped), double after ``growth_interval`` = 2000 good steps."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale, self.growth_factor, self.backoff_factor = float(init_scale), growth_factor, backoff_factor
        self.growth_interval, self.good_steps = growth_interval, 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, grads, mesh=None) -> bool:
        """Divide the fp32 ``grads`` by the scale in place; True if any is inf/nan on any rank
        (one all-reduce MAX over the world when ``mesh`` is given, so every rank decides alike)."""
        bad = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else None)
        inv = 1.0 / self.scale
        for g in grads:
            if g is not None:
                g.mul_(inv)
                bad = torch.maximum(bad, (~torch.isfinite(g)).any().float().to(bad.device))
        if mesh is not None:  # the flag travels on the mesh's device: with offload the masters (and the flag
            bad = bad.to(mesh.device)  # made beside them) live on the host, and NCCL takes only device tensors
        if mesh is not None and dist.is_initialized() and dist.get_world_size() > 1:
            t0 = time.perf_counter()
            work = dist.all_reduce(bad, op=dist.ReduceOp.MAX, async_op=True)
            finish(work, mesh.abort_flag, "the fp16 overflow check over the world")
            now = time.perf_counter()
            mesh.log.add("all_reduce", "world", bad.numel() * bad.element_size(), now - t0,
                         "fp16 overflow check", dist.get_world_size(), end=now)
        return bool(bad.item())

    def update(self, overflow: bool) -> str:
        """Adjust the scale after a step; returns what changed ("" if nothing)."""
        old = self.scale
        if overflow:
            self.scale, self.good_steps = old * self.backoff_factor, 0
            return f"fp16 gradients overflowed (inf/nan): step skipped, loss scale {old:g} -> {self.scale:g}"
        self.good_steps += 1
        if self.good_steps < self.growth_interval:
            return ""
        self.scale, self.good_steps = old * self.growth_factor, 0
        return f"loss scale {old:g} -> {self.scale:g} after {self.growth_interval} steps without overflow"

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def master_step(optimizer, masters: MasterWeights, scaler: LossScaler | None = None, mesh=None,
                before_step=None) -> dict:
    """Step the fp32 masters (their ``.grad`` set), copy them into the 16-bit tensors, drop the grads.

    With a ``scaler`` the gradients are unscaled and checked first; an overflow on any rank
    skips the step on every rank (masters and model unchanged) and backs the scale off.
    ``before_step()``: runs on the unscaled gradients of a step that is not skipped (gradient clipping);
    what it returns is ``"grad_norm"``. Returns ``{"skipped": bool, "loss_scale": scale used or None,
    "note": str}`` (and ``"grad_norm"``).
    """
    used = None if scaler is None else scaler.scale
    overflow = scaler is not None and scaler.unscale_and_check(masters.grads, mesh)
    norm = None
    if not overflow:
        if before_step is not None:
            norm = before_step()
        optimizer.step()
        masters.copy_to_model()
    masters.drop_grads()
    note = scaler.update(overflow) if scaler is not None else ""
    out = {"skipped": overflow, "loss_scale": used, "note": note}
    if before_step is not None:
        out["grad_norm"] = norm
    return out
