"""The yardstick of the correctness contract: plain PyTorch training in one process.

Every parallel configuration must reproduce these losses (fp32, 1e-5 relative). With
``precision="bf16"`` or ``"fp16"`` the same process runs the mixed-precision recipe with the
engine's own code (``colab_kit.precision``): a 16-bit model, fp32 master weights stepped by
the optimizer and copied back, fp16's dynamic loss scale; the engine must then match within
``precision.TOLERANCE``::

    >>> from colab_kit.models import GPTConfig
    >>> from colab_kit.datasets import SyntheticTokens
    >>> cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=1)
    >>> losses, params = single_process_losses(cfg, lambda ps: torch.optim.SGD(ps, lr=0.1),
    ...                                        SyntheticTokens(64, 8), steps=3, batch_size=4)
    >>> len(losses), params.dim()
    (3, 1)
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..models import GPT, update_router_bias
from ..precision import LossScaler, MasterWeights, loss_in_fp32, master_step, to_compute_dtype
from .loss import lm_loss

__all__ = ["train_single_process", "single_process_losses", "max_relative_difference"]


def train_single_process(model_cfg, optimizer_factory: Callable, data, steps: int, batch_size: int,
                         loss_fn: Callable | None = None, precision: str = "fp32"):
    """Train ``GPT(model_cfg)`` on ``data.batch(step, batch_size)`` for ``steps`` steps in this
    process; return the loss of every step and the trained model (16-bit for bf16/fp16; its
    fp32 masters are ``model.masters``, the loss scaler ``model.scaler``, the step results ``model.records``)."""
    loss_fn = loss_fn or lm_loss
    model = GPT(model_cfg)
    if precision != "fp32":
        return _train_mixed(model, optimizer_factory, data, steps, batch_size, loss_fn, precision)
    optimizer = optimizer_factory(model.parameters())
    losses = []
    for step in range(steps):
        inputs, targets = data.batch(step, batch_size)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        if model_cfg.n_experts:  # the MoE layers' balancing and z losses (colab_kit.models.moe)
            loss = loss + model.aux_loss()
        loss.backward()
        optimizer.step()
        if model_cfg.n_experts:
            update_router_bias(model)
        losses.append(loss.item())
    return losses, model


def _train_mixed(model, optimizer_factory, data, steps, batch_size, loss_fn, precision):
    """The mixed-precision recipe of ``colab_kit.precision`` in one process."""
    to_compute_dtype(model, precision)
    loss_fn = loss_in_fp32(loss_fn)
    params = [p for p in model.parameters() if p.requires_grad]
    model.masters = MasterWeights(params)
    model.scaler = LossScaler() if precision == "fp16" else None
    optimizer = optimizer_factory(model.masters.params)
    losses, model.records = [], []
    for step in range(steps):
        inputs, targets = data.batch(step, batch_size)
        for p in params:
            p.grad = None
        loss = loss_fn(model(inputs), targets)
        (loss if model.scaler is None else model.scaler.scale_loss(loss)).backward()
        model.masters.set_grads([p.grad for p in params])  # the 16-bit gradient, in fp32
        model.records.append(master_step(optimizer, model.masters, model.scaler))
        losses.append(loss.item())
    return losses, model


def single_process_losses(model_cfg, optimizer_factory: Callable, data, steps: int, batch_size: int,
                          loss_fn: Callable | None = None, precision: str = "fp32") -> tuple[list[float], torch.Tensor]:
    """``train_single_process``, with the final parameters as one flat vector."""
    losses, model = train_single_process(model_cfg, optimizer_factory, data, steps, batch_size, loss_fn, precision)
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def max_relative_difference(got, want) -> float:
    """Largest ``|got - want| / |want|`` over two equal-length sequences of losses."""
    if len(got) != len(want):
        raise ValueError(f"cannot compare {len(got)} losses with {len(want)}")
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))
