"""Hugging Face models handed to ``ck.boost`` as they are: ``transformers``' GPT2LMHeadModel (fused
``c_attn`` in Conv1D layout, tied head) and LlamaForCausalLM (RoPE, RMSNorm, SwiGLU, grouped-query
attention, a padding row in its token table), built from a config with random weights; Llama's kin where each
differs (Mistral with and without a sliding window, Qwen2's q/k/v biases, Qwen3's per-head q/k norms) and
GPT-NeoX, which has no policy (dp and ZeRO only). Three steps equal
the same model trained in one process with plain PyTorch (mean token cross-entropy of ``model(ids).logits``)
within 1e-5, under tp 1d, 2d and 3d, pp 1f1b and zb-h1, ZeRO-3, sp ring and Ulysses, recompute, and
dp x tp x pp. Each config trains once, with AdamW for one model and SGD + momentum for the other
(``optimizer_of``), so every config and every model sees both optimizers. ``save_pretrained`` writes what ``from_pretrained``
reads back with equal logits; ``load_pretrained`` reads what ``save_pretrained`` of a plain model wrote.
One spawn per world size, configs looped inside."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens

from tests.helpers import case_id, rank0_per_world
from tests.helpers import OPTIMIZERS, make_hf as make

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

STEPS, BATCH = 3, 8
DATA = SyntheticTokens(64, 16, seed=1)


def plain_loss(model, x, y):
    return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())


@functools.lru_cache(maxsize=None)
def reference(name: str, opt: str):
    model = make(name)
    optimizer = OPTIMIZERS[opt](model.parameters())
    losses = []
    for s in range(STEPS):
        loss = plain_loss(model, *DATA.batch(s, BATCH))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def optimizer_of(name: str, kw: dict) -> str:
    """GPT-2 trains with AdamW where Llama trains with SGD + momentum, and the other way round on the next
    config of the list; each of Llama's kin AdamW on its first config, SGD + momentum on its second."""
    if name in _KIN:
        return ("adamw", "sgd")[_KIN[name].index(kw) % 2]
    configs = [dict(k) for k in dict.fromkeys(tuple(sorted(c[1].items())) for cs in CASES.values() for c in cs)]
    return list(OPTIMIZERS)[(configs.index(kw) + (name == "llama")) % len(OPTIMIZERS)]


def _train(cases):
    out = {}
    for name, kw in cases:
        engine = ck.boost(make(name), OPTIMIZERS[optimizer_of(name, kw)], ck.ParallelConfig(**kw))
        out[name, tuple(sorted(kw.items()))] = [engine.train_step(DATA.batch(s, BATCH)) for s in range(STEPS)]
        engine.close()
    return out


_TWO = (dict(tp=2), dict(pp=2, microbatches=2, schedule="1f1b"), dict(pp=2, microbatches=2, schedule="zb-h1"),
        dict(dp=2, zero=3), dict(sp=2), dict(sp=2, sp_mode="ulysses"), dict(tp=2, recompute=True))
_KIN = {  # Llama's kin under its policy (each where it differs from Llama), and a model with no policy
    "mistral": (dict(pp=2, microbatches=2, schedule="1f1b"), dict(sp=2)),
    "mistral-window": (dict(tp=2), dict(dp=2, zero=3)),  # a window of 8 in 16 tokens: the model's own mask
    "qwen2": (dict(tp=2), dict(sp=2, sp_mode="ulysses")),  # q/k/v biases
    "qwen3": (dict(tp=2), dict(pp=2, microbatches=2, schedule="zb-h1"), dict(tp=4, tp_mode="2d")),  # per-head
    # q/k norms (their gradients summed over the heads' and rows' axes)
    "neox": (dict(dp=2, zero=2),)}  # no policy: dp and ZeRO take model(ids).logits
CASES = {2: [(m, kw) for m in ("gpt2", "llama") for kw in _TWO] + [(m, kw) for m, kws in _KIN.items() for kw in kws
                                                                    if ck.ParallelConfig(**kw).world_size == 2],
         4: [(m, dict(tp=4, tp_mode="2d")) for m in ("gpt2", "llama")] + [("qwen3", dict(tp=4, tp_mode="2d"))],
         8: [(m, dict(dp=2, tp=2, pp=2, microbatches=2)) for m in ("gpt2", "llama")] + [(m, dict(tp=8, tp_mode="3d")) for m in ("gpt2", "llama")]}


@pytest.fixture(scope="module")
def runs():
    return rank0_per_world(_train, CASES)


@pytest.mark.parametrize("case", [c for cs in CASES.values() for c in cs],
                         ids=case_id)
def test_trains_like_one_process(runs, case):
    name, kw = case
    opt = optimizer_of(name, kw)
    got, want = runs[name, tuple(sorted(kw.items()))], reference(name, opt)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want, strict=True)), (opt, got, want)
    # it trained, by 100x the tolerance: a run whose updates were lost (the untrained losses) would fail
    assert abs(want[-1] - want[0]) > 1e-3 * want[0]


def test_every_config_and_model_sees_both_optimizers():
    cases = [c for cs in CASES.values() for c in cs if c[0] not in _KIN]
    for kw in {tuple(sorted(c[1].items())) for c in cases}:
        assert {optimizer_of(n, k) for n, k in cases if tuple(sorted(k.items())) == kw} == set(OPTIMIZERS), kw
    for m in ("gpt2", "llama", *(k for k in _KIN if len(_KIN[k]) > 1)):
        assert {optimizer_of(n, k) for n, k in CASES[2] + cases if n == m} == set(OPTIMIZERS), m


def _round_trip(kw, src, dst):
    engine = ck.boost(make("gpt2"), OPTIMIZERS["sgd"], ck.ParallelConfig(**kw))
    for s in range(2):
        engine.train_step(DATA.batch(s, BATCH))
    ck.save_pretrained(engine, dst)
    fresh = ck.boost(make("gpt2"), OPTIMIZERS["sgd"], ck.ParallelConfig(**kw))
    before = fresh.evaluate(DATA.batch(5, BATCH))
    read = ck.load_pretrained(fresh, src)
    return engine.evaluate(DATA.batch(5, BATCH)), before, fresh.evaluate(DATA.batch(5, BATCH)), read


def test_save_pretrained_and_load_pretrained_round_trip(tmp_path):
    """Two SGD steps under tp=2 and under pp=2, saved; transformers' own from_pretrained reads each directory
    with logits equal to the one-process model's after the same steps; and an engine loads that model's own
    save_pretrained directory to its loss (an untrained engine's loss differs), each rank reading at most
    60% of the file's elements (its rectangles: a tp=2 rank about half, a pp=2 stage its own layers)."""
    ref = make("gpt2")
    optimizer = OPTIMIZERS["sgd"](ref.parameters())
    for s in range(2):
        loss = plain_loss(ref, *DATA.batch(s, BATCH))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    src = tmp_path / "plain"
    ref.save_pretrained(src)
    x, y = DATA.batch(5, BATCH)
    with torch.no_grad():
        want_logits, want = ref(x).logits, plain_loss(ref, x, y).item()
    for kw in (dict(tp=2), dict(pp=2, microbatches=2)):
        dst = tmp_path / "-".join(f"{k}{v}" for k, v in kw.items())
        ranks = ck.launch(_round_trip, ck.ParallelConfig(**kw).world_size, kw, str(src), str(dst))
        trained, untrained, loaded, _ = ranks[0]
        total = sum(p.numel() for p in ref.parameters())
        assert all(0 < read <= 0.6 * total for *_, read in ranks), ([r[-1] for r in ranks], total)
        back = transformers.GPT2LMHeadModel.from_pretrained(dst)
        with torch.no_grad():
            assert torch.allclose(back(x).logits, want_logits, rtol=1e-5, atol=1e-5)
        assert abs(trained - want) <= 1e-5 * want and abs(loaded - want) <= 1e-5 * want
        assert abs(untrained - want) > 1e-3 * want


def test_refused_in_the_kernel():
    from colab_kit.engine.facts import ModelFacts
    from colab_kit.engine.parts import first_refusal

    # the planner knows the sequence: a window shorter than it is refused under sp and pp (boost, which does not
    # know it yet, checks the first batch: test_the_first_step_reserves_... below)
    facts = ModelFacts.of(make("mistral-window"), seq=16)
    why = str(first_refusal(ck.ParallelConfig(sp=2), facts))
    assert "sp=2 with MistralForCausalLM: its attention looks back at most 8 tokens" in why and \
        "set the config's sliding_window=None" in why, why
    assert "pp=2 with MistralForCausalLM: its attention looks back" in str(
        first_refusal(ck.ParallelConfig(pp=2, microbatches=2), facts))
    assert first_refusal(ck.ParallelConfig(sp=2), ModelFacts.of(make("mistral-window"), seq=8)) is None
    with pytest.raises(ck.ConfigError, match=r"tp=2 needs a sharding policy for GPTNeoXForCausalLM"):
        ck.boost(make("neox"), OPTIMIZERS["sgd"], ck.ParallelConfig(tp=2))
    with pytest.raises(ck.ConfigError, match=r"n_heads=4, n_kv_heads=2 not divisible by 8: tp_mode='1d'"):
        ck.boost(make("llama"), OPTIMIZERS["sgd"], ck.ParallelConfig(tp=8))
    with pytest.raises(ck.ConfigError, match=r"n_kv_heads=2 not divisible by 4: tp_mode=.1d."):
        ck.boost(make("llama"), OPTIMIZERS["sgd"], ck.ParallelConfig(tp=4))


def _offload_refusal():
    """Llama under dp=2 ZeRO-3 with offload='auto': a budget far below one step, then room for everything. And
    Mistral with a window of 8 under sp=2: 16-token sequences refused at the first step, 8-token ones trained."""
    window = ck.boost(make("mistral-window"), OPTIMIZERS["sgd"], ck.ParallelConfig(sp=2))
    try:
        window.train_step(DATA.batch(0, BATCH))
        long = "trained"
    except ValueError as e:
        long = str(e)
    x, y = DATA.batch(0, BATCH)
    short = window.train_step((x[:, :8], y[:, :8]))
    window.close()
    config = ck.ParallelConfig(dp=2, zero=3, offload="auto")
    try:
        ck.boost(make("llama"), OPTIMIZERS["adamw"], config, device_budget=50_000).train_step(DATA.batch(0, BATCH))
        refused = None
    except ck.ConfigError as exc:
        refused = str(exc)
    engine = ck.boost(make("llama"), OPTIMIZERS["adamw"], config, device_budget=1 << 40)
    losses = [engine.train_step(DATA.batch(s, BATCH)) for s in range(STEPS)]
    return refused, engine.memory()["activations"], losses, long, short


def test_the_first_step_reserves_a_hf_models_activations_and_checks_its_window():
    """The device account of offload='auto' holds the step's activations from the first step on, for a model
    without a built-in config too (estimated from its dense forward traced on fake tensors): a budget that
    cannot hold one step is refused before the step runs, naming the activations it needs (0 B before, and the
    step ran, to fail at the second). With room, the same run trains as one process does. Mistral with a window
    of 8 under sp=2: boost cannot know the sequence; the first batch of 16 tokens is refused, 8 tokens train."""
    import re

    (refused, measured, losses, long, short), _ = ck.launch(_offload_refusal, 2)
    assert long.startswith("sequences of 16 tokens with sp=2: the model's attention looks back at most 8 tokens"), long
    assert short > 0
    assert refused is not None and "too small for one step" in refused, refused
    acts = int(re.search(r"the activations \(([\d,]+) B\)", refused).group(1).replace(",", ""))
    assert 0.5 * measured <= acts <= 1.5 * measured, (acts, measured)
    assert losses == pytest.approx(reference("llama", "adamw"), rel=1e-5)
