"""What several test files share, written in plain torch so that it checks the engine rather than repeating it.

``plain_mixed_precision``: the mixed-precision recipe in one process, nothing from ``colab_kit.precision``: the
model cast to 16 bits, fp32 copies made from the 16-bit weights that the optimizer steps, the loss taken in
fp32 from the 16-bit logits, the 16-bit gradients cast to fp32 and unscaled (fp16 scales the loss by 2^16,
the engine's first scale, as ``torch.amp.GradScaler`` does), the stepped copies cast back.

``trained_like``: parameters count as trained like the reference when they are off its by under a tenth of
what training moved the reference from where it started, over the whole model. The untrained weights are off
by the whole update (ratio 1.0), so the check rejects them: each test that uses it asserts that too.
"""
from __future__ import annotations

import copy
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from colab_kit.models import GPTConfig

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}

# the small GPT and the two optimizers most parity tests train (the contract names AdamW and SGD + momentum)
GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
STEPS, BATCH = 5, 8
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
}


class Mixed(NamedTuple):
    losses: list[float]
    trained: dict      # {name: 16-bit tensor} after training
    start: dict        # ... and before it
    norms: list[float]  # the global gradient norm before clipping, each step (with max_grad_norm)


def plain_mixed_precision(model: torch.nn.Module, optimizer_factory: Callable, batches: Callable[[int], tuple],
                          steps: int, precision: str, logits: Callable = lambda out: out,
                          max_grad_norm: float | None = None) -> Mixed:
    """Train a 16-bit copy of ``model`` for ``steps`` steps. ``batches(step)`` -> ``(inputs, targets)``;
    ``logits(model(inputs))`` -> the logits (``out.logits`` for a Hugging Face model); ``max_grad_norm`` clips
    the fp32 gradients after unscaling (``clip_grad_norm_``)."""
    low = copy.deepcopy(model).to(LOW[precision])
    start = {n: p.detach().clone() for n, p in low.named_parameters()}
    params = list(low.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    optimizer = optimizer_factory(masters)
    scale = 2.0 ** 16 if precision == "fp16" else 1.0
    losses, norms = [], []
    for step in range(steps):
        x, y = batches(step)
        x = x.to(LOW[precision]) if x.is_floating_point() else x
        out = logits(low(x)).float()
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        (loss * scale).backward()
        for m, p in zip(masters, params):
            m.grad = None if p.grad is None else p.grad.float() / scale
            p.grad = None
        assert all(torch.isfinite(m.grad).all() for m in masters if m.grad is not None), "an overflow in the reference"
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, max_grad_norm)))
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.copy_(m)
        losses.append(loss.item())
    return Mixed(losses, {n: p.detach().clone() for n, p in low.named_parameters()}, start, norms)


def update_error(got: dict, ref: dict, start: dict) -> float:
    """||got - ref|| / ||ref - start|| over the tensors of ``got``: 0 is the reference's weights, 1 the start's."""
    err = sum(((got[n].float() - ref[n].float()) ** 2).sum() for n in got) ** 0.5
    moved = sum(((start[n].float() - ref[n].float()) ** 2).sum() for n in got) ** 0.5
    assert moved > 0, "the reference did not move: nothing to compare against"
    return float(err / moved)


def trained_like(got: dict, ref: dict, start: dict, within: float = 0.1) -> bool:
    return update_error(got, ref, start) < within
