"""Mixed precision (bf16 / fp16, ``colab_kit.precision``) against one process running the same recipe.

Three GPT steps with AdamW and with SGD + momentum give the one-process recipe's losses within
``precision.TOLERANCE`` (relative), the recipe written in plain torch (``tests/helpers/``, not
``colab_kit.precision``), and 16-bit parameters off its by under a tenth of what training moved them
(a check the untrained weights fail): bf16 at dp=2
with zero 0, 1, 2, fp16 at dp=2 zero=2, bf16 with microbatches=2, bf16 with tp=2 (1d) and zero=2,
bf16 with a 2D tensor mode, fp16 with pp=2 (1f1b) and zero=1, bf16 with zero=3 (and offload="cpu"). Model-state bytes per rank are the
ZeRO paper's mixed-precision formulas (``memory.model_state_bytes(..., "bf16")``) within 5%. An
fp16 overflow injected on one rank at step 3 skips that step on every rank and halves the scale.
One spawn per world size, configurations looped inside.
"""
from __future__ import annotations

import functools

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.memory import model_state_bytes
from colab_kit.models import GPT
from colab_kit.precision import TOLERANCE, LossScaler, MasterWeights, master_step
from colab_kit.engine.reference import max_relative_difference

from tests.helpers import (BATCH, GPT_CFG, OPTIMIZERS, STEPS, named_params as _named, plain_mixed_precision,
                           trained_like, update_error)

WORLD2 = [dict(dp=2, precision="bf16"), dict(dp=2, zero=1, precision="bf16"), dict(dp=2, zero=2, precision="bf16"),
          dict(dp=2, zero=2, precision="fp16"), dict(dp=2, microbatches=2, precision="bf16"),
          dict(dp=2, zero=3, precision="bf16"), dict(dp=2, zero=3, offload="cpu", precision="bf16")]
MEMORY2 = [WORLD2[i] for i in (0, 1, 2, 5, 6)]  # the formula's cases (microbatches and fp16 add nothing new)
WORLD4 = [dict(dp=2, tp=2, zero=2, precision="bf16"), dict(tp=4, tp_mode="2d", precision="bf16"),
          dict(dp=2, pp=2, zero=1, microbatches=2, schedule="1f1b", precision="fp16")]
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


@functools.lru_cache(maxsize=None)
def reference(opt: str, precision: str):
    """The recipe in plain torch (tests/helpers/), not colab_kit.precision's: losses, trained and start weights."""
    data = SyntheticTokens(64, 16, seed=1)
    return plain_mixed_precision(GPT(GPT_CFG), OPTIMIZERS[opt], lambda s: data.batch(s, BATCH), STEPS, precision)


# --------------------------------------------------------------------------- on each rank
def _train(cfgs, overflow: bool = False):
    data, out = SyntheticTokens(64, 16, seed=1), {}
    for kw in cfgs:
        for opt in OPTIMIZERS:
            engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS[opt], ck.ParallelConfig(**kw))
            losses = [engine.train_step(data.batch(s, BATCH)) for s in range(STEPS)]
            out[tuple(sorted(kw.items())), opt] = dict(
                losses=losses, params=_named(engine, kw), memory=engine.memory(), records=engine.records,
                dtypes={p.dtype for p in engine.module.parameters()},
                local=sum(p.numel() for p in engine.module.parameters()))
            engine.close()
    if overflow:
        out["overflow"] = {zero: _overflow(data, zero) for zero in (0, 2, 3)}
    return out


def _overflow(data, zero: int):
    """fp16, dp=2: rank 0's head gradient is made inf in step 3 of 5 (a hook on the 16-bit gradient): two steps
    after the skipped one show that training goes on at the halved scale."""
    engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS["adamw"], ck.ParallelConfig(dp=2, zero=zero, precision="fp16"))
    if engine.mesh.rank("dp") == 0:
        engine.module.head.weight.register_hook(
            lambda g: torch.full_like(g, float("inf")) if engine.step_count == 2 else None)
    states, losses, names = [ck.state_vector(engine)], [], []
    for s in range(5):
        losses.append(engine.train_step(data.batch(s, BATCH)))
        states.append(ck.state_vector(engine))
        names.append([e["name"] for e in engine.timeline()])
    adam_steps = {float(st["step"]) for st in engine.optimizer.state.values()}
    engine.close()
    return dict(states=states, losses=losses, records=engine.records, adam_steps=adam_steps, names=names,
                scale=engine.scaler.scale)


@pytest.fixture(scope="module")
def world2():
    return ck.launch(_train, 2, WORLD2, True)


# --------------------------------------------------------------------------- checks
def _check_parity(results, cfgs):
    for kw in cfgs:
        key, precision = tuple(sorted(kw.items())), kw["precision"]
        for opt in OPTIMIZERS:
            ref_losses, ref_params, start, _ = reference(opt, precision)
            worst = max(max_relative_difference(res[key, opt]["losses"], ref_losses) for res in results)
            print(f"parity {precision} {dict(kw)} {opt}: max relative loss difference {worst:.1e}")  # -s shows it
            for rank, res in enumerate(results):
                got = res[key, opt]
                assert got["dtypes"] == {LOW[precision]}, (kw, rank)
                diff = max_relative_difference(got["losses"], ref_losses)
                assert diff <= TOLERANCE[precision], (kw, opt, rank, diff)
                assert not any(r["skipped"] for r in got["records"]), (kw, opt, rank)
                # the 16-bit weights: off the reference's by under a tenth of what training moved them (the
                # untrained weights are off by all of it); a per-element tolerance could not tell: Adam moves an
                # element by about lr a step whatever its gradient, so a few steps move it by less than one could allow
                error = update_error(got["params"], ref_params, start)
                assert trained_like(got["params"], ref_params, start), (kw, opt, rank, error)
                assert not trained_like({n: start[n] for n in got["params"]}, ref_params, start)


def _check_memory(results, cfgs):
    """params 2P, grads 2P (stage 2: 2P/N), optimizer 12P (fp32 master + Adam m, v; 1/N at stage >= 1)."""
    for kw in cfgs:
        key = tuple(sorted(kw.items()))
        for opt in OPTIMIZERS:
            for rank, res in enumerate(results):
                got = res[key, opt]
                mem = got["memory"]
                est = model_state_bytes(got["local"], opt, kw["precision"], dp=kw.get("dp", 1), zero=kw.get("zero", 0),
                                        offload=kw.get("offload", "none"))
                for part in ("params", "grads", "optimizer"):
                    assert abs(est[part] - mem[part]) <= 0.05 * mem[part], (kw, opt, rank, part, est, mem)
                    if kw.get("offload") == "cpu":  # ZeRO-3: every chunk's states on the host
                        assert mem["host"][part] == mem[part], (kw, opt, rank, part, mem)


def test_mixed_precision_dp2_parity_and_memory(world2):
    _check_parity(world2, WORLD2)
    _check_memory(world2, MEMORY2)


def test_fp16_overflow_skips_the_step_on_every_rank_and_halves_the_scale(world2):
    for zero in (0, 2, 3):
        runs = [res["overflow"][zero] for res in world2]
        for rank, got in enumerate(runs):
            rec = got["records"]
            assert [r["skipped"] for r in rec] == [False, False, True, False, False], (zero, rank, rec)
            assert [r["loss_scale"] for r in rec] == [65536.0] * 3 + [32768.0] * 2
            assert rec[2]["note"] == "fp16 gradients overflowed (inf/nan): step skipped, loss scale 65536 -> 32768"
            assert [r["step"] for r in rec] == [1, 2, 3, 4, 5] and got["scale"] == 32768.0
            assert rec[2]["note"] in got["names"][2] and rec[2]["note"] not in got["names"][3]  # on the timeline
            s = got["states"]
            assert torch.equal(s[3], s[2]), (zero, rank)  # step 3 left every parameter as it was
            assert all(not torch.equal(s[i + 1], s[i]) for i in (0, 1, 3, 4)), (zero, rank)  # the others trained
            assert got["adam_steps"] == {4.0}  # Adam's counters did not count the skipped step
            assert all(torch.isfinite(torch.tensor(got["losses"])))
            assert torch.equal(s[-1], runs[0]["states"][-1])  # every rank holds the same parameters


def test_mixed_precision_with_tp_2d_and_pp():
    results = ck.launch(_train, 4, WORLD4)
    _check_parity(results, WORLD4)
    _check_memory(results, WORLD4)


def test_loss_scaler_and_master_step_in_one_process():
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    assert scaler.update(False) == "" and scaler.update(False).startswith("loss scale 8 -> 16 after 2 steps")
    w = torch.ones(3, dtype=torch.float16, requires_grad=True)
    masters = MasterWeights([w])
    opt = torch.optim.SGD(masters.params, lr=1.0)
    masters.set_grads([torch.full((3,), 16.0, dtype=torch.float16)])  # a gradient scaled by 16
    assert master_step(opt, masters, scaler) == {"skipped": False, "loss_scale": 16.0, "note": ""}
    assert w.tolist() == [0.0, 0.0, 0.0] and masters.grads == [None]
    masters.set_grads([torch.tensor([1.0, float("nan"), 0.0])])
    done = master_step(opt, masters, scaler)
    assert done["skipped"] and scaler.scale == 8.0 and w.tolist() == [0.0, 0.0, 0.0]
