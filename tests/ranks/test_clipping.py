"""Global gradient-norm clipping (``boost(..., max_grad_norm=)``, ``colab_kit.engine.clipping``) against
``torch.nn.utils.clip_grad_norm_`` in one process: GPT (and BERT, whose decoder is tied to its token table
across two pipeline ranks) clipped at a norm small enough to clip every step, three steps with SGD +
momentum and AdamW, equal within 1e-5 in losses and in the norm each step records, under dp, ZeRO 1, 2
and 3, ZeRO-2 with CPU offload, tp 1d, split_gather, 2d, 3d, pp, ring sp, and their compositions. A norm
that counted replicated copies twice (or forgot a shard) would differ by far more. ``max_grad_norm <= 0``
is refused before anything runs.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT

from tests.helpers import case_id, rank0_per_world
from tests.helpers import BATCH, GPT_CFG, OPTIMIZERS, make as make_model, mlm_batch, plain_mixed_precision

STEPS, MAX_NORM, RTOL = 3, 0.05, 1e-5


def batch(name, step):
    return mlm_batch(step) if name == "bert" else SyntheticTokens(64, 16, seed=1).batch(step, BATCH)


def make(name):
    return GPT(GPT_CFG) if name == "gpt" else make_model(name)


@functools.lru_cache(maxsize=None)
def reference(name, opt):
    model = make(name)
    optimizer = OPTIMIZERS[opt](model.parameters())
    losses, norms = [], []
    for s in range(STEPS):
        x, y = batch(name, s)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        losses.append(loss.item())
    return losses, norms


def _train(cases):
    out = {}
    for name, kw in cases:
        for opt in OPTIMIZERS:
            engine = ck.boost(make(name), OPTIMIZERS[opt], ck.ParallelConfig(**kw), max_grad_norm=MAX_NORM)
            losses = [engine.train_step(batch(name, s)) for s in range(STEPS)]
            out[name, tuple(sorted(kw.items())), opt] = losses, [r["grad_norm"] for r in engine.records]
            engine.close()
    return out


CASES = {
    2: [("gpt", kw) for kw in (dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=3),
                               dict(dp=2, zero=2, offload="cpu"), dict(tp=2), dict(tp=2, sp_mode="split_gather"),
                               dict(pp=2, microbatches=2), dict(sp=2))]
       + [("bert", dict(pp=2, microbatches=2, schedule="1f1b"))],
    4: [("gpt", kw) for kw in (dict(tp=4, tp_mode="2d"), dict(dp=2, tp=2, zero=2),
                               dict(pp=2, tp=2, microbatches=2, schedule="zb-h1"),
                               dict(pp=2, dp=2, zero=2, microbatches=2), dict(dp=2, sp=2, zero=2))],
    8: [("gpt", dict(tp=8, tp_mode="3d"))],
}


@pytest.fixture(scope="module")
def runs():
    return rank0_per_world(_train, CASES)


@pytest.mark.parametrize("case", [c for cs in CASES.values() for c in cs],
                         ids=case_id)
def test_clipping_equals_clip_grad_norm_in_one_process(runs, case):
    name, kw = case
    for opt in OPTIMIZERS:
        losses, norms = runs[name, tuple(sorted(kw.items())), opt]
        want_losses, want_norms = reference(name, opt)
        assert all(n > MAX_NORM for n in want_norms)  # every step clipped
        assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(norms, want_norms, strict=True)), (opt, norms, want_norms)
        assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(losses, want_losses, strict=True)), (opt, losses, want_losses)


def test_a_max_norm_that_is_not_positive_is_refused():
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(ck.ConfigError, match=r"max_grad_norm must be a positive number"):
            ck.boost(GPT(GPT_CFG), OPTIMIZERS["sgd"], ck.ParallelConfig(), max_grad_norm=bad)


@functools.lru_cache(maxsize=None)
def mixed_reference(precision):
    """The mixed-precision recipe in plain PyTorch (tests/helpers/), clipped after unscaling."""
    got = plain_mixed_precision(GPT(GPT_CFG), OPTIMIZERS["sgd"], lambda s: batch("gpt", s), STEPS, precision,
                                max_grad_norm=MAX_NORM)
    return got.losses, got.norms


def _mixed(precisions):
    out = {}
    for precision, kw in precisions:
        engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS["sgd"], ck.ParallelConfig(precision=precision, **kw),
                          max_grad_norm=MAX_NORM)
        losses = [engine.train_step(batch("gpt", s)) for s in range(STEPS)]
        out[precision, tuple(sorted(kw.items()))] = losses, [r["grad_norm"] for r in engine.records]
        engine.close()
    return out


def test_mixed_precision_clips_after_unscaling():
    """bf16 and fp16 (its loss scale 2^16 divided out first) under dp=2, ZeRO-2 and ZeRO-3: the norms of the
    plain-PyTorch recipe within the unit roundoff u (each gradient element differs by about u), the losses
    within 4x the mixed-precision tolerance."""
    from colab_kit.precision import UNIT_ROUNDOFF, tolerance
    cases = [("bf16", dict(dp=2)), ("fp16", dict(dp=2, zero=2)), ("bf16", dict(dp=2, zero=3))]
    got = ck.launch(_mixed, 2, cases)[0]
    for precision, kw in cases:
        losses, norms = got[precision, tuple(sorted(kw.items()))]
        want_losses, want_norms = mixed_reference(precision)
        tol = 4 * tolerance(precision, BATCH * 16)
        assert all(n > MAX_NORM for n in want_norms)
        u = UNIT_ROUNDOFF[precision]  # every gradient element differs by about u: so does their norm
        assert all(abs(a - b) <= u * abs(b) for a, b in zip(norms, want_norms, strict=True)), (precision, norms, want_norms)
        assert all(abs(a - b) <= tol * abs(b) for a, b in zip(losses, want_losses, strict=True)), (precision, losses, want_losses)
