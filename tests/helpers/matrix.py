"""The compositions of the parity matrix (``tests/ranks/test_parity_matrix.py``), shared with the test that
prints the steps ``parallelize`` takes for each (``tests/unit/test_parallelize.py``)."""
from __future__ import annotations

from colab_kit.models import GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
STEPS, BATCH, RTOL = 3, 8, 1e-5
PP = dict(pp=2, microbatches=4)

MATRIX = {
    4: {
        "ulysses x dp": dict(dp=2, sp=2, sp_mode="ulysses"),
        "ulysses x pp": dict(sp=2, sp_mode="ulysses", **PP, schedule="1f1b"),
        "ulysses x dp x zero=2": dict(dp=2, sp=2, sp_mode="ulysses", zero=2),
        "ulysses x dp x zero=3": dict(dp=2, sp=2, sp_mode="ulysses", zero=3),
        "ulysses x tp recompute": dict(tp=2, sp=2, sp_mode="ulysses", recompute=True),
        "ring x pp": dict(sp=2, **PP, schedule="1f1b"),
        "ring x dp recompute": dict(dp=2, sp=2, recompute=True),
        "zero=1 x gpipe": dict(dp=2, **PP, schedule="gpipe", zero=1),
        "zero=2 x interleaved": dict(dp=2, **PP, schedule="interleaved", chunks=2, zero=2),
        "zero=1 x zb-h1": dict(dp=2, **PP, schedule="zb-h1", zero=1),
        "zero=2 x zb-v": dict(dp=2, **PP, schedule="zb-v", chunks=2, zero=2),
        "zero=2 offload x 1f1b": dict(dp=2, **PP, schedule="1f1b", zero=2, offload="cpu"),
        "2d recompute": dict(tp=4, tp_mode="2d", recompute=True),
        "split_gather recompute": dict(dp=2, tp=2, sp_mode="split_gather", recompute=True),
        "zb-v recompute x dp": dict(dp=2, **PP, schedule="zb-v", chunks=2, recompute=True),
        "gpipe x tp recompute": dict(tp=2, **PP, schedule="gpipe", recompute=True),
        "interleaved x tp": dict(tp=2, **PP, schedule="interleaved", chunks=2),
        "zb-v x tp": dict(tp=2, **PP, schedule="zb-v", chunks=2),
        "split_gather x pp": dict(tp=2, sp_mode="split_gather", **PP, schedule="1f1b"),
        "split_gather x dp x zero=2": dict(dp=2, tp=2, sp_mode="split_gather", zero=2),
        "ulysses x dp x zero=3 offload": dict(dp=2, sp=2, sp_mode="ulysses", zero=3, offload="cpu"),
        "2d selective": dict(tp=4, tp_mode="2d", recompute="selective"),
        "interleaved x tp selective": dict(tp=2, **PP, schedule="interleaved", chunks=2, recompute="selective"),
    },
    8: {
        "3d recompute": dict(tp=8, tp_mode="3d", recompute=True),
        "2.5d recompute": dict(tp=8, tp_mode="2.5d", tp_depth=2, recompute=True),
        "2d x pp": dict(tp=4, tp_mode="2d", **PP, schedule="1f1b"),
        "2d x dp x zero=2": dict(dp=2, tp=4, tp_mode="2d", zero=2),
        "ulysses x dp x tp": dict(dp=2, tp=2, sp=2, sp_mode="ulysses"),
        "ring x dp x pp x zero=1": dict(dp=2, sp=2, **PP, schedule="1f1b", zero=1),
        "ulysses x dp x pp recompute": dict(dp=2, sp=2, sp_mode="ulysses", **PP, schedule="zb-h1", recompute=True),
        "3d selective": dict(tp=8, tp_mode="3d", recompute="selective"),
        "2.5d selective": dict(tp=8, tp_mode="2.5d", tp_depth=2, recompute="selective"),
    },
}
