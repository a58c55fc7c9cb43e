"""A user's model carries no attribute of ours after ``engine.close()``: what the engine knows of a model (its
placements, deferred-init recipes, dropout numbers, derived classes' origins, a GPT-2's converted Conv1D) is
kept in the engine's tables and its parts' weak tables, keyed by the module, never stamped onto it.

One spawn of 4 ranks, every config looped inside it: the built-in GPT with dropout, a Hugging Face GPT-2 with
attention dropout (``prepare`` converts its Conv1D), a Llama and a user's MLP, under dp, tp, sp (ring, with
recomputation), pp and ZeRO-3; each trains one step, is closed, and its model is read for ``_ck_`` names on
every module, every module's class, and every parameter and buffer.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig
from tests.helpers.zoo import make_hf

pytest.importorskip("transformers")

GPT_DROP = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4, dropout=0.1)
CONFIGS = {"dp x tp": dict(dp=2, tp=2), "ring sp x dp recompute": dict(dp=2, sp=2, recompute=True),
           "pp x tp": dict(pp=2, tp=2, microbatches=2), "zero=3": dict(dp=4, zero=3)}


def ours(model: nn.Module) -> list[str]:
    """Every ``_ck_`` name on ``model``: instance and class attributes of its modules, attributes of its tensors."""
    found = []
    for path, m in model.named_modules():
        found += [f"{path or '<root>'}.{k}" for k in vars(m) if k.startswith("_ck_")]
        found += [f"{path or '<root>'}: class {type(m).__name__}.{k}" for k in dir(type(m)) if k.startswith("_ck_")]
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        found += [f"{name}.{k}" for k in vars(t) if k.startswith("_ck_")]
    return sorted(set(found))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))


def _run() -> dict:
    data, out = SyntheticTokens(64, 16, seed=1), {}
    makers = {"gpt": lambda: GPT(GPT_DROP), "gpt2": lambda: make_hf("gpt2", dropout=0.1), "llama": lambda: make_hf("llama")}
    for name, kw in CONFIGS.items():
        for model_name, make in makers.items():
            model = make()
            engine = ck.boost(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ck.ParallelConfig(**kw))
            engine.train_step(data.batch(0, 8))
            engine.close()
            out[name, model_name] = ours(model)
    model = _mlp()
    engine = ck.boost(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ck.ParallelConfig(dp=4, zero=2))
    engine.train_step(data.batch(0, 8))
    engine.close()
    out["zero=2", "mlp"] = ours(model)
    return out


def test_a_users_model_carries_no_attribute_of_ours_after_close():
    results = ck.launch(_run, 4, timeout=600)
    for rank, res in enumerate(results):
        assert len(res) == len(CONFIGS) * 3 + 1
        for key, found in res.items():
            assert found == [], (rank, key, found)


def test_the_reader_finds_a_stamped_attribute():
    """The check above can fail: a module, a class and a parameter stamped with ``_ck_`` names are each found."""
    model = _mlp()
    assert ours(model) == []
    model[0]._ck_layer = 3
    model[1].weight._ck_init = ("init", "1.weight")
    model[1].__class__ = type("Stamped", (nn.Linear,), {"_ck_from": nn.Linear})
    assert ours(model) == ["0._ck_layer", "1.weight._ck_init", "1: class Stamped._ck_from"]
