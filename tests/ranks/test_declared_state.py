"""A user's model carries no attribute of ours after ``engine.close()``: what the engine knows of a model (its
placements, deferred-init recipes, dropout numbers, derived classes' origins, a GPT-2's converted Conv1D) is
kept in the engine's tables and its parts' weak tables, keyed by the module, never stamped onto it.

One spawn of 4 ranks, every config looped inside it: the built-in GPT with dropout, a Hugging Face GPT-2 with
attention dropout (``prepare`` converts its Conv1D), a Llama and a user's MLP, under dp, tp, sp (ring, with
recomputation), pp and ZeRO-3; each trains one step, is closed, and its model is read for ``_ck_`` names on
every module, every module's class, and every parameter and buffer, and for instance attributes its modules
did not have before ``boost``. Under sp (weights replicated) the closed model's forward runs in its process
alone and gives the logits of a fresh model loaded with its weights: nothing of the ring is left in it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig
from colab_kit.policy.hf import conv1d_to_linear
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


def added(model: nn.Module, before: dict) -> list[str]:
    """Instance attributes of ``model``'s modules that were not there in ``before`` (``{module: names}``, read
    before ``boost``), on the modules that are still the same objects."""
    found = []
    for path, m in model.named_modules():
        if m in before:
            found += [f"{path or '<root>'}.{k}" for k in set(vars(m)) - before[m]]
    return sorted(found)


def _logits(model, x):
    model.eval()
    with torch.no_grad():
        out = model(x)
    return getattr(out, "logits", out)


def _run() -> dict:
    data, out = SyntheticTokens(64, 16, seed=1), {}
    makers = {"gpt": lambda: GPT(GPT_DROP), "gpt2": lambda: make_hf("gpt2", dropout=0.1), "llama": lambda: make_hf("llama")}
    for name, kw in CONFIGS.items():
        for model_name, make in makers.items():
            model = make()
            before = {m: set(vars(m)) for m in model.modules()}
            engine = ck.boost(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ck.ParallelConfig(**kw))
            engine.train_step(data.batch(0, 8))
            engine.close()
            out[name, model_name] = ours(model) + added(model, before)
            if kw.get("sp"):  # weights replicated over sp: after close the model runs alone, as the dense model
                twin = make()
                conv1d_to_linear(twin)  # as ``prepare`` turned GPT-2's Conv1D into Linear (no attribute of ours)
                twin.load_state_dict(model.state_dict())
                x = data.batch(1, 2)[0]
                out[name, model_name, "one process"] = torch.allclose(_logits(model, x), _logits(twin, x), atol=1e-6)
    model = _mlp()
    engine = ck.boost(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ck.ParallelConfig(dp=4, zero=2))
    engine.train_step(data.batch(0, 8))
    engine.close()
    out["zero=2", "mlp"] = ours(model)
    return out


def test_a_users_model_carries_no_attribute_of_ours_after_close():
    results = ck.launch(_run, 4, timeout=600)
    for rank, res in enumerate(results):
        assert len(res) == len(CONFIGS) * 3 + 1 + 3
        for key, found in res.items():
            if key[-1] == "one process":  # its forward runs here, alone, and gives the trained dense model's logits
                assert found is True, (rank, key)
            else:
                assert found == [], (rank, key, found)


def test_the_reader_finds_a_stamped_attribute():
    """The check above can fail: a module, a class and a parameter stamped with ``_ck_`` names are each found."""
    model = _mlp()
    assert ours(model) == []
    model[0]._ck_layer = 3
    model[1].weight._ck_init = ("init", "1.weight")
    model[1].__class__ = type("Stamped", (nn.Linear,), {"_ck_from": nn.Linear})
    assert ours(model) == ["0._ck_layer", "1.weight._ck_init", "1: class Stamped._ck_from"]


def test_the_reader_finds_an_added_attribute():
    """``added`` can fail: an instance attribute set after the snapshot is found, one that was there is not."""
    model = _mlp()
    before = {m: set(vars(m)) for m in model.modules()}
    model[1].attend = print
    model[0].weight.requires_grad_(False)
    assert added(model, before) == ["1.attend"]

