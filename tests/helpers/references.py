"""The small GPT, the two optimizers most parity tests train, and the references written in plain torch
(one-process training, mixed precision) with the readers that compare against them."""
from __future__ import annotations

import copy
import functools
from typing import Callable, NamedTuple

import torch

import colab_kit as ck
import torch.nn as nn
import torch.nn.functional as F


from colab_kit import comm
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine.reference import train_single_process
from colab_kit.models import GPT, GPTConfig


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


def plain_training(model: nn.Module, optimizer_factory: Callable, batches: Callable[[int], tuple], steps: int,
                   logits: Callable = lambda out: getattr(out, "logits", out)) -> list[float]:
    """Plain torch in one process, in train mode: ``steps`` steps of mean token (or class) cross-entropy on
    ``batches(step) -> (inputs, targets)``; the losses. Make the model's dropouts layout-invariant first
    (``colab_kit.models.dropout.layout_invariant``) to compare with an engine that runs dropout."""
    model.train()
    optimizer = optimizer_factory(model.parameters())
    losses = []
    for s in range(steps):
        x, y = batches(s)
        out = logits(model(x))
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def update_error(got: dict, ref: dict, start: dict) -> float:
    """||got - ref|| / ||ref - start|| over the tensors of ``got``: 0 is the reference's weights, 1 the start's."""
    err = sum(((got[n].float() - ref[n].float()) ** 2).sum() for n in got) ** 0.5
    moved = sum(((start[n].float() - ref[n].float()) ** 2).sum() for n in got) ** 0.5
    assert moved > 0, "the reference did not move: nothing to compare against"
    return float(err / moved)


def trained_like(got: dict, ref: dict, start: dict, within: float = 0.1) -> bool:
    return update_error(got, ref, start) < within


# =========================================================================== the small GPT, trained and read back
@functools.lru_cache(maxsize=None)
def gpt_reference(opt: str):
    """The small GPT trained in one process with plain torch: (losses, {name: trained parameter})."""
    losses, model = train_single_process(GPT_CFG, OPTIMIZERS[opt], SyntheticTokens(64, 16, seed=1), STEPS, BATCH)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def named_params(engine, kw) -> dict:
    """The trained parameters by their dense names (gathered over tp; this rank's stages with pp)."""
    with engine.grads.gathered():  # ZeRO-3: the chunks whole while they are read
        return _dense_named(engine, kw)


def _dense_named(engine, kw) -> dict:
    if kw.get("pp", 1) > 1:
        return {n: p.detach().clone() for st in engine.module for n, p in zip(st.source_names, st.parameters())}
    if kw.get("tp", 1) > 1:
        from colab_kit.tensor.inspect import dense_state
        return dense_state(engine.module)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def with_unused(seed: int = 5) -> nn.Module:
    """The small GPT with a Linear its forward never calls (no gradient, ever)."""
    model = GPT(GPT_CFG)
    torch.manual_seed(seed)
    model.unused = nn.Linear(4, 4)  # never called by GPT.forward: no gradient, ever
    return model


def same_over_dp(engine) -> bool:
    """Every dp rank holds exactly the same parameters (the all-gather put them back whole)."""
    v = ck.state_vector(engine)
    got = comm.all_gather(v, engine.mesh, "dp").view(engine.config.dp, -1)
    return all(torch.equal(row, v) for row in got)
