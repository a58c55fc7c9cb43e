"""The training recipe of the paper's experiments, as plain torch objects ``boost`` takes.

AdamW with weight decay on the matrices and none on biases and norms (``decay_groups``), a linear
warmup then a cosine decay of the learning rate (``WarmupCosine``, for ``LambdaLR``), and clipping of
the global gradient norm (``boost(..., max_grad_norm=1.0)``)::

    model = ck.models.GPT(cfg)
    opt = torch.optim.AdamW(ck.recipe.decay_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, ck.recipe.WarmupCosine(warmup=10, total=100))
    engine = ck.boost(model, opt, ck.ParallelConfig(dp=4), lr_scheduler=sched, max_grad_norm=1.0)

``one_process`` trains the same recipe in this process with nothing but torch (``clip_grad_norm_``,
``opt.step()``, ``sched.step()``): the yardstick the demo and the tests hold the engine to.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["decay_groups", "WarmupCosine", "adamw", "one_process"]


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two param groups of ``model``: its matrices (dim >= 2: linears, embeddings) with ``weight_decay``,
    and the rest (biases, norm weights) with none, as GPT-2 and the paper's runs do.

    >>> from colab_kit.models import GPT, GPTConfig
    >>> groups = decay_groups(GPT(GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, n_layers=1)), 0.1)
    >>> [(g["weight_decay"], len(g["params"])) for g in groups]
    [(0.1, 7), (0.0, 10)]
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


class WarmupCosine:
    """The learning-rate factor of step ``s``: ``(s + 1) / warmup`` for the first ``warmup`` steps, then a
    cosine from 1 down to ``floor`` at step ``total`` (and ``floor`` after). A class rather than a
    lambda, so a checkpoint keeps it (``LambdaLR.state_dict`` saves a callable object's attributes).

    >>> f = WarmupCosine(warmup=2, total=6, floor=0.1)
    >>> [round(f(s), 3) for s in range(7)]
    [0.5, 1.0, 1.0, 0.868, 0.55, 0.232, 0.1]
    """

    def __init__(self, warmup: int, total: int, floor: float = 0.1):
        if warmup < 0 or total <= warmup:
            raise ValueError(f"WarmupCosine needs 0 <= warmup < total, got warmup={warmup}, total={total}")
        self.warmup, self.total, self.floor = warmup, total, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / (self.total - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * t))


def adamw(model: nn.Module, lr: float, weight_decay: float = 0.1, warmup: int = 10, total: int = 100,
          betas=(0.9, 0.95), floor: float = 0.1, **kw):
    """The recipe's ``(optimizer, scheduler)`` over the dense ``model``: AdamW over ``decay_groups`` and
    a ``LambdaLR`` of ``WarmupCosine``; give both to ``boost``. ``kw``: more AdamW settings (``foreach``)."""
    opt = torch.optim.AdamW(decay_groups(model, weight_decay), lr=lr, betas=betas, **kw)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(warmup, total, floor))


def one_process(model: nn.Module, recipe: Callable, batches: Callable[[int], tuple], steps: int,
                max_grad_norm: float | None = None, loss_fn: Callable | None = None,
                precision: str = "fp32", pieces: int = 1) -> dict:
    """Train ``model`` in this process with nothing but torch: ``recipe(model)`` -> ``(optimizer, scheduler)``
    (``scheduler`` may be None), then per step ``batches(step)`` -> ``(inputs, targets)``, the mean token
    cross-entropy, ``clip_grad_norm_`` (with ``max_grad_norm``), ``optimizer.step()``, ``scheduler.step()``.

    ``precision="bf16"`` or ``"fp16"``: the mixed-precision recipe written out: ``model`` in 16 bits for
    the forward and backward, an fp32 copy of it (made from the 16-bit weights) whose parameters the recipe's
    optimizer steps (its groups are made over the copy, so they are the same groups), the loss in fp32, the
    16-bit gradients cast to fp32 before clipping; fp16 scales the loss (2^16 at first, halved on an overflow, which
    skips the step without clipping it, doubled after 2000 good steps). Returns ``{"losses", "grad_norms", "lrs",
    "skipped"}`` per step (a skipped step's norm is None) and ``"model"``: the fp32 model trained.

    ``pieces``: each batch's rows in that many equal, consecutive pieces, each one's loss (weighted by its
    share of the counted targets: together the batch's mean token loss) taken backward in turn, gradients
    summed: plain gradient accumulation, and the order in which a data-parallel engine sums the same rows
    (``dp x microbatches`` pieces, rank r's rows the r-th). In exact arithmetic the same model; in fp32 it
    keeps a long run from comparing two orders of one sum. Measured: the demo's 40 AdamW steps on 2 ranks
    against a reference of one piece differed by 2.1e-5 at the one step whose gradient norm spiked to 12
    (about 1e-7 at the others: a large gradient turns the rounding of the parameters into loss).

    Worked example, 16 rows and ``pieces=2`` (dp=2): rows 0-7 forward, backward of their loss x 1/2 (every
    target counted), then rows 8-15 the same; the loss returned is the sum of the two weighted losses.
    """
    import copy
    loss_fn = loss_fn or (lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    low = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    master = model
    if low is not None:
        master, model = model, copy.deepcopy(model).to(low)
    pairs = list(zip(master.parameters(), model.parameters()))
    if low is not None:  # the fp32 copy starts from the 16-bit weights, as the engine's masters do
        with torch.no_grad():
            for m, p in pairs:
                m.copy_(p.float())
    optimizer, scheduler = recipe(master)
    scale, good = (2.0 ** 16 if precision == "fp16" else 1.0), 0
    out: dict[str, Any] = {"losses": [], "grad_norms": [], "lrs": [], "skipped": [], "model": master}
    model.train()
    for step in range(steps):
        x, y = batches(step)
        optimizer.zero_grad()
        counted = y != -100
        total = max(int(counted.sum()), 1)
        loss: float | torch.Tensor = 0.0
        for xs, ys, cs in zip(x.chunk(pieces), y.chunk(pieces), counted.chunk(pieces)):
            logits = model(xs)
            part = loss_fn(logits.float() if low is not None else logits, ys)
            if pieces > 1:
                part = part * (int(cs.sum()) / total)
            (part * scale if scale != 1.0 else part).backward()
            loss = loss + part.detach()
        finite = True
        if low is not None:  # the fp32 copy's gradient: the 16-bit one cast, unscaled
            for m, p in pairs:
                m.grad = None if p.grad is None else p.grad.float() / scale
                p.grad = None
            finite = all(torch.isfinite(m.grad).all() for m, _ in pairs if m.grad is not None)
        out["lrs"].append(optimizer.param_groups[0]["lr"])
        norm = None
        if finite:
            if max_grad_norm is not None:
                norm = float(torch.nn.utils.clip_grad_norm_(master.parameters(), max_grad_norm))
            optimizer.step()
            if low is not None:
                with torch.no_grad():
                    for m, p in pairs:
                        p.copy_(m)
        if precision == "fp16":
            good = 0 if not finite else good + 1
            scale = scale * 0.5 if not finite else (scale * 2.0 if good % 2000 == 0 else scale)
        if scheduler is not None:
            scheduler.step()
        out["grad_norms"].append(norm)
        out["skipped"].append(not finite)
        out["losses"].append(float(loss))
    return out
