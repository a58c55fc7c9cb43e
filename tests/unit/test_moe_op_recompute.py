"""Per-op recomputation (``recompute="op"``) of a mixture-of-experts block, measured in one process and priced.

``recompute.op`` keeps every second counted matmul of a block's forward. In an MoE GPT block these are qkv
(1st), the router (3rd) and a shared expert's second matmul (5th); proj (2nd) and the shared expert's first
(4th) run again. The routed experts' ``torch._grouped_mm`` is not a counted matmul, so the dispatch and both
expert GEMMs run again too. The memory estimate (``memory.experts.moe_block_extra``) and the at-scale price
(``planner.moe.price.moe_block``) follow that. An estimate that kept the MoE layer's routed terms would hold
2.0x too many bytes here, and a price of half the block's forward leaves the experts' second run out.

Measured on the MoE GPT with a shared expert (2 MoE blocks, 8 rows of 16 tokens, fp32): the meter holds
273,540 B under "op", the estimate's figure exactly (with the routed terms kept: 553,092). ``FlopCounterMode`` does not count
``_grouped_mm``, so the FLOPs it sees "op" add are proj's and the shared expert's first matmul a block.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine.core import lm_loss
from colab_kit.memory import ActivationMeter
from colab_kit.memory.estimator import config_estimate
from colab_kit.models import GPT, GPTConfig
from colab_kit.planner.cluster.compute import block, elementwise, with_recompute
from colab_kit.planner.cluster.hardware import HARDWARE
from colab_kit.planner.moe.price import moe_block
from colab_kit.planner.shape import ModelShape
from colab_kit.recompute import recompute_blocks
from colab_kit.recompute.op import recompute_ops

BASE = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=4, d_ff=128, n_experts=4, top_k=2, d_expert=48)
MODELS = {"shared": GPTConfig(**BASE, n_layers=2, shared_experts=1),
          "every other, no shared": GPTConfig(**BASE, n_layers=4, moe_every=2)}
ROWS = 8


def _step(cfg: GPTConfig, mode: str):
    """(FLOPs counted, bytes held, gradients) of one forward and backward of ``cfg`` under ``mode``."""
    torch.manual_seed(0)
    model = GPT(cfg)
    if mode == "op":
        recompute_ops(model)
    elif mode == "full":
        recompute_blocks(model)
    x, y = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=1).batch(0, ROWS)
    meter = ActivationMeter(exclude=list(model.parameters()))
    with FlopCounterMode(display=False) as counter:
        with meter.measure():
            loss = lm_loss(model(x), y)
        loss.backward()
    return counter.get_total_flops(), meter.last, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", list(MODELS))
def test_op_holds_what_the_estimate_says_and_repeats_proj_and_the_shared_experts_first_matmul(name):
    cfg = MODELS[name]
    runs = {m: _step(cfg, m) for m in ("none", "op", "full")}
    held = {m: r[1] for m, r in runs.items()}
    est = {m: config_estimate(cfg, ck.ParallelConfig(recompute=m), ROWS)["activations"] for m in held}
    assert held["op"] == est["op"] and held["full"] == est["full"], (held, est)  # nothing kept follows the routing
    assert held["none"] == pytest.approx(est["none"], rel=0.01)  # the dispatch as the routing fell, not balanced
    assert held["none"] > 2 * held["op"] > 2 * held["full"]
    n, h = ROWS * cfg.seq_len, cfg.d_model
    moe = sum(1 for b in GPT(cfg).blocks if getattr(b.mlp, "router", None) is not None)
    shared_fc1 = 2 * n * h * cfg.shared_experts * cfg.d_expert
    assert runs["op"][0] - runs["none"][0] == cfg.n_layers * 2 * n * h * h + moe * shared_fc1
    for a, b in zip(runs["none"][2], runs["op"][2]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_price_of_op_runs_the_experts_and_the_dispatch_again():
    """``moe_block``'s recomputation under "op", against the hand formula: the dense block's (proj and the
    elementwise ops), the routed experts' two GEMMs forward, the dispatch's permutes and the shared expert's
    first matmul; more than half the MoE block's forward, where the experts dominate it."""
    hw, p = HARDWARE["8xH100-SXM"], "bf16"
    cfg = GPTConfig(vocab_size=32000, seq_len=4096, d_model=2048, n_heads=16, n_layers=4, n_experts=64, top_k=6,
                    d_expert=1408, shared_experts=2)
    shape, config, rows = ModelShape.of(cfg), ck.ParallelConfig(dp=8, ep=8, precision=p, recompute="op"), 1
    t, h = rows * shape.seq, shape.hidden
    dense = with_recompute(block(shape, config, rows, shape.seq, hw), "op")
    moe = moe_block(shape, config, rows, shape.seq, hw, dense)
    per, local = t * shape.top_k * config.ep / shape.experts, shape.experts / config.ep
    experts = (hw.gemm_seconds(per, shape.d_expert, h, p, local) + hw.gemm_seconds(per, h, shape.d_expert, p, local))
    permute = hw.stream_seconds(4 * t * shape.top_k * h * 2, 4)
    want = (hw.gemm_seconds(t, h, h, p) + elementwise(shape, config, t, hw) + experts + permute
            + hw.gemm_seconds(t, shape.shared_ffn, h, p))
    assert moe.rc == pytest.approx(want, rel=1e-12)
    assert moe.rc > (moe.f - moe.attn) / 2  # the old price: half the forward less the core
    none = moe_block(shape, config.replace(recompute="none"), rows, shape.seq, hw,
                     with_recompute(block(shape, config.replace(recompute="none"), rows, shape.seq, hw), "none"))
    assert none.rc == 0.0 and none.f == moe.f
