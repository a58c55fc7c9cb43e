"""The MoE GPT under the engine without expert parallelism: dp (2 and 4 ranks), ZeRO 1-3, offload, 1F1B
pipelines and recomputation train to one process's losses within 1e-5 (fp32), the balancing loss, the
z-loss, a capacity's drops and the router bias computed over the whole batch of each microbatch
(``docs/moe.md``). One spawn per world size, every config looped inside it; AdamW and SGD + momentum by turns.
2D/3D tp, split_gather and a capacity under sp are refused with the rule before any process starts
(1D tp runs: tests/ranks/test_ep.py)."""
from __future__ import annotations

import pytest

import colab_kit as ck
from colab_kit.engine.core import unsupported
from colab_kit.engine.reference import max_relative_difference
from colab_kit.models import GPT
from tests.helpers.moe import BATCH, MODELS, OPTIMIZERS, RTOL, STEPS, data, reference

PP = dict(pp=2, schedule="1f1b")
CONFIGS = {  # name: (world, model, optimizer, ParallelConfig kwargs)
    "dp=2": (2, "softmax", "adamw", dict(dp=2)),
    "dp=2 capacity": (2, "capacity", "sgd", dict(dp=2)),
    "dp=2 zero=1 mb=2": (2, "softmax", "sgd", dict(dp=2, zero=1, microbatches=2)),
    "dp=2 zero=2 capacity": (2, "capacity", "adamw", dict(dp=2, zero=2)),
    "dp=2 zero=3 recompute": (2, "softmax", "sgd", dict(dp=2, zero=3, recompute=True)),
    "pp=2 1f1b mb=2": (2, "softmax", "adamw", dict(**PP, microbatches=2)),
    "pp=2 capacity recompute mb=2": (2, "capacity", "sgd", dict(**PP, microbatches=2, recompute=True)),
    "dp=4": (4, "softmax", "sgd", dict(dp=4)),
    "dp=4 capacity zero=2 offload": (4, "capacity", "adamw", dict(dp=4, zero=2, offload="cpu")),
    "dp=2 x pp=2 zero=1 mb=2": (4, "capacity", "adamw", dict(dp=2, zero=1, microbatches=2, **PP)),
}


def _run(names: list[str]) -> dict:
    out = {}
    for name in names:
        _, model, opt, kw = CONFIGS[name]
        engine = ck.boost(GPT(MODELS[model]), OPTIMIZERS[opt], ck.ParallelConfig(**kw))
        d = data()
        out[name] = [engine.train_step(d.batch(s, BATCH)) for s in range(STEPS)]
        engine.close()
    return out


@pytest.fixture(scope="module")
def runs():
    got = {}
    for world in sorted({w for w, *_ in CONFIGS.values()}):
        names = [n for n, (w, *_) in CONFIGS.items() if w == world]
        for rank, res in enumerate(ck.launch(_run, world, names, timeout=600)):
            for name, losses in res.items():
                got[name, rank] = losses
    return got


@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_trains_like_one_process(runs, name):
    world, model, opt, kw = CONFIGS[name]
    want = reference(model, opt, kw.get("microbatches", 1), dp=kw.get("dp", 1))
    for rank in range(world):
        diff = max_relative_difference(runs[name, rank], want)
        assert diff <= RTOL, (name, rank, diff, runs[name, rank], want)


def test_the_check_can_fail():
    """The reference moves by far more than the tolerance, and its auxiliary losses and microbatches count: a
    run that left them out, or took the balancing loss over the whole step, would be rejected."""
    for model in MODELS:
        for opt in ("adamw", "sgd"):
            moved = reference(model, opt)
            diffs = [max_relative_difference(reference(model, "frozen")[1:], moved[1:]),
                     max_relative_difference(reference(model, opt, aux=False), moved)]
            if model == "capacity":  # what a capacity drops depends on the microbatch's rows
                diffs.append(max_relative_difference(reference(model, opt, 2, dp=2), moved))
            assert min(diffs) > 10 * RTOL, (model, opt, diffs)


def test_capacity_under_sp_and_token_splitting_tp_are_refused_with_the_rule():
    model = GPT(MODELS["capacity"])
    for kw, fix in ((dict(tp=4, tp_mode="2d"), "tp_mode='1d' without split_gather"), (dict(dp=2, sp=2), "sp=1 (dp=4"),
                    (dict(tp=2, sp_mode="split_gather"), "tp_mode='1d' without split_gather")):
        why = unsupported(ck.ParallelConfig(**kw), model)
        assert why is not None and "mixture-of-experts" in why and fix in why, why
        with pytest.raises(ck.ConfigError, match="mixture-of-experts"):
            ck.boost(model, OPTIMIZERS["sgd"], ck.ParallelConfig(**kw))
    assert unsupported(ck.ParallelConfig(tp=2), GPT(ck.models.GPTConfig())) is None  # the dense GPT runs tp
    assert unsupported(ck.ParallelConfig(tp=2), model) is None  # 1D: the MoE layers whole on each tp rank
    assert unsupported(ck.ParallelConfig(sp=2), GPT(MODELS["softmax"])) is None  # dropless under sp runs
