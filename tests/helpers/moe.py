"""The MoE GPTs the MoE tests train, and their one-process reference with gradient accumulation."""
from __future__ import annotations

import torch

from colab_kit.datasets import SyntheticTokens
from colab_kit.engine.loss import lm_loss
from colab_kit.models import GPT, GPTConfig, update_router_bias
from colab_kit.models.dropout import layout_invariant
from tests.helpers.references import one_process

BASE = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=4, d_expert=32)
MODELS = {
    # softmax, dropless top-2, a shared expert, both losses and the aux-loss-free bias
    "softmax": GPTConfig(**BASE, n_layers=2, n_experts=4, top_k=2, shared_experts=1, aux_loss=0.1, z_loss=0.01,
                         router_bias_update=0.01),
    # sigmoid scores, a capacity that drops, MoE in every other block of four
    "capacity": GPTConfig(**BASE, n_layers=4, n_experts=4, top_k=2, moe_every=2, router="sigmoid",
                          capacity_factor=1.0, aux_loss=0.1),
    # every token to expert 0 (a selection bias of 100, ``build``): the other ep ranks receive no row
    "one_expert": GPTConfig(**BASE, n_layers=2, n_experts=4, top_k=1, aux_loss=0.1, router_bias_update=1e-6),
    # top_k equal to the number of experts: every expert on every token
    "all_experts": GPTConfig(**BASE, n_layers=2, n_experts=4, top_k=4, z_loss=0.01),
    # dropout (attention, residual, the shared expert's MLP): masks from global coordinates in every layout (the
    # reference numbers rows per forward, so it matches the engine with one microbatch only)
    "dropout": GPTConfig(**BASE, n_layers=2, n_experts=4, top_k=2, shared_experts=1, aux_loss=0.1, dropout=0.1),
}
OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "frozen": lambda ps: torch.optim.SGD(ps, lr=0.0)}
STEPS, BATCH, RTOL = 3, 8, 1e-5  # docs/testing.md, "How many steps"


def build(name: str) -> GPT:
    """The MoE GPT ``name`` of ``MODELS``, as every rank and the reference build it."""
    model = GPT(MODELS[name])
    if name == "one_expert":
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "score_bias"):
                    m.score_bias[0] = 100.0
    return model


def data() -> SyntheticTokens:
    return SyntheticTokens(64, 16, seed=3)


def microbatch_rows(rows: int, microbatches: int, dp: int) -> list[torch.Tensor]:
    """The global rows of each of the engine's microbatches: microbatch j is the j-th part of every dp rank's
    rows, in dp order (dp=2, m=2, 8 rows: [0 1 4 5], [2 3 6 7])."""
    per_rank = torch.arange(rows).view(dp, microbatches, -1)
    return [per_rank[:, j].reshape(-1) for j in range(microbatches)]


def reference(model: str, opt: str, microbatches: int = 1, aux: bool = True, dp: int = 1,
              clip: float | None = None) -> list[float]:
    """Plain torch in one process (``references.one_process``): per step, each microbatch's ``(lm_loss +
    model.aux_loss()) / m`` backward (gradients accumulate), the optimizer step, the router bias update; the
    step's loss is their sum. The microbatches are the engine's under ``dp`` (``microbatch_rows``). ``aux=False``:
    the same without the auxiliary losses (a run that dropped them is caught); ``clip``: the gradient norm
    clipped to before each step."""
    model_ = build(model)
    if MODELS[model].dropout:  # the engine's dropout masks, from global coordinates (colab_kit.models.dropout)
        model_ = layout_invariant(model_)
    loss = (lambda m, x, y: lm_loss(m(x), y) + m.aux_loss()) if aux else (lambda m, x, y: lm_loss(m(x), y))
    return one_process(model_, OPTIMIZERS[opt], lambda step: data().batch(step, BATCH), STEPS, loss,
                       rows=microbatch_rows(BATCH, microbatches, dp), max_grad_norm=clip,
                       after_step=_bias).losses


def reference_mixed(model: str, opt: str, precision: str = "bf16", microbatches: int = 1, dp: int = 1) -> list[float]:
    """``reference`` in the mixed-precision recipe of ``colab_kit.precision`` (``references.one_process``): a
    16-bit model (its buffers too), fp32 masters stepped by the optimizer and copied back, the loss (token loss +
    auxiliary losses) in fp32, 16-bit gradients accumulated over microbatches. fp16: the loss times a dynamic
    scale (2^16, halved on an overflow, whose step is skipped whole: no update, the router bias kept), as
    ``torch.amp.GradScaler``."""
    return one_process(build(model), OPTIMIZERS[opt], lambda step: data().batch(step, BATCH), STEPS,
                       lambda m, x, y: lm_loss(m(x).float(), y) + m.aux_loss().float(),
                       rows=microbatch_rows(BATCH, microbatches, dp), precision=precision, after_step=_bias,
                       overflow="skip").losses


def _bias(model, skipped: bool) -> None:
    update_router_bias(model, skip=skipped)


def old_records(steps) -> dict:
    """``moe_records.step_layers`` as it was when the layers read each value on the host in the forward (one read
    per value, layer and microbatch): ``int()`` / ``float()`` of each of ``MoEStep.seen``'s tensors, then summed."""
    out: dict = {}
    for step in steps:
        for layer, seen in step.seen.items():
            rec = out.setdefault(layer, {"layer": layer, "dropped": 0, "balance": 0.0, "z": 0.0})
            for key in ("counts", "mine"):
                rec[key] = [a + b for a, b in zip(rec.get(key, [0] * len(seen[key])),
                                                  [int(c) for c in seen[key].float().tolist()])]
            rec["dropped"] += int(seen["dropped"])
            rec["balance"] += float(seen["balance"]) * step.pieces / len(steps)
            rec["z"] += float(seen["z"]) * step.pieces / len(steps)
    return out
