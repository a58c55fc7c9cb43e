"""The bytes ZeRO-3 with offload moves over PCIe a step, priced (``planner.cluster.terms.zero3_transfers``) and
counted by the engine's placement (``placement.last_transfers``), on 4 ranks.

Each host chunk's shard is staged to the device for each gather, forward and backward in every microbatch (the
tail, final norm and head, once), and each microbatch's reduced fp32 piece goes back; an MoE block's experts
are a chunk of their own over edp; ZeRO shards over dp x sp. The price is the engine's count, byte for byte,
in fp32 and bf16, with microbatches, experts and sp (within 3% under tp); a price that staged each shard once a
step (as ZeRO 1-2's parameters go up), or sharded over dp alone under sp, is off by 2x.
"""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig

DENSE = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
MOE = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4, top_k=2, d_expert=32,
                shared_experts=1)
CONFIGS = [("dense", dict(dp=4, zero=3, offload="cpu")), ("dense", dict(dp=4, zero=3, offload="cpu", microbatches=2)),
           ("dense", dict(dp=4, zero=3, offload="cpu", precision="bf16", recompute="full")),
           ("moe", dict(dp=4, ep=2, zero=3, offload="cpu")),
           ("dense", dict(dp=2, sp=2, zero=3, offload="cpu")),  # ZeRO shards over dp x sp
           ("dense", dict(dp=2, tp=2, zero=3, offload="cpu"))]
APPROX = {5: 0.03}  # tp: params_on_rank splits the norms and row biases every tp rank holds whole


def _counted(_) -> list[dict]:
    out = []
    for name, kw in CONFIGS:
        engine = ck.boost(GPT(DENSE if name == "dense" else MOE), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                          ck.ParallelConfig(**kw))
        data = SyntheticTokens(64, 16, seed=1)
        engine.train_step(data.batch(0, 8))
        engine.train_step(data.batch(1, 8))
        out.append(dict(engine.data_parallel.placement.last_transfers))
        engine.close()
    return out


@pytest.fixture(scope="module")
def counted():
    return ck.launch(_counted, 4, None, timeout=300)


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_the_price_moves_the_bytes_the_engine_moves(counted, i):
    from colab_kit.planner.cluster.price import price
    from colab_kit.planner.shape import ModelShape
    name, kw = CONFIGS[i]
    priced = price(ModelShape.of(DENSE if name == "dense" else MOE), ck.ParallelConfig(**kw), 8, "8xH100-SXM")
    for rank, per in enumerate(counted):
        moved = per[i]
        assert moved["to_device"] > 0, (kw, rank)
        for way, got in moved.items():
            assert priced.transfers[way] == pytest.approx(got, rel=APPROX.get(i, 1e-12)), (kw, rank, moved, priced)
    assert "offload" in priced.breakdown  # the time: what compute does not cover, its overlap assumed (docs)
