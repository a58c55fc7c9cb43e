"""``engine.fit(loader, steps, checkpoint=PATH, every=N)``: a rank killed at a random step, then the same
call started again continues from the last complete checkpoint to the losses of an uninterrupted run: with
``ck.launch`` on the same and on another number of ranks, and under torchrun ``--max-restarts``. (The
notebook's path, a dead engine then ``%colossal restart``, is in ``tests/cluster/test_magics.py``.)
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import colab_kit as ck
from colab_kit.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
STEPS, EVERY = 8, 2  # a checkpoint every EVERY steps, so that a restart has several to resume from
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "torchrun_fit.py"


def _data():
    x, y = ck.datasets.SyntheticTokens(64, 16, seed=3).batch(0, 64)
    return [(x[i], y[i]) for i in range(64)]


def _run(words, path, die=None):
    import torch.distributed as dist
    cfg = ck.ParallelConfig.parse(words)
    engine = ck.boost(GPT(CFG), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), cfg)
    loader = engine.loader(_data(), 8, seed=0)

    def on_step(eng, loss):
        if die is not None and dist.get_rank() == 1 and eng.step_count == die:
            os._exit(17)

    ran = engine.fit(loader, STEPS, checkpoint=path, every=EVERY if path else None, on_step=on_step)
    out = list(engine.history), len(ran)
    engine.close()
    return out


@pytest.fixture(scope="module")
def uninterrupted():
    whole, ran = ck.launch(_run, 2, "dp=2", None)[0]
    assert ran == STEPS and len(whole) == STEPS
    return whole


def test_fit_survives_a_dead_rank_on_the_same_and_another_number_of_ranks(tmp_path, uninterrupted):
    whole = uninterrupted
    for words, world in (("dp=2", 2), ("dp=4", 4)):
        path = str(tmp_path / words.replace("=", ""))
        die = random.randrange(2, STEPS)  # a random step; a failure names it
        with pytest.raises(ck.RankError, match="rank 1 exited with code 17"):
            ck.launch(_run, 2, "dp=2", path, die)
        saved = (die - 1) // EVERY * EVERY  # the last complete save before the death
        if saved == 0:  # it died before the first save: nothing to resume, the run starts again from step 0
            with pytest.raises(ck.checkpoint.CheckpointError, match="no checkpoint at"):
                ck.checkpoint.check(path)
        else:
            assert ck.checkpoint.check(path)["step"] == saved, die
        history, ran = ck.launch(_run, world, words, path)[0]
        assert ran == STEPS - saved, (die, saved)
        assert history == pytest.approx(whole, rel=1e-5), (words, die)
    # a finished run started again runs nothing
    history, ran = ck.launch(_run, 2, "dp=2", path)[0]
    assert ran == 0 and history == pytest.approx(whole, rel=1e-5)


def test_fit_refuses_bad_arguments_before_training():
    from colab_kit.engine.fit import fit
    engine = object.__new__(ck.Engine)
    with pytest.raises(ValueError, match="steps is the step count to reach"):
        fit(engine, None, -1)
    with pytest.raises(ValueError, match="every must be a positive number of steps"):
        fit(engine, None, 4, every=0, checkpoint="x")
    with pytest.raises(ValueError, match=r"give fit\(\.\.\., checkpoint=PATH\) too"):
        fit(engine, None, 4, every=2)
    with pytest.raises(TypeError, match="a loader whose position a checkpoint can keep"):
        fit(engine, [1, 2], 4)


def test_torchrun_max_restarts_resumes_from_the_last_checkpoint(tmp_path, uninterrupted):
    whole = uninterrupted
    die = random.randrange(3, STEPS)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "--max-restarts=1", str(SCRIPT), str(tmp_path / "ck"), "dp=2", str(STEPS), str(EVERY),
                          str(die)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["restart"] == 1 and got["resumed_from"] == (die - 1) // EVERY * EVERY, (die, got)
    assert got["history"] == pytest.approx(whole, rel=1e-5), die
