"""The planner, ``ck.estimate`` and the memory estimate of a mixture of experts (tier 1, no process): total and
active parameters (the built-in MoE GPT exactly, Mixtral 8x7B, Qwen3-30B-A3B and DeepSeek-V3 at their
published sizes), FLOPs per token against FlopCounterMode, the planner's memory equal to the engine's estimate,
the all-to-all placed by the rank order, the edp reduction, the search over ep, the rules the engine keeps,
and DeepSeek-V3's published layout priced with bytes per rank that add up."""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.engine.core import check_experts, unsupported
from colab_kit.memory.estimator import config_estimate
from colab_kit.models import GPT
from colab_kit.planner.cluster import comm as cluster_comm
from colab_kit.planner.estimate import memory_of
from colab_kit.planner.moe.shape import stage_split
from colab_kit.planner.cluster.price import price
from colab_kit.planner.shape import ModelShape
from tests.helpers.moe import MODELS

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", list(MODELS))
def test_the_shape_of_the_moe_gpt_counts_its_parameters_exactly(name):
    cfg = MODELS[name]
    model = GPT(cfg)
    shape = ModelShape.of(cfg)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.active_params == shape.params - experts * (cfg.n_experts - cfg.top_k) // cfg.n_experts
    assert ModelShape.of(model) == shape


@pytest.mark.parametrize("name", ["softmax", "all_experts"])  # dropless: every assignment computed
def test_flops_per_token_are_the_active_parameters_flops(name, monkeypatch):
    """FlopCounterMode counts the matmuls of a forward (the experts in their loop form, each expert's GEMM on
    its rows); attention's core is the formula's ``4 s h`` a layer (no SDPA kernel is counted on CPU)."""
    import colab_kit.models.experts as experts
    from torch.utils.flop_counter import FlopCounterMode
    monkeypatch.setattr(experts, "EXPERT_COMPUTE", "loop")
    cfg = MODELS[name]
    x = torch.zeros(2, cfg.seq_len, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        GPT(cfg)(x)
    shape = ModelShape.of(cfg)
    tokens = x.numel()
    core = 4 * cfg.n_layers * cfg.seq_len * cfg.d_model * tokens
    assert counter.get_total_flops() + core == shape.forward_flops_per_token() * tokens
    assert shape.flops_per_token() == 3 * shape.forward_flops_per_token()


def _hf(config_cls, **kw):
    return ModelShape.of(config_cls(**kw))


def test_published_mixtures_of_experts_total_and_active():
    """Mixtral 8x7B (46.7B, 12.9B active), Qwen3-30B-A3B (30.5B, 3.3B) read on the meta device."""
    mixtral = _hf(transformers.MixtralConfig, vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=4096)
    qwen = _hf(transformers.Qwen3MoeConfig, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
               moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
               head_dim=128, num_experts=128, num_experts_per_tok=8, max_position_embeddings=4096,
               tie_word_embeddings=False)
    for shape, total, active in ((mixtral, 46.7e9, 12.9e9), (qwen, 30.5e9, 3.3e9)):
        assert shape.params == pytest.approx(total, rel=0.01), shape
        assert shape.active_params == pytest.approx(active, rel=0.02), shape
    assert (mixtral.experts, mixtral.top_k, mixtral.d_expert, len(mixtral.moe_blocks)) == (8, 2, 14336, 32)
    assert qwen.attn_params == 2048 * (4096 + 2 * 512) + 4096 * 2048  # head_dim 128 x 32 heads, not hidden


def test_deepseek_v3_total_and_active():
    """671B total; 37B active as the report rounds it: the count with the token table (37.55B, a lookup) and
    without it (36.6B) lie either side of it."""
    from colab_kit.planner.published.deepseek_v3 import model_config
    s = ModelShape.of(model_config())
    assert s.params == pytest.approx(671e9, rel=0.01)
    assert s.active_params - s.vocab * s.hidden < 37e9 < s.active_params
    assert s.active_params == pytest.approx(37e9, rel=0.015)
    assert (s.experts, s.top_k, s.d_expert, s.shared_ffn, s.moe_blocks[0], len(s.moe_blocks)) == \
        (256, 8, 2048, 2048, 3, 58)
    assert s.core_width == 128 * (192 + 128) // 2


CONFIGS = [dict(dp=4, ep=2), dict(dp=4, ep=4, zero=1), dict(dp=4, ep=2, zero=2, recompute="full"),
           dict(dp=2, pp=2, ep=2, microbatches=2), dict(dp=4), dict(dp=2, tp=2, ep=2), dict(tp=2, pp=2, microbatches=2),
           dict(dp=2, sp=2, ep=4), dict(tp=2, sp=2, ep=2, zero=1), dict(dp=2, sp=2, sp_mode="ulysses", ep=2)]


@pytest.mark.parametrize("kw", CONFIGS)
@pytest.mark.parametrize("name", ["softmax", "capacity"])
def test_the_planners_memory_is_the_engines_estimate(name, kw):
    cfg = ck.ParallelConfig(**kw)
    assert memory_of(ModelShape.of(MODELS[name]), cfg, 8) == config_estimate(MODELS[name], cfg, 8)


def test_ep_groups_placed_by_the_rank_order():
    """ep is the fastest part of the folded dp x sp block: ep=8 of dp=64 on one node, ep=16 across two;
    edp 8 apart; the all-to-all across nodes is slower."""
    hw = ck.planner.cluster.hardware.HARDWARE["8xH800-SXM"]
    inside, across = ck.ParallelConfig(dp=64, ep=8), ck.ParallelConfig(dp=64, ep=16)
    assert cluster_comm.placement(inside, "ep", 8) == cluster_comm.Group(8, 8, 1)
    assert cluster_comm.placement(across, "ep", 8) == cluster_comm.Group(16, 8, 2)
    assert cluster_comm.placement(inside, "edp", 8) == cluster_comm.Group(8, 1, 8)
    assert ck.MeshLayout(inside).groups("ep")[0] == list(range(8))
    assert ck.MeshLayout(inside).groups("edp")[0] == list(range(0, 64, 8))
    shape = ModelShape(layers=4, hidden=4096, heads=32, vocab=32000, seq=4096, ffn=14336, gated=True,
                       positions=False, experts=16, top_k=2, d_expert=14336, moe_blocks=(0, 1, 2, 3))
    a, b = (price(shape, c.replace(precision="bf16"), 64, hw) for c in (inside, across))
    assert b.breakdown["comm:ep"] > 2 * a.breakdown["comm:ep"] > 0
    assert a.collectives["ep"] == 4 * 5  # per MoE layer and microbatch: counts + dispatch + combine, 2 back


def test_experts_split_over_ep_lower_the_edp_reduction_and_the_states():
    shape = ModelShape.of(transformers.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                                     num_hidden_layers=32, num_attention_heads=32,
                                                     num_key_value_heads=8, max_position_embeddings=4096))
    hw = "8xH100-SXM"
    one, eight = (price(shape, ck.ParallelConfig(dp=64, pp=4, ep=e, zero=1, microbatches=8, precision="bf16"),
                        512, hw) for e in (1, 8))
    assert eight.comm_total["dp"] < one.comm_total["dp"]
    # ZeRO-1: a rank updates experts / ep / edp = experts / dp of them either way (at ep 1 with the dense ones, one
    # update; at ep 8 two, the second's kernels launched apart)
    assert eight.breakdown["optimizer"] == pytest.approx(one.breakdown["optimizer"], rel=0.02)
    m1, m8 = (memory_of(shape, ck.ParallelConfig(dp=64, pp=4, ep=e, zero=1, microbatches=8, precision="bf16"), 512)
              for e in (1, 8))
    assert m8["params"] < m1["params"] / 3


def test_zero3_gathers_a_blocks_dense_part_over_dp_and_its_experts_over_edp(monkeypatch):
    """As the engine's ZeRO-3 chunks them (``zero/split.py``): per block the dense parameters gathered over dp
    (16-bit) and reduce-scattered (fp32), the block's E / ep experts likewise over edp, and no second reduction of
    the experts after the backward (it was counted twice, and every expert over dp, before)."""
    from colab_kit.planner.moe.shape import tp_layer_params
    calls = []
    real = cluster_comm.seconds

    def record(op, payload, group, hw):
        calls.append((op, payload, group.size))
        return real(op, payload, group, hw)

    monkeypatch.setattr(cluster_comm, "seconds", record)
    shape, config = ModelShape.of(MODELS["softmax"]), ck.ParallelConfig(dp=4, ep=2, zero=3, precision="bf16")
    price(shape, config, 16, "8xH100-SXM")
    parts = [tp_layer_params(shape, i, 1) for i in range(shape.layers)]
    dense, experts = (sum(p[j] for p in parts) / shape.layers for j in (0, 1))
    assert ("all_gather", dense * 2 / 4, 4) in calls and ("reduce_scatter", dense * 4, 4) in calls
    assert ("all_gather", experts / 2 * 2 / 2, 2) in calls and ("reduce_scatter", experts / 2 * 4, 2) in calls
    assert not [c for c in calls if c[0] in ("all_reduce", "reduce_scatter") and c[2] == 2 and c[1] != experts * 2]


@pytest.mark.parametrize("name", ["softmax", "capacity"])
def test_the_plan_proposes_only_what_the_engine_runs_here(name):
    """1D tp and (dropless) sp are proposed, with ep over dp x sp; 2D tp, split_gather and a capacity under sp
    never are."""
    model = GPT(MODELS[name])
    cands = ck.plan(model, 4, 16, constants=ck.planner.EXAMPLE_CONSTANTS)
    assert {c.config.ep for c in cands} > {1}
    assert any(c.config.tp > 1 for c in cands)
    assert any(c.config.sp > 1 for c in cands) == (MODELS[name].capacity_factor is None)
    assert any(c.config.sp > 1 and c.config.ep > c.config.dp for c in cands) == (name == "softmax")
    for c in cands:
        assert c.config.tp_mode == "1d" and c.config.sp_mode != "split_gather" and c.config.precision == "fp32"
        assert unsupported(c.config, model) is None
        check_experts(c.config, model)


def test_the_plan_at_scale_searches_ep_and_prices_what_estimate_prices():
    qwen = transformers.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                       moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                       num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                       max_position_embeddings=4096, tie_word_embeddings=False)
    cands = ck.plan(qwen, 64, 512, precision="bf16", hardware="8xH100-SXM", limit=16)
    assert cands and all(c.config.tp_mode == "1d" and c.config.sp_mode != "split_gather" and 128 % c.config.ep == 0
                         for c in cands)
    # FSDP's gathers hide behind compute on 8 NICs a node (the experts replicated: no all-to-all); ep trades
    # larger expert GEMMs for exposed all-to-alls and comes a little behind
    with_ep = [c for c in cands if c.config.ep > 1]
    assert with_ep
    for c in list(cands[:3]) + with_ep[:1]:
        again = ck.estimate(qwen, c.config, 512, hardware="8xH100-SXM")
        assert again.step_seconds == c.step_seconds and again.memory == c.memory
        assert not any("not runnable" in a for a in again.assumptions)  # the engine runs ep in bf16


@pytest.mark.parametrize("name, config, kwargs, match", [
    ("softmax", ck.ParallelConfig(tp=4, tp_mode="2d"), {}, "tp_mode='1d' without split_gather"),
    ("softmax", ck.ParallelConfig(dp=2, tp=2, sp_mode="split_gather"), {}, "tp_mode='1d' without split_gather"),
    ("capacity", ck.ParallelConfig(dp=2, sp=2), {}, r"sp=1 \(dp=4 runs the same ranks\), or capacity_factor=None"),
    ("softmax", ck.ParallelConfig(dp=6, ep=3), {}, "try ep=2"),
    ("softmax", ck.ParallelConfig(dp=4, pp=3), {"hardware": "this machine", "uneven_stages": True}, "cluster preset"),
])
def test_what_the_engine_refuses_is_refused_with_the_rule(name, config, kwargs, match):
    with pytest.raises(ck.ConfigError, match=match):
        ck.estimate(MODELS[name], config, 12, **{"constants": ck.planner.EXAMPLE_CONSTANTS, **kwargs})
    why = unsupported(config, GPT(MODELS[name]))  # the engine refuses the first three with the same rule
    assert (why is not None) == (config.tp_mode != "1d" or config.sp_mode == "split_gather" or config.sp > 1)


def test_ep_with_offload_is_priced_as_the_engine_runs_it():
    """The engine runs ep with offload (tests/ranks/test_ep.py). At a preset the experts' states, sharded over
    edp, sit on the host beside the dense ones over dp, as ``engine.memory()`` measures them
    (tests/ranks/test_moe_memory.py), and the step pays each shard's gradients down and parameters up over PCIe
    and its update on the host, by hand: ``shard (4 + 2) / PCIe + shard (30 bytes) / host`` (bf16, AdamW) for the
    dense shard over dp and the experts' over edp (ZeRO-3 stages its shards per gather instead, priced apart as
    ``offload``). On this machine it is priced too."""
    from colab_kit.planner.cluster.hardware import HARDWARE
    from colab_kit.planner.cluster.terms import HOST_BYTES_PER_S
    from colab_kit.planner.moe.price import params_split
    cfg = ck.models.GPTConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_heads=16, n_layers=8, n_experts=16,
                              top_k=2, d_expert=1408, shared_experts=1)
    hw, shape = HARDWARE["8xH100-SXM"], ModelShape.of(cfg)
    for zero in (1, 2, 3):
        config = ck.ParallelConfig(dp=8, ep=4, zero=zero, offload="cpu", precision="bf16")
        est = ck.estimate(cfg, config, 32, hardware=hw)
        dense, experts = params_split(shape, config, shape.layers)
        shards = (dense / 8, experts / 2)  # dp = 8, edp = dp / ep = 2
        pcie = 6 / hw.pcie_bytes_per_s if zero < 3 else 0.0  # ZeRO-3: staged per gather (breakdown["offload"])
        want = sum(s * pcie + s * 30 / HOST_BYTES_PER_S for s in shards)
        assert est.breakdown["optimizer"] == pytest.approx(want, rel=1e-9), zero
        assert ("offload" in est.breakdown) == (zero == 3)
        engine_estimate = config_estimate(cfg, config, 32)
        assert est.memory["host"] == engine_estimate["host"] and est.memory["host"]["optimizer"] > 0
        on_host = ("optimizer",) if zero < 3 else ("params", "grads", "optimizer")
        assert all(est.memory["device"][k] == 0 for k in on_host)
        none = ck.estimate(cfg, config.replace(offload="none"), 32, hardware=hw)
        assert none.breakdown["optimizer"] < est.breakdown["optimizer"] and est.device_bytes < none.device_bytes
    local = ck.estimate(MODELS["softmax"], ck.ParallelConfig(dp=4, ep=2, zero=1, offload="cpu"), 12,
                        constants=ck.planner.EXAMPLE_CONSTANTS)
    assert local.step_seconds > 0 and local.memory["host"]["optimizer"] > 0


def test_ep_on_a_dense_model_is_refused():
    dense = ck.models.GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    with pytest.raises(ck.ConfigError, match="set ep=1"):
        ck.estimate(dense, ck.ParallelConfig(dp=4, ep=2), 8)


def test_deepseek_v3_published_layout_priced_with_bytes_that_add_up():
    """PP16 x EP64 x ZeRO-1 DP on 2,048 H800s: params, grads and optimizer of the fullest rank are the shape's
    own counts of its stage (dense over dp=128, 4 of 256 experts per MoE block over edp=2); the step is no faster
    than its FLOPs at the datasheet peak; the assumptions say what the engine cannot run."""
    from colab_kit.planner.published.deepseek_v3 import layout, model_config
    config, batch = layout()
    est = ck.estimate(model_config(), config, batch, hardware="8xH800-SXM", uneven_stages=True)
    s = est.shape
    split = stage_split(s.layers, 16)
    assert [len(r) for r in split] == [3] * 3 + [4] * 13
    per_stage = []
    for st, blocks in enumerate(split):
        dense = sum(s.layer_params(i)[0] for i in blocks) + s.vocab * s.hidden * (st in (0, 15)) + s.hidden * (st == 15)
        per_stage.append((dense, sum(s.layer_params(i)[1] for i in blocks) // 64))
    full = [2 * (d + x) for d, x in per_stage]
    assert est.memory["params"] in full and est.memory["grads"] == est.memory["params"]
    d, x = per_stage[full.index(est.memory["params"])]
    assert est.memory["optimizer"] == 12 * (-(-d // 128) + -(-x // 2))
    assert est.step_seconds >= est.model_flops / (2048 * est.peak_flops)
    assert 0 < est.mfu < 0.6
    text = " ".join(est.assumptions)
    assert "fullest 4" in text and "the engine needs an even split" in text


def test_expert_gemms_against_the_h200_measurement():
    """bench/gpu_moe_check.py measured the grouped experts' forward and backward on one H200 (64 experts, 2,048 x
    1,408, 65,536 rows, bf16): 6.98 ms. The model's six grouped GEMMs at those sizes (``moe.price.expert_gemms``)
    are within 2x of it (0.64 of it: the measurement also holds the biases and GELU, and the H-class presets
    keep the A100's fitted fraction of peak, docs/estimate.md)."""
    import json
    import os

    from colab_kit.planner.cluster.hardware import HARDWARE
    from colab_kit.planner.moe.price import expert_gemms
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results", "gpu_moe_check.json")
    with open(path) as f:
        speed = json.load(f)["checks"]["speed"]["figures"]
    shape = ModelShape(layers=1, hidden=speed["d"], heads=16, vocab=64, seq=speed["rows"], experts=speed["experts"],
                       top_k=1, d_expert=speed["f"], moe_blocks=(0,))
    up, down = expert_gemms(shape, ck.ParallelConfig(precision="bf16"), speed["rows"], HARDWARE["8xH200-SXM"])
    ratio = (sum(up) + sum(down)) * 1e3 / speed["grouped_mm"]["ms"]
    assert 0.5 <= ratio <= 2, ratio
