"""Sequence parallelism in the engine: ring and Ulysses train like one process.

Three GPT steps (AdamW and SGD + momentum) give the single-process losses (1e-5 relative) and
final parameters for ring sp=2 and 4, ring sp=2 x dp=2, sp=2 x tp=2 (1d), sp=2 x pp=2, Ulysses
sp=2 and 4, and with ZeRO (ring sp=2 x dp=2 with zero=2 and zero=3). Every rank of an sp group
holds 1/sp of the tokens; at sp=4 on a long sequence a rank holds at most a third of one
process's activations. A sequence that does not split is refused at the first step, on every
rank, before any collective; Ulysses with heads that do not divide is refused in ``boost``. The
ring records its rotations (which K/V chunk each rank held). One spawn per world size.
"""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.memory import ActivationMeter
from colab_kit.models import GPT, GPTConfig

from tests.helpers import BATCH, GPT_CFG, OPTIMIZERS, STEPS, gpt_reference as reference, named_params as _named

WORLD2 = [dict(sp=2), dict(sp=2, sp_mode="ulysses")]
WORLD4 = [dict(sp=4), dict(sp=4, sp_mode="ulysses"), dict(sp=2, dp=2), dict(sp=2, tp=2),
          dict(sp=2, pp=2, microbatches=2), dict(sp=2, dp=2, zero=2), dict(sp=2, dp=2, zero=3)]
LONG = GPTConfig(vocab_size=64, seq_len=256, d_model=32, n_heads=4, n_layers=2)  # activations grow with t


def _train(cfgs, extras: bool = False):
    data, out = SyntheticTokens(64, 16, seed=1), {}
    for kw in cfgs:
        for opt in OPTIMIZERS:
            engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS[opt], ck.ParallelConfig(**kw))
            losses = [engine.train_step(data.batch(s, BATCH)) for s in range(STEPS)]
            rec = engine.sp_plan.recorder
            out[tuple(sorted(kw.items())), opt] = dict(
                losses=losses, params=_named(engine, kw),
                holds=rec.holds("forward") if rec is not None else None,
                rotations=sum(e["phase"] == "forward" for e in rec.events) if rec is not None else None)
            engine.close()
    if extras:
        out["long"] = _long()
        out["uneven"] = _uneven(data)
    return out


def _long():
    """Peak activation bytes on one rank for a long sequence (8 rows of 256 tokens), per mode."""
    data, out = SyntheticTokens(64, 256, seed=1), {}
    for mode in ("ring", "ulysses"):
        engine = ck.boost(GPT(LONG), OPTIMIZERS["sgd"], ck.ParallelConfig(sp=4, sp_mode=mode))
        engine.train_step(data.batch(0, 8))
        out[mode] = engine.memory()["activations"]
        engine.close()
    return out


def _uneven(data):
    """A 14-token sequence over sp=4 ring (2 sp = 8 chunks) is refused before any collective."""
    engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS["sgd"], ck.ParallelConfig(sp=4))
    x, y = data.batch(0, BATCH)
    records = len(engine.comm())
    try:
        engine.train_step((x[:, :14], y[:, :14]))
    except ck.ConfigError as exc:
        return str(exc), len(engine.comm()) - records
    finally:
        engine.close()
    return None, None


@pytest.fixture(scope="module")
def world4():
    return ck.launch(_train, 4, WORLD4, True, timeout=600)


def _check(results, cfgs):
    for kw in cfgs:
        key, sp = tuple(sorted(kw.items())), kw["sp"]
        for opt in OPTIMIZERS:
            ref_losses, ref_params = reference(opt)
            owned = set()
            for rank, res in enumerate(results):
                got = res[key, opt]
                assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (kw, opt, rank)
                atol = 2e-4 if opt == "adamw" else 5e-5
                for name, p in got["params"].items():
                    torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=atol,
                                               msg=lambda m: f"{kw} {opt} rank {rank} {name}: {m}")
                    owned.add(name)
                if kw.get("sp_mode", "ring") == "ring":  # one forward per block: sp rotations each (the first: own K/V)
                    blocks = GPT_CFG.n_layers // kw.get("pp", 1)  # this rank's blocks
                    assert len(got["holds"]) == sp and got["rotations"] == sp * blocks * kw.get(
                        "microbatches", 1), (kw, got["rotations"])
            assert owned == set(ref_params), kw


def test_ring_and_ulysses_at_sp2():
    _check(ck.launch(_train, 2, WORLD2), WORLD2)


def test_sp4_and_sp_with_dp_tp_pp_and_zero(world4):
    _check(world4, WORLD4)
    for res in world4:  # the zigzag: every chunk held by exactly one rank at each rotation
        holds = res[(("sp", 4),), "adamw"]["holds"]
        assert all(len(c) == 2 for c in holds.values())
    everyone = [sorted(c for r in world4 for c in r[(("sp", 4),), "adamw"]["holds"][rot]) for rot in range(4)]
    assert all(chunks == list(range(8)) for chunks in everyone), everyone


def test_sp4_holds_at_most_a_third_of_one_process_activations(world4):
    meter = ActivationMeter(exclude=list((model := GPT(LONG)).parameters()))
    x, y = SyntheticTokens(64, 256, seed=1).batch(0, 8)
    with meter.measure():
        ck.engine.lm_loss(model(x), y).backward()
    for res in world4:
        for mode, held in res["long"].items():
            assert held <= meter.peak / 3, (mode, held, meter.peak)


def test_uneven_sequence_and_indivisible_heads_are_refused_early(world4):
    for res in world4:
        message, records = res["uneven"]
        assert "14 tokens does not split over sp=4" in message and "use a multiple of 8" in message, message
        assert records == 0  # nothing ran before the refusal
    with pytest.raises(ck.ConfigError, match="sp must divide the 2 heads"):
        ck.boost(GPT(GPTConfig(n_heads=2, d_model=32)), OPTIMIZERS["sgd"], ck.ParallelConfig(sp=4, sp_mode="ulysses"))
