"""The estimator covers every model with a policy: ``engine.memory_estimate()`` against what the engine
measured (``engine.memory()``), on every rank, for BERT, ViT, a user's model, Hugging Face GPT-2 and Llama
under dp, tp 1d and 2d, pp 1F1B, ZeRO-3 and sp. Model states (params, grads, optimizer) within 10%,
activations within 5% (measured: 0.97 to 1.02 for every model; GPT-2 was 1.07 while its trace ran with the KV cache
the engine's step turns off, and a causal mask the real run never builds; 0.95 to 1.05 before the loss's fp32
log-softmax and targets, outside the traced forward, were added; GPT-2 1.02 to 1.15 before its tanh GELU was
counted as it saves; the activations are the dense forward traced with fake tensors, the loss added, scaled by
the layout's share, ``estimate.model_activations``). An estimate that ignored the
split (dp's half, tp's share, the pipeline stage) would be off by 2x and fail.
"""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.memory.estimator import traced_activations
from colab_kit.memory import ActivationMeter
from colab_kit.planner import EXAMPLE_CONSTANTS
from colab_kit.policy.hf import without_kv_cache

from tests.helpers import case_id
from tests.helpers import BERT_CFG, NET_POLICY, VIT_CFG, Plain, batch as builtin_batch, make

MODELS = ("bert", "vit", "net", "gpt2", "llama")


def batch(name, step):
    return builtin_batch("gpt" if name in ("gpt2", "llama") else name, step)


def _measure(cases):
    out = {}
    for name, kw in cases:
        engine = ck.boost(make(name), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ck.ParallelConfig(**kw),
                          policy=NET_POLICY if name == "net" else None)
        for s in range(2):
            engine.train_step(batch(name, s))
        out[name, tuple(sorted(kw.items()))] = engine.memory(), engine.memory_estimate()
        engine.close()
    return out


CASES = {
    2: [(m, kw) for m in MODELS for kw in (dict(dp=2), dict(tp=2), dict(pp=2, microbatches=2), dict(dp=2, zero=3))]
       + [(m, dict(sp=2)) for m in ("bert", "net", "gpt2", "llama")],
    4: [(m, dict(tp=4, tp_mode="2d")) for m in MODELS],
}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for world, cases in CASES.items():
        for res in ck.launch(_measure, world, cases):
            for key, value in res.items():
                out.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize("case", [c for cs in CASES.values() for c in cs],
                         ids=case_id)
def test_estimate_matches_the_measurement(runs, case):
    for rank, (got, est) in enumerate(runs[case[0], tuple(sorted(case[1].items()))]):
        for key in ("params", "grads", "optimizer"):
            assert abs(est[key] - got[key]) <= 0.10 * got[key], (rank, key, est[key], got[key])
        assert got["activations"] > 0 and abs(est["activations"] - got["activations"]) <= 0.05 * got["activations"], \
            (rank, est["activations"], got["activations"])
        print(f"{case[0]} {case[1]} rank {rank}: activations estimate / measured "
              f"{est['activations'] / got['activations']:.2f}")  # pytest -s prints the figures the docs quote


@pytest.mark.parametrize("name", MODELS + ("mixtral",))
def test_the_traced_forward_is_what_the_meter_counts(name):
    """One process: the fake-tensor trace of the dense forward against the meter on the real one, to the byte
    (Mixtral within 1%: its experts' ``grouped_mm`` in fp32, which torch's meta kernel alone refuses)."""
    from tests.helpers import hf_moe

    model = hf_moe.build(name) if name == "mixtral" else make(name)
    without_kv_cache(model)  # a Hugging Face model run as the engine runs it
    x, _ = batch("gpt" if name == "mixtral" else name, 0)
    meter = ActivationMeter(exclude=list(model.parameters()))
    with meter.measure():
        model(x)
    traced = traced_activations(model, tuple(x.shape), x.dtype)
    assert abs(traced - meter.last) <= 0.01 * meter.last, (traced, meter.last)
    if name != "mixtral":  # to the byte (GPT-2's trace was 2% over: a causal mask the real run never builds)
        assert traced == meter.last, (traced, meter.last)


def test_the_planner_takes_any_model_with_its_rules():
    """ck.plan on a model: only configs boost accepts for it (no sp for ViT; BERT gets sp and 3D),
    its activations scaled from its own traced forward (dp=4 holds a quarter of one process's). Priced with the
    example constants: what is tested is the model's side, not this machine's (measuring them for 8 ranks in a
    fresh cache took this test 52 s under `pytest --durations`; tests/ranks/test_planner.py measures them)."""
    from colab_kit.models import BERT, ViT
    vit = ck.plan(ViT(VIT_CFG), 4, 16, constants=EXAMPLE_CONSTANTS)
    assert vit and not any(c.config.sp > 1 for c in vit)
    x, _ = batch("vit", 0)
    whole = traced_activations(ViT(VIT_CFG), (16, *x.shape[1:]), x.dtype)
    # a dp=4 candidate of one microbatch, not recomputed (ZeRO and offload do not change activations; which
    # stage ranks first depends on the constants: where ranks share cores ZeRO 1 dominates stage 0)
    dp4 = next(c for c in vit if c.config.dp == 4 and c.config.microbatches == 1 and c.config.recompute == "none")
    assert abs(dp4.memory["activations"] - whole / 4) <= 0.02 * whole
    bert = ck.plan(BERT(BERT_CFG), 8, 16, constants=EXAMPLE_CONSTANTS)
    assert any(c.config.tp_mode == "3d" for c in bert) and any(c.config.sp > 1 for c in bert)
    with pytest.raises(ck.ConfigError, match="ck.plan needs a sharding policy for Plain"):
        ck.plan(Plain(), 2, 4, constants=EXAMPLE_CONSTANTS)
