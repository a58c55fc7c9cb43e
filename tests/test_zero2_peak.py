"""ZeRO stage 2 inside the step, measured: the gradient bytes a rank holds never reach the whole
model's, with or without gradient accumulation.

One spawn, dp=2, zero=2, buckets of about 1/8 of the gradients, microbatches 1 and 2 (AdamW):
after a warm-up step, one step runs under ``colab_kit.memory_peak.StatePeak`` (the instrument
``bench/zero.py`` applies to FSDP2 alike). The bound, per rank, in bytes (fp32):

    peak grads <= pieces (4 Psi / N, padded) + 2 x the largest bucket + the largest parameter's gradient

two buckets: the one being reduce-scattered and the one filling (colab_kit.zero.stage2); one
parameter's gradient: autograd's fresh tensor, alive while it is copied into its bucket. Before
stage 2 freed its buckets a rank held 4 Psi + 4 Psi / N of gradients through backward. Also: the
rank's own figure (``grads.peak_nbytes``) is what the meter saw, up to that one fresh gradient;
after the step the rank holds the pieces only, and the estimate's formula agrees with
``engine.memory()`` within 5%; the losses are one process's.
"""
from __future__ import annotations

import pytest

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.memory import model_state_bytes
from colab_kit.memory_peak import StatePeak, state_bytes
from colab_kit.models import GPT

from tests.test_dp import BATCH, GPT_CFG, OPTIMIZERS
from tests.test_zero import reference

MICROBATCHES = (1, 2)


def _measure():
    data, out = SyntheticTokens(64, 16, seed=1), {}
    grads_total = 4 * sum(p.numel() for p in GPT(GPT_CFG).parameters())
    for m in MICROBATCHES:
        engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS["adamw"], ck.ParallelConfig(dp=2, zero=2, microbatches=m),
                          bucket_bytes=grads_total // 8)
        losses = [engine.train_step(data.batch(0, BATCH))]
        roots = (engine.module, engine.optimizer, engine.grads)
        before = state_bytes(*roots)
        with StatePeak(*roots) as meter:
            losses.append(engine.train_step(data.batch(1, BATCH)))
        z = engine.grads
        out[m] = dict(losses=losses, peak=meter.peak, at_peak=meter.at_peak, before=before,
                      after=state_bytes(*roots), memory=engine.memory(), own=getattr(z, "peak_nbytes", None),  # None before stage 2 counted it
                      pieces=4 * sum(s.numel() for s in z.shards), buckets=[4 * s for s in z.sizes],
                      largest_param=max(4 * p.numel() for p in engine.module.parameters()),
                      local=sum(p.numel() for p in engine.module.parameters()))
        engine.close()
    return out


@pytest.fixture(scope="module")
def measured():
    return ck.launch(_measure, 2)


def test_stage2_peak_gradients_stay_under_pieces_plus_two_buckets(measured):
    ref = reference("adamw")[0][:2]
    for rank, res in enumerate(measured):
        for m, got in res.items():
            assert got["losses"] == pytest.approx(ref, rel=1e-5), (m, rank)
            fixed = got["before"]["params"] + got["before"]["optimizer"]  # the same all through the step
            grads_peak = got["peak"] - fixed
            two = sum(sorted(got["buckets"])[-2:])
            bound = got["pieces"] + two + got["largest_param"]
            whole = 4 * got["local"]
            assert len(got["buckets"]) >= 6 and two < whole / 2, got["buckets"]
            assert grads_peak <= bound, (m, rank, grads_peak, bound, got["at_peak"])
            assert grads_peak < whole, (m, rank)  # never all of the model's gradients at once
            # the rank's own count of its full buckets is what the meter saw (up to one fresh gradient)
            assert got["own"] <= grads_peak <= got["own"] + got["largest_param"], (m, rank, got["own"], grads_peak)
            # after the step: only the pieces, as the formula says
            assert got["after"]["grads"] == got["memory"]["grads"] == got["pieces"], (m, rank)
            est = model_state_bytes(got["local"], "adamw", "fp32", dp=2, zero=2)
            for part in ("params", "grads", "optimizer"):
                assert abs(est[part] - got["memory"][part]) <= 0.05 * got["memory"][part], (m, rank, part)
