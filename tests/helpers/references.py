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
STEPS, BATCH = 3, 8  # a parity test's steps: docs/testing.md, "How many steps"
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
}


class Mixed(NamedTuple):
    losses: list[float]
    trained: dict      # {name: tensor} after training (16-bit in a mixed recipe)
    start: dict        # ... and before it
    norms: list[float]  # the global gradient norm before clipping, each step (with max_grad_norm)


def one_process(model: nn.Module, optimizer_factory: Callable, batches: Callable[[int], tuple], steps: int,
                loss: Callable, *, rows: list | None = None, precision: str = "fp32",
                max_grad_norm: float | None = None, after_step: Callable | None = None,
                overflow: str = "raise") -> Mixed:
    """The one training loop every one-process reference runs, in plain torch.

    Per step: ``batches(step) -> (inputs, targets)``; for each microbatch's ``rows`` (index tensors of the
    batch, ``None``: the whole batch) ``loss(model, x, y)`` (an fp32 scalar) divided by their number, backward
    (gradients accumulate); clipping to ``max_grad_norm``, the optimizer step, ``after_step(model, skipped)``
    (e.g. the router bias). The step's loss is the mean of its microbatches'. ``precision`` "bf16"/"fp16" is the
    mixed recipe of ``colab_kit.precision``: a 16-bit copy of ``model`` (inputs cast where they are floating
    point), fp32 masters stepped and copied back, fp16's loss times a dynamic scale (2^16); an overflow either
    fails (``overflow="raise"``) or skips the step whole and halves the scale (``"skip"``, as GradScaler).
    """
    mixed = precision != "fp32"
    net = copy.deepcopy(model).to(LOW[precision]) if mixed else model
    start = {n: p.detach().clone() for n, p in net.named_parameters()}
    params = list(net.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params] if mixed else params
    optimizer = optimizer_factory(masters)
    scale = 2.0 ** 16 if precision == "fp16" else 1.0
    parts = rows if rows is not None else [None]
    losses, norms = [], []
    for step in range(steps):
        x, y = batches(step)
        if mixed and x.is_floating_point():
            x = x.to(LOW[precision])
        optimizer.zero_grad()
        total = 0.0
        for r in parts:
            value = loss(net, x if r is None else x[r], y if r is None else y[r])
            (value * scale / len(parts)).backward()
            total += value.item() / len(parts)
        losses.append(total)
        if mixed:
            for m, p in zip(masters, params):
                m.grad = None if p.grad is None else p.grad.float() / scale
                p.grad = None
            if not all(torch.isfinite(m.grad).all() for m in masters if m.grad is not None):
                assert overflow == "skip", "an overflow in the reference"
                scale /= 2
                if after_step is not None:
                    after_step(net, True)
                continue
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, max_grad_norm)))
        optimizer.step()
        if mixed:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
        if after_step is not None:
            after_step(net, False)
    return Mixed(losses, {n: p.detach().clone() for n, p in net.named_parameters()}, start, norms)


def token_loss(logits: Callable = lambda out: getattr(out, "logits", out)) -> Callable:
    """``loss`` for ``one_process``: the mean token (or class) cross-entropy of ``logits(model(x))`` in fp32."""
    def loss(model, x, y):
        out = logits(model(x)).float()
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return loss


def plain_mixed_precision(model: torch.nn.Module, optimizer_factory: Callable, batches: Callable[[int], tuple],
                          steps: int, precision: str, logits: Callable = lambda out: out,
                          max_grad_norm: float | None = None) -> Mixed:
    """Train a 16-bit copy of ``model`` for ``steps`` steps (``one_process``'s mixed recipe; an overflow fails).
    ``logits(model(inputs))`` -> the logits (``out.logits`` for a Hugging Face model); ``max_grad_norm`` clips
    the fp32 gradients after unscaling (``clip_grad_norm_``)."""
    return one_process(model, optimizer_factory, batches, steps, token_loss(logits), precision=precision,
                       max_grad_norm=max_grad_norm)


def plain_training(model: nn.Module, optimizer_factory: Callable, batches: Callable[[int], tuple], steps: int,
                   logits: Callable = lambda out: getattr(out, "logits", out)) -> list[float]:
    """Plain torch in one process, in train mode: ``steps`` steps of mean token (or class) cross-entropy on
    ``batches(step) -> (inputs, targets)``; the losses. Make the model's dropouts layout-invariant first
    (``colab_kit.models.dropout.layout_invariant``) to compare with an engine that runs dropout."""
    model.train()
    return one_process(model, optimizer_factory, batches, steps, token_loss(logits)).losses


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
    with engine.data_parallel.gathered():  # ZeRO-3: the chunks whole while they are read
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
