"""``ck.parallelize``: the ordered list of steps, printed for every config the parity matrix runs.

Run with ``-s`` to see each config's list. The order is ``engine.parts.PARTS``, written once (``STEPS``: the
names of the parts with a step); each step is there exactly when the config asks for it (the rank tests
check that an engine took exactly these steps: ``test_every_composition_took_the_planned_steps_of_parallelize``).
"""
from __future__ import annotations

import inspect

import pytest

import colab_kit as ck
from colab_kit.engine import parallelize as par
from colab_kit.engine.parallelize import STEPS, plan_steps
from tests.helpers.matrix import MATRIX

CONFIGS = [(f"{w}-{n}", kw) for w, cs in MATRIX.items() for n, kw in cs.items()] + [
    ("1 rank", {}), ("dp=4", dict(dp=4)), ("dp=2 tp=2 bf16", dict(dp=2, tp=2, precision="bf16")),
    ("dp=2 zero=3 offload auto", dict(dp=2, zero=3, offload="auto"))]


@pytest.mark.parametrize("name,kw", CONFIGS, ids=[n.replace(" ", "") for n, _ in CONFIGS])
def test_the_steps_of_each_config_in_order(name, kw):
    cfg = ck.ParallelConfig(**kw)
    steps = plan_steps(cfg)
    print(f"{name:34s} {' -> '.join(steps)}")
    assert list(steps) == sorted(steps, key=STEPS.index), "out of STEPS' order"
    assert ("tensor" in steps) == (cfg.tp > 1) and ("sequence" in steps) == (cfg.sp > 1)
    assert ("pipeline_split" in steps) == (cfg.pp > 1) and ("recompute" in steps) == (cfg.recompute != "none")
    assert ("precision" in steps) == (cfg.precision != "fp32")
    assert {"defer_init", "materialize", "placements", "broadcast", "data_parallel"} <= set(steps)
    assert "dropout" not in steps and "dropout" in plan_steps(cfg, dropout=True)


def test_the_order_is_written_once_in_the_parts():
    """``parallelize`` is a loop over ``engine.parts.PARTS``: no step's name appears in its body, ``STEPS`` is the
    parts' names with a step, and each part's ``wants`` is what ``plan_steps`` reads (a part that wanted
    another config's field would be caught by the per-config checks above)."""
    from colab_kit.engine.parts import PARTS
    src = inspect.getsource(par.parallelize)
    assert not [s for s in STEPS if f'"{s}"' in src and s != "dropout"], "a step named in parallelize's body"
    assert list(STEPS) == [p.name for p in PARTS if p.apply is not None]
    assert [p.name for p in PARTS][:2] == ["policy", "defer_init"] and PARTS[0].apply is None


def test_parallelize_fits_on_one_screen():
    """One screen: the list of steps, not their insides (each is an ``apply_<what>`` of its part)."""
    lines = inspect.getsource(par.parallelize).splitlines()
    assert len(lines) <= 70, len(lines)


def test_the_end_of_the_step_is_a_list_of_the_parts_hooks():
    """``engine.finish.end_step`` runs the parts' hooks stage by stage in the parts' order: tied sums (pipeline)
    before the sums over what tp and sp replicate (placements), the router bias (expert) before ZeRO's
    all-gather (data parallel); ``describe`` marks the hooks a config leaves idle."""
    from colab_kit.engine.parts import HOOKS, hooks
    from colab_kit.engine.step import describe
    assert [n for n, _ in hooks("finish_grads")] == ["pipeline_split", "placements"]
    assert [n for n, _ in hooks("after_optimizer")] == ["expert", "data_parallel"]
    assert [n for n, _ in hooks("loss")] == ["expert"] and [n for n, _ in hooks("after_step")] == ["data_parallel"]
    assert [n for n, _ in hooks("microbatch")] == ["dropout", "expert"]
    assert HOOKS == ("microbatch", "loss", "finish_grads", "after_optimizer", "after_step")
    text = describe(ck.ParallelConfig(dp=2, tp=2, zero=3, offload="auto"))
    assert "finish_grads: pipeline_split (idle), placements\n" in text
    assert "after_step: data_parallel\n" in text and "loss: expert (idle)" in text
    assert "loss: expert\n" in describe(ck.ParallelConfig(dp=2, ep=2), moe=True)
    assert describe(ck.ParallelConfig(dp=2), dropout=True).startswith("microbatch: dropout, expert (idle)\n")


ENGINE_STEPS = {"defer_init", "materialize", "placements", "broadcast"}
"""The engine's own steps, declared in ``engine/parts.py``; every other part is declared in its folder."""


def test_each_part_is_declared_in_its_own_folder():
    """Adding a part touches its folder and one line of ``PARTS``: every parallel part is the ``PART`` of its
    folder's ``part.py``, whose step, hooks and rules are functions of that folder (no part's code in the
    engine), and every folder that declares a ``PART`` is in ``PARTS`` (a declared part left out is caught)."""
    import importlib
    import pkgutil

    from colab_kit.engine.parts import PARTS
    from colab_kit.part import Part
    declared = {}
    for info in pkgutil.iter_modules(ck.__path__):
        try:
            mod = importlib.import_module(f"colab_kit.{info.name}.part")
        except ModuleNotFoundError as e:
            if e.name != f"colab_kit.{info.name}.part":  # a part.py that fails to import fails here
                raise
            continue
        declared[info.name] = mod.PART
    assert len(declared) >= 9, sorted(declared)
    for p in PARTS:
        assert isinstance(p, Part)
        if p.name in ENGINE_STEPS:
            continue
        folder = next(f for f, d in declared.items() if d is p)  # StopIteration: a part declared outside a folder
        fns = [p.apply] * (p.apply is not None) + list(p.hooks.values()) + [r.check for r in p.rules]
        assert fns and all(f.__module__.startswith(f"colab_kit.{folder}.") for f in fns), p.name
    missing = [f for f, d in declared.items() if d not in PARTS]
    assert not missing, f"{missing} declare a PART that PARTS does not list"
