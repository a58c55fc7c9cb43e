"""What full recomputation replays of the tensor-parallel collectives, run by the engine and priced
(``planner.cluster.stack.replayed_by_full``), on 4 ranks.

torch's non-reentrant checkpoint stops once the last tensor backward needs is rebuilt (fc2's input). In 1D tp
that leaves fc2's all-reduce out (one of a block's two forward all-reduces replayed), under split_gather its
reduce-scatter (three of four), while a 2D (SUMMA) block's GEMMs are autograd Functions that save only once their
whole forward ran: every broadcast is replayed. The engine's records a step, full against none, equal the
price's counts; a price that replayed everything (6 a 1D block) or only the attention's in 2D would miss them.
At tp > 1 the last GEMM itself is a Function too (``RowLinear``): it runs again, so no GEMM is left out
(its FLOPs counted here).
"""
from __future__ import annotations

import collections

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
LAYOUTS = {"1d": dict(dp=2, tp=2), "split_gather": dict(dp=2, tp=2, sp_mode="split_gather"),
           "2d": dict(tp=4, tp_mode="2d")}
# the block collectives the price counts, by the engine's record tags (forward and backward)
COUNTED = {"1d": ("g forward", "f backward"),
           "split_gather": ("sp gather forward", "sp reduce-scatter forward", "sp gather backward",
                            "sp reduce-scatter backward"),
           "2d": ("SUMMA A", "SUMMA B")}


def _records(_) -> dict:
    from torch.utils.flop_counter import FlopCounterMode
    out = {}
    for name, kw in LAYOUTS.items():
        for mode in ("none", "full"):
            engine = ck.boost(GPT(CFG), lambda ps: torch.optim.SGD(ps, lr=0.1), ck.ParallelConfig(recompute=mode, **kw))
            with FlopCounterMode(display=False) as flops:
                engine.train_step(SyntheticTokens(64, 16, seed=1).batch(0, 8))
            out[name, mode] = collections.Counter(r.get("tag") for r in engine.comm(last_step=True))
            out[name, mode, "flops"] = flops.get_total_flops()
            if name == "1d" and mode == "none":  # one block's forward on this rank: 4 rows of the dp shard
                with torch.no_grad(), FlopCounterMode(display=False) as block:
                    engine.module.blocks[0](torch.randn(4, 16, CFG.d_model))
                out["block"] = block.get_total_flops()
            engine.close()
    return out


@pytest.fixture(scope="module")
def records():
    return ck.launch(_records, 4, None, timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_full_recomputation_replays_what_the_price_counts(records, name):
    from colab_kit.planner.cluster.price import price
    from colab_kit.planner.cluster.stack import STACKS, replayed_by_full
    from colab_kit.planner.shape import ModelShape
    priced = {m: price(ModelShape.of(CFG), ck.ParallelConfig(recompute=m, **LAYOUTS[name]), 8, "8xA100-80GB")
              for m in ("none", "full")}
    want = priced["full"].collectives["tp"] - priced["none"].collectives["tp"]
    for rank, got in enumerate(records):
        extra = sum(got[name, "full"][t] - got[name, "none"][t] for t in COUNTED[name])
        assert extra == want > 0, (name, rank, extra, want)
    left_out, share = replayed_by_full(ck.ParallelConfig(**LAYOUTS[name]), STACKS["colab_kit"])
    assert not left_out and share == {"1d": 0.5, "split_gather": 0.75, "2d": 1.0}[name]


def test_at_tp_2_the_last_gemm_runs_again(records):
    """``RowLinear`` (fc2 under 1D tp) is an autograd Function: early stop cannot leave its GEMM out, so full
    recomputation repeats every block's whole forward GEMMs, fc2's included (a plain ``nn.Linear`` fc2, at tp=1,
    is left out: tests/ranks/test_recompute.py)."""
    for rank, got in enumerate(records):
        extra = got["1d", "full", "flops"] - got["1d", "none", "flops"]
        assert extra == CFG.n_layers * got["block"] > 0, (rank, extra, got["block"])
