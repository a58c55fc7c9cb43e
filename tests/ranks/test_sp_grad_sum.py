"""Where ZeRO shards under sequence parallelism, run by the engine and priced (``Stack.zero_over``).

colab_kit's ZeRO shards over dp alone: the sp ranks of a dp coordinate hold the same shard, and after the dp
reduction each sums its gradients (ZeRO: its piece) over sp in one flat all-reduce (``tensor.plan.sync_grads``,
``zero/stage1.py``'s ``sum_slices``). The price of the "colab_kit" stack charges exactly that collective
(``terms.sp_grad_bytes``) and updates a shard of ``1 / dp``; Megatron-Core's and torchtitan's stacks reduce and
shard over dp x sp instead. On 4 ranks (dp=2, sp=2, Ulysses and the ring, ZeRO 0, 1 and 3): one such record a
step of the bytes the price counts, and the engine's optimizer states those of a ``1 / dp`` shard; a price that
sharded over dp x sp (as before) would charge neither.
"""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
CONFIGS = [dict(dp=2, sp=2, sp_mode=mode, zero=z) for mode in ("ulysses", "ring") for z in (0, 1, 3)]
MOE = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4, top_k=2)
MOE_CONFIGS = [dict(dp=2, sp=2, sp_mode="ulysses", zero=z) for z in (1, 3)]  # ep=1: the experts are dense


def _records(_) -> list:
    out = []
    for model, kw in [(CFG, kw) for kw in CONFIGS] + [(MOE, kw) for kw in MOE_CONFIGS]:
        engine = ck.boost(GPT(model), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ck.ParallelConfig(**kw))
        for step in range(2):
            engine.train_step(SyntheticTokens(64, 16, seed=1).batch(step, 8))
        sums = [(r["op"], r["bytes"]) for r in engine.comm(last_step=True)
                if r.get("axis") == "sp" and r.get("tag") == "replicated grads"]
        out.append((sums, engine.memory()["optimizer"]))
        engine.close()
    return out


@pytest.fixture(scope="module")
def records():
    return ck.launch(_records, 4, None, timeout=300)


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[f"{c['sp_mode']}-zero{c['zero']}" for c in CONFIGS])
def test_the_sp_sum_is_what_the_price_charges(records, i):
    from colab_kit.memory.formulas import model_state_bytes
    from colab_kit.planner.cluster.hardware import HARDWARE
    from colab_kit.planner.cluster.price import price
    from colab_kit.planner.cluster.terms import optimizer_seconds, params_on_rank, sp_grad_bytes
    from colab_kit.planner.shape import ModelShape

    cfg, shape = ck.ParallelConfig(**CONFIGS[i]), ModelShape.of(CFG)
    want = sp_grad_bytes(params_on_rank(shape, cfg), cfg)
    for rank, per in enumerate(records):
        sums, optimizer = per[i]
        assert sums == [("all_reduce", want)], (rank, sums, want)
        if cfg.zero:  # the states of a 1 / dp shard (plus AdamW's step counters), not 1 / (dp sp)
            shard = model_state_bytes(shape.params, "adamw", "fp32", cfg.dp, cfg.zero)["optimizer"]
            assert abs(optimizer - shard) <= 0.01 * shard, (rank, optimizer, shard)
    hw = HARDWARE["8xA100-80GB"]
    ours = price(shape, cfg, 8, hw)
    folded = price(shape, cfg, 8, hw.with_stack(zero_over="dp+sp"))
    assert ours.collectives["sp"] == folded.collectives["sp"] + 1
    rank_params = params_on_rank(shape, cfg)  # the update of a 1 / dp shard (ZeRO 0: the whole), not 1 / (dp sp)
    assert ours.breakdown["optimizer"] == optimizer_seconds(rank_params, cfg, hw, "adamw", cfg.dp)
    assert folded.breakdown["optimizer"] == optimizer_seconds(rank_params, cfg, hw, "adamw", cfg.dp * cfg.sp)
    assert (ours.breakdown["optimizer"] > folded.breakdown["optimizer"]) == bool(cfg.zero)


@pytest.mark.parametrize("i", range(len(MOE_CONFIGS)), ids=[f"zero{c['zero']}" for c in MOE_CONFIGS])
def test_without_ep_the_experts_are_summed_and_sharded_as_dense(records, i):
    """ep=1: no expert step (``zero/apply.py``), so an MoE GPT's experts are dense parameters: reduced over dp,
    summed over sp with the rest, their states a 1 / dp shard. Priced and estimated so; the price of expert
    parallelism (experts over edp = dp sp, outside the sp sum) would miss the sum's bytes by the experts'."""
    from colab_kit.memory.estimator import config_estimate
    from colab_kit.planner.cluster.hardware import HARDWARE
    from colab_kit.planner.cluster.price import price
    from colab_kit.planner.cluster.terms import optimizer_seconds, sp_grad_bytes
    from colab_kit.planner.shape import ModelShape

    cfg, shape = ck.ParallelConfig(**MOE_CONFIGS[i]), ModelShape.of(MOE)
    want = sp_grad_bytes(shape.params, cfg)  # every parameter, tp = 1
    est = config_estimate(MOE, cfg, 8)["optimizer"]
    for rank, per in enumerate(records):
        sums, optimizer = per[len(CONFIGS) + i]
        assert sums == [("all_reduce", want)], (rank, sums, want)
        assert abs(optimizer - est) <= 0.01 * optimizer, (rank, optimizer, est)
    hw = HARDWARE["8xA100-80GB"]
    ours = price(shape, cfg, 8, hw)
    assert ours.collectives["sp"] == price(shape, cfg, 8, hw.with_stack(zero_over="dp+sp")).collectives["sp"] + 1
    assert ours.breakdown["optimizer"] == pytest.approx(optimizer_seconds(shape.params, cfg, hw, "adamw", cfg.dp))
