"""Data parallelism and ZeRO over dp x sp (``zero.reduction_axis``), run by the engine, estimated and priced.

The sp ranks of a dp coordinate hold the same weights, each the gradient of its own tokens. The engine reduces
over the ``dp_sp`` group: the sum over sp joins the mean over dp in the collective data parallelism runs anyway
(an all-reduce at ZeRO 0, reduce-scatters at 1-3), and ZeRO keeps a ``1 / (dp sp)`` shard, as Megatron-Core's
distributed optimizer (dp x cp) and torchtitan's FSDP (dp_shard x cp) do. On 4 ranks (dp=2, sp=2, Ulysses and
the ring, ZeRO 0-3, and an MoE GPT at ep=1, whose experts are dense parameters), every rank:

- runs no all-reduce of gradients over sp (the separate, exposed "replicated grads" sum the engine ran before)
  and reduces every gradient element once over ``dp_sp`` (fp32: 4 bytes an element, padding aside);
- holds the optimizer states of a ``1 / (dp sp)`` shard (ZeRO >= 1), what ``config_estimate`` and
  ``engine.memory_estimate()`` say, ``sp`` times less than a ``1 / dp`` shard;
- trains to the losses of ``dp=4`` on the same batches (one process's losses: the parity matrix).

The cluster price charges the update of a ``1 / (dp sp)`` shard and no sp collective beyond attention's.
"""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
MOE = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4, top_k=2)
CONFIGS = ([(CFG, dict(dp=2, sp=2, sp_mode=mode, zero=z)) for mode in ("ulysses", "ring") for z in (0, 1, 2, 3)]
           + [(MOE, dict(dp=2, sp=2, sp_mode="ulysses", zero=z)) for z in (1, 3)])  # ep=1: the experts are dense
REFERENCE = {id(CFG): dict(dp=4), id(MOE): dict(dp=4)}
IDS = [f"{'moe' if m is MOE else 'gpt'}-{c['sp_mode']}-zero{c['zero']}" for m, c in CONFIGS]


def _run(model, kw) -> dict:
    torch.manual_seed(0)
    engine = ck.boost(GPT(model), lambda ps: torch.optim.AdamW(ps, lr=1e-2), ck.ParallelConfig(**kw))
    losses = [engine.train_step(SyntheticTokens(64, 16, seed=1).batch(step, 8)) for step in range(3)]
    records = engine.comm(last_step=True)
    out = dict(losses=losses, optimizer=engine.memory()["optimizer"],
               estimate=engine.memory_estimate()["optimizer"],
               sp_sums=[r for r in records if r.get("axis") == "sp" and r.get("tag") == "replicated grads"],
               reduced=sum(r["bytes"] for r in records if r.get("axis") == "dp_sp"
                           and r["op"] in ("all_reduce", "reduce_scatter")),
               params=sum(p.numel() for p in GPT(model).parameters()))
    engine.close()
    return out


def _records(_) -> tuple[list, dict]:
    return [_run(m, kw) for m, kw in CONFIGS], {k: _run(m, REFERENCE[id(m)]) for k, m in (("gpt", CFG), ("moe", MOE))}


@pytest.fixture(scope="module")
def records():
    return ck.launch(_records, 4, None, timeout=300)


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=IDS)
def test_one_reduction_over_dp_sp_and_a_shard_of_one_over_dp_sp(records, i):
    from colab_kit.memory.estimator import config_estimate
    from colab_kit.memory.formulas import model_state_bytes

    model, kw = CONFIGS[i]
    cfg = ck.ParallelConfig(**kw)
    for rank, (runs, ref) in enumerate(records):
        got, want = runs[i], ref["moe" if model is MOE else "gpt"]
        assert got["sp_sums"] == [], (rank, got["sp_sums"])
        # every element reduced once in fp32 (ZeRO-3: its chunks, each padded to a multiple of 4 elements)
        assert 4 * got["params"] <= got["reduced"] <= 4 * got["params"] + 4 * 4 * 8, (rank, got["reduced"])
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), (rank, got["losses"], want["losses"])
        if cfg.zero:
            est = config_estimate(model, cfg, 8)["optimizer"]
            over_dp = model_state_bytes(got["params"], "adamw", "fp32", cfg.dp, cfg.zero)["optimizer"]
            assert abs(got["optimizer"] - est) <= 0.01 * est, (rank, got["optimizer"], est)
            assert abs(got["estimate"] - est) <= 0.01 * est, (rank, got["estimate"], est)
            assert got["optimizer"] < 0.6 * over_dp, (rank, got["optimizer"], over_dp)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_price_reduces_and_updates_over_dp_sp(zero):
    """By hand: the gradients' one reduction (ZeRO 0: all-reduce, 1-2: reduce-scatter, both over the group of
    dp x sp = 4 ranks, plus ZeRO 1-2's all-gather of a quarter back), the update of a quarter, and nothing
    priced over sp but attention's own collectives (those of ``dp=4 x sp=1``'s price have none)."""
    from colab_kit.planner.cluster import comm
    from colab_kit.planner.cluster.hardware import HARDWARE
    from colab_kit.planner.cluster.price import price
    from colab_kit.planner.cluster.terms import optimizer_seconds, params_on_rank
    from colab_kit.planner.shape import ModelShape

    cfg, shape, hw = ck.ParallelConfig(dp=2, sp=2, zero=zero), ModelShape.of(CFG), HARDWARE["8xA100-80GB"]
    ours = price(shape, cfg, 8, hw)
    rank_params = params_on_rank(shape, cfg)
    assert ours.breakdown["optimizer"] == optimizer_seconds(rank_params, cfg, hw, "adamw", cfg.dp * cfg.sp)
    group = comm.placement(cfg, "dp_sp", hw.gpus_per_node)
    assert group.size == 4
    if zero < 3:
        want = comm.seconds("all_reduce" if zero == 0 else "reduce_scatter", 4 * rank_params, group, hw)
        if zero:
            want += comm.seconds("all_gather", 4 * rank_params / 4, group, hw)
        assert ours.comm_total["dp"] == pytest.approx(want, rel=1e-12)
    no_sp = price(shape, cfg.replace(sp=1, dp=4), 8, hw)  # the same reduction over 4 ranks, no attention
    assert ours.collectives["dp"] == no_sp.collectives["dp"]
    assert ours.comm_total["dp"] == pytest.approx(no_sp.comm_total["dp"], rel=1e-12)
