"""A batch is checked before a step splits it (``colab_kit/engine/batch.py``): what torch refuses in one
process is refused under the engine too, with the rule and what would work. Under tp=2 (here) the
vocabulary-parallel embedding and loss would otherwise train on ids no rank owns, and on -1 targets as class 0,
with no error. One spawn of 2 ranks; every refusal the same on both."""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)


def _batch():
    x, y = SyntheticTokens(64, 16, seed=1).batch(0, 4)
    return x.clone(), y.clone()


def _refusals():
    torch.manual_seed(0)
    engine = ck.boost(GPT(CFG), lambda ps: torch.optim.SGD(ps, lr=0.1), ck.ParallelConfig(tp=2))
    cases = {}
    x, y = _batch()
    y[0, 5] = -1  # nanoGPT's ignore
    cases["minus one"] = (x, y)
    x, y = _batch()
    y[0, 5] = 64
    cases["past the classes"] = (x, y)
    x, y = _batch()
    cases["float targets"] = (x, y.float())
    x, y = _batch()
    x[1, 2] = 200
    cases["id past the vocabulary"] = (x, y)
    x, y = _batch()
    cases["a tensor"] = x
    cases["short targets"] = (x, y[:, :8])
    cases["fewer rows"] = (x, y[:2])
    out = {}
    for name, batch in cases.items():
        try:
            engine.train_step(batch)
            out[name] = "trained"
        except ValueError as e:
            out[name] = str(e)
    x, y = _batch()
    y[:, :4] = -100  # ignored, as torch's cross_entropy ignores it
    out["ignored"] = engine.evaluate((x, y))
    out["ignored step"] = engine.train_step((x, y))  # the same loss, then a step: -100 passes the checks
    y[0, 5] = -1
    try:
        engine.evaluate((x, y))
        out["evaluate minus one"] = "evaluated"
    except ValueError as e:
        out["evaluate minus one"] = str(e)
    engine.close()
    return out


def test_bad_batches_are_refused_before_the_step_and_ignored_targets_count_as_torchs():
    results = ck.launch(_refusals, 2)
    assert results[0] == results[1]
    r = results[0]
    assert "targets hold -1 (row 0, position 5)" in r["minus one"] and "0..63, or -100" in r["minus one"] \
        and "nanoGPT's -1 is -100 here" in r["minus one"], r["minus one"]
    assert r["past the classes"].startswith("targets hold 64 (row 0, position 5)"), r["past the classes"]
    assert "class ids as targets, got torch.float32" in r["float targets"], r["float targets"]
    assert r["id past the vocabulary"].startswith("inputs hold id 200 (row 1, position 2), outside the vocabulary "
                                                  "0..63"), r["id past the vocabulary"]
    assert r["a tensor"].startswith("a batch is a pair (inputs, targets), got a tensor of shape (4, 16)"), r["a tensor"]
    assert "one id per input token" in r["short targets"], r["short targets"]
    assert "one row per example, got inputs (4, 16) and targets (2, 16)" in r["fewer rows"], r["fewer rows"]
    torch.manual_seed(0)
    x, y = _batch()
    y[:, :4] = -100
    want = torch.nn.functional.cross_entropy(GPT(CFG)(x).flatten(0, 1), y.flatten()).item()
    assert r["ignored"] == pytest.approx(want, rel=1e-5) and r["ignored step"] == pytest.approx(want, rel=1e-5)
    assert r["evaluate minus one"].startswith("targets hold -1 (row 0, position 5)"), r["evaluate minus one"]
