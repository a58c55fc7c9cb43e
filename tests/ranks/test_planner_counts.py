"""The planner's count of a step's dp collectives is what the engine sends: its buckets (``DataParallel``
fills about two, one where the ranks share the cores, ZeRO 2 about 2 dp), one all-reduce each, ZeRO 1/2's reduce-scatters (stage 2 without a
pipeline every microbatch) and gathers, ZeRO 3's gathers and reduce-scatters. Cost is tested like
correctness: a wrong bucket size or a missing microbatch changes the count. Under sequence parallelism the
reduction runs over dp x sp, recorded by the engine on ``dp_sp`` and counted by the planner under dp (one
collective a bucket: no second sum over sp)."""
from __future__ import annotations

import colab_kit as ck
from colab_kit.memory.estimator import config_estimate
from colab_kit.models import GPTConfig
from colab_kit.planner import EXAMPLE_CONSTANTS
from colab_kit.planner.local.comm import engine_buckets
from colab_kit.planner.local.step import step_seconds

SMALL = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=4)
CONFIGS = [dict(dp=4), dict(dp=4, zero=1), dict(dp=4, zero=2), dict(dp=4, zero=2, microbatches=2),
           dict(dp=2, tp=2), dict(dp=2, pp=2, microbatches=2, zero=2), dict(dp=4, zero=3),
           dict(dp=2, sp=2), dict(dp=2, sp=2, zero=2), dict(sp=4, zero=1), dict(dp=2, sp=2, zero=3)]


def _engine_counts(model_kwargs, configs):
    import torch

    from colab_kit.datasets import SyntheticTokens
    from colab_kit.models import GPT
    g = GPTConfig(**model_kwargs)
    data = SyntheticTokens(g.vocab_size, g.seq_len, seed=0)
    out = []
    for c in configs:
        engine = ck.boost(GPT(g), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ck.ParallelConfig(**c))
        engine.train_step(data.batch(0, 16))
        engine.train_step(data.batch(1, 16))
        dp = [r for r in engine.comm(last_step=True) if r["axis"] in ("dp", "dp_sp") and r["tag"] != "loss"]
        buckets = len(getattr(engine.data_parallel, "buckets", [])) if c.get("zero", 0) < 3 else None
        out.append((len(dp), buckets))
        engine.close()
    return out


def test_dp_collectives_and_buckets_are_the_engines():
    import dataclasses

    from colab_kit.launch import host_cores
    got = ck.launch(_engine_counts, 4, dataclasses.asdict(SMALL), CONFIGS)
    consts = dict(EXAMPLE_CONSTANTS, cores=host_cores())  # this machine (in CI 4 ranks share 2 cores), as constants() records it
    for i, c in enumerate(CONFIGS):
        cfg = ck.ParallelConfig(**c)
        mem = config_estimate(SMALL, cfg, 16, "adamw", host_share=None)
        _, _, counts = step_seconds(SMALL, cfg, 16, consts, mem, "adamw")
        fullest = max(range(4), key=lambda r: got[r][i][0])  # the fullest pipeline stage's rank
        records, buckets = got[fullest][i]
        assert counts.get("dp", 0) == records, (c, counts, records)
        if buckets is not None:
            assert engine_buckets(SMALL, cfg, host_cores() < 4)[1] == buckets, (c, buckets)
