"""The software stack in the at-scale price (``planner.cluster.stack``): each new term against its hand formula.

Elementwise passes by family and fusion, per-op selective recomputation, tp communication under its GEMMs,
ZeRO 1-2's parameter all-gather under the next forward, DeepSpeed 2021's per-tensor ZeRO-3 gathers; the
stacks as data (one object per node and stack, bad choices refused)."""
from __future__ import annotations

import dataclasses

import pytest

import colab_kit as ck
from colab_kit.config import ParallelConfig
from colab_kit.planner.cluster import comm as cluster_comm
from colab_kit.planner.cluster.hardware import HARDWARE
from colab_kit.planner.cluster.price import block_tensors, price
from colab_kit.planner.cluster.compute import gemm, block, elementwise, family, with_recompute
from colab_kit.planner.shape import ModelShape
from colab_kit.planner.cluster.stack import STACKS, Stack

A100, H100 = HARDWARE["8xA100-80GB"], HARDWARE["8xH100-SXM"]
LLAMA = ModelShape(32, 4096, 32, 128256, 8192, ffn=14336, kv_heads=8, gated=True, positions=False)
GPT = ModelShape(40, 6144, 48, 51200, 2048)
BF16 = ParallelConfig(precision="bf16")


def _stream(hw, values, kernels, size=2):
    return values * size / (hw.memory_bytes_per_s * hw.hbm_efficiency) + kernels * hw.kernel_seconds


# ---------------------------------------------------------------------------------------------- elementwise
@pytest.mark.parametrize("tp", [1, 4])
def test_llama_block_eager_and_fused_passes(tp):
    """Eager (HF's RMSNorm upcast, RoPE's slices, SwiGLU's two kernels, repeat_kv's copies) against fused."""
    cfg = ParallelConfig(tp=tp, precision="bf16")
    t, h, q, kv, f = 8192, 4096, 4096, 1024, 14336
    eager = elementwise(LLAMA, cfg, t, H100)
    fused = elementwise(LLAMA, cfg, t, H100.with_stack(elementwise="fused"))
    assert eager == pytest.approx(_stream(H100, t * (42 * h + (12 * q + 12 * kv + 5 * f + 2 * h) / tp), 33), rel=1e-12)
    assert fused == pytest.approx(_stream(H100, t * (10 * h + (2 * q + 2 * kv + 3 * f) / tp), 10), rel=1e-12)
    assert family(LLAMA) == "llama" and family(GPT) == "gpt"
    # without grouped heads nothing is copied per query head
    mha = dataclasses.replace(LLAMA, kv_heads=0)
    assert elementwise(mha, cfg, t, H100) == pytest.approx(
        _stream(H100, t * (42 * h + (10 * q + 10 * q + 5 * f + 2 * h) / tp), 33), rel=1e-12)


def test_gpt_block_fused_as_megatron_2021_and_eager_adds_dropout_and_residual_kernels():
    t, h = 16384, 6144
    fused = elementwise(GPT, BF16, t, A100.with_stack("megatron-lm-2021"))
    eager = elementwise(GPT, BF16, t, A100)
    shards = 2 * (3 * h + 4 * h + h)
    assert fused == pytest.approx(_stream(A100, t * (11 * h + shards), 12), rel=1e-12)
    assert eager == pytest.approx(_stream(A100, t * (15 * h + shards), 12), rel=1e-12)
    from colab_kit.planner.cluster.compute import core
    one, (attn_f, attn_b, _) = block(GPT, BF16, 8, 2048, A100), core(GPT, BF16, 8, 2048, A100)
    assert one.f == pytest.approx(one.gemms[0] + attn_f + eager, rel=1e-12)      # backward: twice the passes
    assert one.i + one.w == pytest.approx(one.gemms[1] + attn_b + 2 * eager, rel=1e-12)


# ---------------------------------------------------------------------------------------------- recompute="op"
def test_op_recomputation_repeats_every_second_matmul_and_every_elementwise_op():
    """torchtitan's per-op SAC: a gated block issues q, k, v, o, gate, up, down, and k, o, up run again; a GPT
    qkv, proj, fc1, fc2: proj (fc2's output is saved by nothing: torch's checkpoint stops before it). The
    attention kernel is kept, but ring attention's, which runs inside its own autograd function."""
    cfg = ParallelConfig(tp=2, precision="bf16", recompute="op")
    t, h = 8192, 4096
    c = block(LLAMA, cfg, 1, 8192, H100)
    again = (gemm(H100, "bf16", cfg, t, 1024, h, True)[0] + gemm(H100, "bf16", cfg, t, h, h, False)[0]
             + gemm(H100, "bf16", cfg, t, 14336, h, True)[0])
    assert c.op == pytest.approx(again + elementwise(LLAMA, cfg, t, H100), rel=1e-12)
    assert with_recompute(c, "op").rc == c.op
    g = block(GPT, cfg, 8, 2048, A100)
    gpt_again = gemm(A100, "bf16", cfg, 16384, 6144, 6144, False)[0]
    assert g.op == pytest.approx(gpt_again + elementwise(GPT, cfg, 16384, A100), rel=1e-12)
    ring = ParallelConfig(sp=2, precision="bf16", recompute="op")
    r = block(GPT, ring, 8, 2048, A100)
    assert r.op == pytest.approx(gemm(A100, "bf16", ring, 8192, 6144, 6144, False)[0]
                                 + elementwise(GPT, ring, 8192, A100) + r.attn, rel=1e-12)
    # the tp collectives: op replays attention's all-reduce; full the forward's two under a whole-forward
    # checkpoint (Megatron's), attention's one under torch's early stop (colab_kit's: fc2's is not replayed,
    # measured in tests/ranks/test_recompute.py)
    counts = {m: price(GPT, ParallelConfig(tp=8, precision="bf16", recompute=m), 8, A100).collectives["tp"]
              for m in ("none", "op", "full")}
    assert counts == {"none": 40 * 4, "op": 40 * 5, "full": 40 * 5}
    whole = A100.with_stack("megatron-lm-2021")
    assert price(GPT, ParallelConfig(tp=8, precision="bf16", recompute="full"), 8, whole).collectives["tp"] == 40 * 6
    # between selective and full, in a whole step too
    steps = {m: price(LLAMA, ParallelConfig(dp=64, zero=3, precision="bf16", recompute=m), 64, H100).step_seconds
             for m in ("none", "selective", "op", "full")}
    assert steps["none"] < steps["selective"] < steps["op"] < steps["full"], steps


def test_full_recomputation_under_torchs_early_stop_leaves_the_last_gemm_out():
    """torch's non-reentrant checkpoint (``Stack.checkpoint="early_stop"``) stops once the last tensor backward
    needs is rebuilt. A GPT block's fc2 (a Llama block's down) is left out where it is a plain module's GEMM
    (colab_kit without tp, the engine's FLOPs in tests/ranks/test_recompute.py; torchtitan's DTensor modules);
    colab_kit's tp layers are autograd Functions, run whole (tests/ranks/test_recompute_price.py). Megatron's
    checkpoint replays the whole forward. The MoE GPT's block leaves its shared expert's last GEMM out (the
    combine's backward needs the routed experts' outputs)."""
    from colab_kit.models import GPTConfig
    from colab_kit.planner.cluster.stack import replayed_by_full
    from colab_kit.planner.moe.price import moe_block
    for shape, t, fc2 in ((GPT, 16384, (6144, 4 * 6144)), (LLAMA, 65536, (4096, 14336))):
        cfg = ParallelConfig(tp=8, precision="bf16", recompute="full")
        b = block(shape, cfg, 8, shape.seq, A100)
        last = gemm(A100, "bf16", cfg, t, *fc2, False)[0]
        assert with_recompute(b, "full", early_stop=True).rc == pytest.approx(b.f - last, rel=1e-12)
        assert with_recompute(b, "full").rc == b.f
        for stack, left_out in (("colab_kit", False), ("torchtitan", True), ("megatron-lm-2021", False)):
            hw = A100.with_stack(stack)
            assert replayed_by_full(cfg, STACKS[stack])[0] == left_out
            again = block(shape, cfg, 8, shape.seq, hw).f - (last if left_out else 0.0)  # the stack's own block
            full, none = (price(shape, cfg.replace(recompute=r), 8, hw).breakdown["compute"] for r in ("full", "none"))
            assert full - none == pytest.approx(shape.layers * again, rel=1e-9), stack
    plain = ParallelConfig(precision="bf16", recompute="full")
    assert replayed_by_full(plain, STACKS["colab_kit"]) == (True, 1.0)  # no tp: fc2 a plain nn.Linear
    assert replayed_by_full(plain.replace(pp=2, schedule="zb-h1", microbatches=4), STACKS["colab_kit"])[0] is False
    assert {STACKS[s].checkpoint for s in ("megatron-lm-2021", "megatron-core", "deepspeed-2021")} == {"whole"}
    moe = ModelShape.of(GPTConfig(vocab_size=32000, seq_len=4096, d_model=2048, n_heads=16, n_layers=4, n_experts=64,
                                  top_k=6, d_expert=1408, shared_experts=2))
    config = ParallelConfig(dp=8, ep=8, precision="bf16", recompute="full")
    for hw, skipped in ((H100, H100.gemm_seconds(4096, 2048, moe.shared_ffn, "bf16")), (H100.with_stack(
            "megatron-core"), 0.0)):
        m = moe_block(moe, config, 1, 4096, hw, with_recompute(block(moe, config, 1, 4096, hw), "full",
                                                               replayed_by_full(config, hw.stack)[0]))
        assert m.rc == pytest.approx(m.f - skipped, rel=1e-12)


# ---------------------------------------------------------------------------------------------- overlap
def test_tp_overlap_hides_all_but_a_chunk_under_the_gemms():
    cfg = ParallelConfig(tp=8, precision="bf16", sp_mode="split_gather")
    plain = price(LLAMA, cfg, 8, H100)
    over = price(LLAMA, cfg, 8, H100.with_stack(tp_overlap=True))
    c = block(LLAMA, cfg, 8, 8192, H100)
    from colab_kit.planner.cluster.terms import tensor_comm
    f, b, _ = tensor_comm(LLAMA, cfg, 8, 8192, H100)
    hand = LLAMA.layers * (max(f / 8, f - c.gemms[0]) + max(b / 8, b - c.gemms[1]))
    assert over.breakdown["comm:tp"] == pytest.approx(hand, rel=1e-12)
    assert plain.breakdown["comm:tp"] == pytest.approx(LLAMA.layers * (f + b), rel=1e-12)
    assert over.step_seconds < plain.step_seconds


def test_param_gather_overlapped_leaves_one_blocks_bucket_or_what_the_forward_cannot_cover():
    cfg = ParallelConfig(dp=64, zero=1, precision="bf16")
    exposed, hidden = price(LLAMA, cfg, 64, H100), price(LLAMA, cfg, 64, H100.with_stack(param_gather="overlapped"))
    from colab_kit.planner.cluster.terms import params_on_rank
    grads = cluster_comm.placement(cfg, "dp_sp", 8)
    regather = cluster_comm.seconds("all_gather", params_on_rank(LLAMA, cfg) * 2 / 64, grads, H100)
    f = block(LLAMA, cfg, 1, 8192, H100).f
    saved = regather - max(regather / 32, regather - 32 * f)
    assert exposed.breakdown["comm:dp"] - hidden.breakdown["comm:dp"] == pytest.approx(saved, rel=1e-9)
    assert saved > 0


def test_deepspeed_2021_zero3_pays_a_rings_latency_per_tensor_and_hides_nothing():
    cfg = ParallelConfig(dp=1536, zero=3, precision="bf16")
    gpt175 = ModelShape(96, 12288, 96, 51200, 2048)
    flat = price(gpt175, cfg, 1536, HARDWARE["8xA100-80GB"].with_stack("megatron-lm-2021"))
    per = price(gpt175, cfg, 1536, HARDWARE["8xA100-80GB"].with_stack("deepspeed-2021"))
    group = cluster_comm.placement(cfg, "dp_sp", 8)
    lat = cluster_comm.latency("all_gather", group, A100)
    assert lat == pytest.approx((1536 - 192) * 3e-6 + 192 * 10e-6, rel=1e-12)
    # 12 gathers forward, 12 backward, 12 reduce-scatters a block where FSDP issues one of each
    assert per.comm_total["dp"] - flat.comm_total["dp"] == pytest.approx(96 * 3 * 11 * lat, rel=1e-9)
    assert per.collectives["dp"] == 12 * flat.collectives["dp"] == 96 * 3 * 12 and block_tensors(gpt175) == 12
    # each after a device sync: nothing hides behind compute (FSDP's hide here)
    assert per.breakdown["comm:dp"] == pytest.approx(per.comm_total["dp"], rel=1e-12)
    assert flat.breakdown["comm:dp"] < flat.comm_total["dp"] / 2


# ---------------------------------------------------------------------------------------------- as data
def test_stacks_are_data_one_object_per_node_and_stack():
    assert A100.stack == Stack() and A100.stack.name == "colab_kit"
    core = A100.with_stack("megatron-core")
    assert core is A100.with_stack(STACKS["megatron-core"]) and core.with_stack("colab_kit") is A100
    assert core.with_stack(tp_overlap=False) is A100.with_stack(dataclasses.replace(STACKS["megatron-core"],
                                                                                    tp_overlap=False))
    assert core.name == A100.name and core.attention == "flash"
    with pytest.raises(ValueError, match="elementwise must be one of 'eager', 'fused'"):
        Stack(elementwise="compiled")
    with pytest.raises(KeyError, match="choose from colab_kit"):
        A100.with_stack("nemo")
    est = ck.estimate(LLAMA, ParallelConfig(dp=8, zero=1, precision="bf16"), 8, hardware="8xH100-SXM",
                      stack="megatron-core")
    assert any(a.startswith("stack megatron-core") for a in est.assumptions)
    with pytest.raises(ck.ConfigError, match="choose from"):
        ck.estimate(LLAMA, ParallelConfig(dp=8, precision="bf16"), 8, hardware="8xH100-SXM", stack="nemo")
    with pytest.raises(ck.ConfigError, match="cluster preset"):
        ck.estimate(LLAMA, ParallelConfig(dp=8, precision="bf16"), 8, hardware="this machine", stack="torchtitan")
