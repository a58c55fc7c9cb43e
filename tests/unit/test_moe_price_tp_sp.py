"""The planner's price of a mixture of experts under 1D tp and sp (tier 1, no process): what the engine runs
there is priced; per rank, the experts' FLOPs (whole on every tp rank, over a rank's seq / sp tokens) and the
all-to-all's bytes and group against hand formulas; an MoE block keeps attention's tp collectives only."""
from __future__ import annotations

import pytest

import colab_kit as ck
from colab_kit.planner.cluster.stack import Stack
from colab_kit.engine.core import unsupported
from colab_kit.memory.estimator import config_estimate
from colab_kit.models import GPT
from colab_kit.planner.cluster import comm as cluster_comm
from colab_kit.planner.cluster.price import price
from colab_kit.planner.shape import ModelShape
from tests.helpers.moe import MODELS

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name, config", [("softmax", ck.ParallelConfig(dp=2, tp=2, ep=2)),
                                          ("softmax", ck.ParallelConfig(dp=2, sp=2, ep=4)),
                                          ("softmax", ck.ParallelConfig(tp=2, sp=2, sp_mode="ulysses", ep=2)),
                                          ("capacity", ck.ParallelConfig(dp=2, tp=2, ep=2))])
def test_what_the_engine_runs_under_tp_and_sp_is_priced(name, config):
    model = GPT(MODELS[name])
    assert unsupported(config, model) is None
    est = ck.estimate(MODELS[name], config, 16, constants=ck.planner.EXAMPLE_CONSTANTS)
    assert est.step_seconds > 0 and est.memory == config_estimate(MODELS[name], config, 16)
    assert price(ModelShape.of(MODELS[name]), config, 16, "8xH100-SXM").step_seconds > 0


class _FlopCounter:
    """A ``Hardware`` stand-in whose "seconds" are FLOPs: a GEMM ``(m x k) @ (k x n)`` counts ``2 m n k`` a
    product, elementwise passes 0; the cost model's per-rank compute then reads as FLOPs per rank."""
    gpus_per_node = 8
    stack = Stack()

    def gemm_seconds(self, m, n, k, precision, count=1.0):
        return 2.0 * m * n * k * count if min(m, n, k, count) > 0 else 0.0

    def stream_seconds(self, nbytes, kernels=0.0):
        return 0.0


ROWS, SEQ = 4, 16  # a microbatch of 4 rows of 16 tokens on each (dp) rank


def _moe_minus_dense_flops(config) -> tuple[float, float]:
    """Forward (and dX) FLOPs one rank adds to a block by making it an MoE block (``moe.price.moe_block`` less
    ``cluster.compute.block``) for the softmax MoE GPT (h 32, d_ff 128, 4 experts of 32, top-2, a shared expert)."""
    from colab_kit.planner.moe.price import moe_block
    from colab_kit.planner.cluster.compute import block
    shape, hw = ModelShape.of(MODELS["softmax"]), _FlopCounter()
    dense = block(shape, config, ROWS, SEQ, hw)
    moe = moe_block(shape, config, ROWS, SEQ, hw, dense)
    return moe.f - dense.f, moe.i - dense.i


def _hand_flops(tp: int, sp: int, experts_split_by_tp: bool = False, tokens_split_by_sp: bool = True) -> float:
    """By hand, per rank and MoE block: T = rows x seq / sp tokens (each sp rank routes its own), all of them on
    every tp rank; the router ``2 T E h``, the shared expert ``2 x 2 T h S``, the routed experts ``2 x 2 T k h f``
    (each token's k experts), all whole on a tp rank; less the dense MLP ``2 x 2 T h d_ff / tp`` (split by tp).
    The flags give the wrong formulas a test must catch: the MoE layer split by tp like a dense MLP, the tokens
    not split by sp."""
    cfg = MODELS["softmax"]
    h, d_ff, e, k, f = cfg.d_model, 4 * cfg.d_model, cfg.n_experts, cfg.top_k, cfg.d_expert
    s = cfg.shared_experts * f
    t = ROWS * SEQ / (sp if tokens_split_by_sp else 1)
    moe = 2 * t * e * h + 4 * t * h * s + 4 * t * k * h * f
    return moe / (tp if experts_split_by_tp else 1) - 4 * t * h * d_ff / tp


@pytest.mark.parametrize("kw", [dict(dp=2, tp=2, ep=2), dict(dp=2, sp=2, ep=4), dict(tp=2, sp=2, ep=2),
                                dict(dp=2, sp=2, sp_mode="ulysses", ep=2), dict(dp=4, ep=2)])
def test_expert_flops_per_rank_under_tp_and_sp_are_the_hand_formula(kw):
    """Under 1D tp every tp rank does the whole MoE layer's FLOPs for its (dp, sp) shard's tokens (repeated tp
    times, not split); under sp a rank does those of its ``seq / sp`` tokens. A formula that split the MoE
    layer over tp, or did not split its tokens over sp, is caught (it is off by at least 25%)."""
    from colab_kit.planner.moe.price import expert_flops
    config = ck.ParallelConfig(**kw)
    tp, sp = config.tp, config.sp
    forward, backward_input = _moe_minus_dense_flops(config)
    right = _hand_flops(tp, sp)
    assert forward == pytest.approx(right, rel=1e-12) and backward_input == pytest.approx(right, rel=1e-12)
    cfg = MODELS["softmax"]
    assert expert_flops(ModelShape.of(cfg), config, ROWS, SEQ) == 4 * ROWS * SEQ / sp * cfg.top_k * 32 * 32
    wrong = [_hand_flops(tp, sp, experts_split_by_tp=True)] if tp > 1 else []
    wrong += [_hand_flops(tp, sp, tokens_split_by_sp=False)] if sp > 1 else []
    for w in wrong:
        assert abs(w - forward) > 0.25 * abs(forward), (w, forward)


@pytest.mark.parametrize("kw, group", [(dict(dp=2, tp=2, ep=2), [0, 2]), (dict(dp=2, sp=2, ep=4), [0, 1, 2, 3]),
                                       (dict(tp=2, sp=2, ep=2), [0, 2]), (dict(dp=2, tp=2, sp=2, ep=4), [0, 2, 4, 6]),
                                       (dict(dp=2, sp=2, sp_mode="ulysses", ep=2), [0, 1])])
def test_all_to_all_bytes_per_rank_under_tp_and_sp_are_the_hand_formula(kw, group, monkeypatch):
    """Each dispatch and combine all-to-all carries a rank's ``T k h`` values, 4 B each in fp32, T = rows x seq /
    sp (tp does not divide them: every tp rank dispatches the same tokens, in its own ep group), over the ep group
    the engine builds (ep folded over dp x sp, the ranks of one tp position: ``MeshLayout.groups("ep")``), as
    ``cluster.comm.placement`` places it. Counts: ``8 E`` bytes once forward. Not splitting the tokens over sp, or
    dividing them by tp, is caught (2x off)."""
    from colab_kit.planner.moe import price as moe_price
    config = ck.ParallelConfig(**kw)
    shape = ModelShape.of(MODELS["softmax"])
    assert ck.MeshLayout(config).groups("ep")[0] == group
    size, step = cluster_comm.stride(config, "ep")
    assert [step * i for i in range(size)] == group  # the priced group is the engine's
    seen = []
    monkeypatch.setattr(cluster_comm, "seconds", lambda op, payload, grp, hw: seen.append((op, payload, grp)) or 1.0)
    forward, backward, counts = moe_price.dispatch_seconds(shape, config, ROWS, SEQ,
                                                           ck.planner.cluster.hardware.HARDWARE["8xH100-SXM"])
    right = ROWS * SEQ / config.sp * shape.top_k * shape.hidden * 4
    assert seen == [("all_to_all", right, cluster_comm.placement(config, "ep", 8)),
                    ("all_to_all", 8 * shape.experts, cluster_comm.placement(config, "ep", 8))]
    assert (forward, backward, counts) == (3.0, 2.0, (3, 2))  # counts + dispatch + combine; two transposes back
    assert moe_price.dispatch_bytes(shape, config, ROWS, SEQ) == right
    if config.sp > 1:
        assert right != ROWS * SEQ * shape.top_k * shape.hidden * 4
    if config.tp > 1:
        assert right != ROWS * SEQ / (config.sp * config.tp) * shape.top_k * shape.hidden * 4


def test_moe_blocks_keep_attentions_tp_collectives_only():
    """Under 1D tp an MoE block has attention's all-reduce forward and backward (the MoE layer runs whole, no
    collective): per microbatch the MoE GPT's 2 MoE blocks count 2 x 2, where its dense twin's count 2 x 4."""
    shape = ModelShape.of(MODELS["softmax"])
    dense = ModelShape(layers=2, hidden=32, heads=4, vocab=64, seq=16, ffn=128)
    config = ck.ParallelConfig(dp=2, tp=2, microbatches=2)
    assert price(shape, config, 16, "8xH100-SXM").collectives["tp"] == 2 * 2 * 2
    assert price(dense, config, 16, "8xH100-SXM").collectives["tp"] == 2 * 2 * 4


def test_the_local_all_to_all_under_sp_carries_a_ranks_own_tokens():
    """``moe_step_seconds`` (this machine's constants): each MoE layer's 4 all-to-alls a microbatch carry the
    rank's ``rows x seq / sp`` tokens' ``k h`` values over ep ranks (the measured constants of that group)."""
    from colab_kit.planner.local.comm import collective_seconds
    from colab_kit.planner.moe.local import moe_step_seconds
    cfg, consts = MODELS["softmax"], ck.planner.EXAMPLE_CONSTANTS
    config = ck.ParallelConfig(dp=2, sp=2, ep=4)
    memory = config_estimate(cfg, config, 16)
    _, parts, counts = moe_step_seconds(cfg, config, 16, consts, memory)
    payload = 16 // 2 * cfg.seq_len // 2 * cfg.top_k * cfg.d_model * 4
    assert counts["comm:ep"] == 2 * 4
    assert parts["comm:ep"] == pytest.approx(collective_seconds(consts, "all_to_all", payload, 4, 8))
    assert parts["comm:ep"] != pytest.approx(collective_seconds(consts, "all_to_all", 2 * payload, 4, 8))  # tokens not / sp
