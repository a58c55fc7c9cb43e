"""The compositions the README names, each against one plain PyTorch process (fp32, 1e-5 relative).

The per-mode files test each mode alone and with its usual partners; this matrix covers the compositions
they leave out, so that "every configuration that runs trains to one process's losses" is measured, not
assumed: Ulysses with dp, pp, ZeRO and recomputation; ring with pp and recomputation; ZeRO 1-2 under every
pipeline schedule (GPipe, interleaved, ZB-H1, ZB-V) and ZeRO-2 offload under a pipeline; recomputation with
2D, 2.5D, 3D, split_gather and ZB-V; 2D with pp and with dp x ZeRO-2; Ulysses inside dp x tp; split_gather
with pp and ZeRO; tp with the interleaved and ZB-V schedules.

One spawn per world size (4 and 8 ranks), every config looped inside it, 3 steps of a 4-block GPT; the
compositions alternate between AdamW and SGD with momentum (``optimizer_of``), so each optimizer runs under
half of them at every world size (the per-mode files run both under every mode). The reference trains the same torch optimizer on the same batches in this process
(``colab_kit.engine.reference.train_single_process``: ``GPT``, ``F.cross_entropy``, ``backward``, ``step``, nothing of
the engine's); a run whose updates were wrong would differ from step 2 on, and the check below shows that
the reference's own steps 2-3 move the loss by far more than the tolerance.
"""
from __future__ import annotations

import functools

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT
from colab_kit.engine.reference import max_relative_difference, train_single_process

from colab_kit.engine.parallelize import plan_steps
from tests.helpers.matrix import BATCH, CFG, MATRIX, RTOL, STEPS

OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)}


def _data():
    return SyntheticTokens(CFG.vocab_size, CFG.seq_len, seed=3)


def optimizer_of(world: int, name: str) -> str:
    """The optimizer a composition trains with: AdamW and SGD + momentum by turns, in the matrix's order."""
    return list(OPTIMIZERS)[list(MATRIX[world]).index(name) % len(OPTIMIZERS)]


def _run(world: int) -> dict:
    """On each rank: every config of this world size, one after the other."""
    out = {}
    for name, kw in MATRIX[world].items():
        opt = optimizer_of(world, name)
        engine = ck.boost(GPT(CFG), OPTIMIZERS[opt], ck.ParallelConfig(**kw))
        data = _data()
        out[name, opt] = [engine.train_step(data.batch(s, BATCH)) for s in range(STEPS)]
        out["steps", name] = engine.parts.steps
        engine.close()
    return out


@functools.lru_cache(maxsize=None)
def reference(opt: str, frozen: bool = False) -> list[float]:
    factory = (lambda ps: OPTIMIZERS[opt](ps) if not frozen else torch.optim.SGD(ps, lr=0.0))
    return train_single_process(CFG, factory, _data(), STEPS, BATCH)[0]


@pytest.fixture(scope="module")
def runs():
    return {world: ck.launch(_run, world, world, timeout=600) for world in MATRIX}


def test_the_reference_moves_by_far_more_than_the_tolerance():
    """A run that computed no update (or a wrong one) differs from the reference from step 2 on."""
    frozen = reference("sgd", frozen=True)
    for opt in OPTIMIZERS:
        assert frozen[0] == pytest.approx(reference(opt)[0], rel=1e-7)       # step 1: the same untrained model
        assert max_relative_difference(reference(opt)[1:], frozen[1:]) > 100 * RTOL


@pytest.mark.parametrize("world,name", [(w, n) for w, cs in MATRIX.items() for n in cs],
                         ids=[f"{w}-{n.replace(' ', '')}" for w, cs in MATRIX.items() for n in cs])
def test_composition_trains_like_one_process(runs, world, name):
    opt = optimizer_of(world, name)
    want = reference(opt)
    for rank, got in enumerate(runs[world]):
        diff = max_relative_difference(got[name, opt], want)
        assert diff <= RTOL, (name, opt, MATRIX[world][name], rank, diff, got[name, opt], want)


def test_both_optimizers_run_at_every_world_size():
    for world, cases in MATRIX.items():
        assert {optimizer_of(world, name) for name in cases} == set(OPTIMIZERS), world


def test_every_composition_took_the_planned_steps_of_parallelize(runs):
    """What ``parallelize`` ran on every rank is ``plan_steps(config)``, in its order (the list the unit test prints)."""
    for world, configs in MATRIX.items():
        for name, kw in configs.items():
            want = plan_steps(ck.ParallelConfig(**kw))
            assert want[:1] == ("defer_init",) and want[-1] == "data_parallel", want
            for rank, got in enumerate(runs[world]):
                assert got["steps", name] == want, (name, rank)
