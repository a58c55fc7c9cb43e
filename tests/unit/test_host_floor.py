"""The estimate's host floor (``planner.cluster.host``) against hand formulas: the operator count, the part of
it the GPU's work does not cover, no floor for a stack that is not eager PyTorch, the bubble hiding none of it,
and a measured preset's host figures: each family priced at its own step's seconds an operator."""
from __future__ import annotations

import dataclasses

import pytest

import colab_kit as ck
from colab_kit.models import GPTConfig
from colab_kit.planner.cluster.curve_fit import carry_over, measured_preset
from colab_kit.planner.cluster.hardware import HARDWARE
from colab_kit.planner.cluster.host import OPS, family, host_seconds, op_seconds, ops_per_step
from colab_kit.planner.cluster.price import price
from colab_kit.planner.shape import ModelShape

H200 = HARDWARE["8xH200-SXM"]
SMALL = ModelShape(layers=12, hidden=768, heads=12, vocab=25600, seq=1024)  # the GPU check's 125M GPT


def test_the_count_is_the_formula_per_family_mode_and_microbatch():
    c = OPS["gpt"]["mixed"]
    assert ops_per_step(SMALL, 12, 1, "bf16", "none") == c.fixed + c.per_microbatch + 12 * (
        c.per_block + c.per_block_microbatch)
    full = ops_per_step(SMALL, 12, 4, "fp32", "full")
    f = OPS["gpt"]["fp32"]
    assert full == f.fixed + 4 * f.per_microbatch + 12 * (f.per_block + 4 * (f.per_block_microbatch + f.recompute[2]))
    assert ops_per_step(SMALL, 12, 1, "fp16", "none") == ops_per_step(SMALL, 12, 1, "bf16", "none")
    with pytest.raises(ValueError, match="recompute 'half'"):
        ops_per_step(SMALL, 12, 1, "bf16", "half")


def test_families_and_a_mixture_with_dense_blocks():
    llama = dataclasses.replace(SMALL, gated=True, name="LlamaForCausalLM")
    assert family(SMALL) == "gpt" and family(llama) == "llama"
    moe = ModelShape.of(GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=4, n_experts=4, top_k=2,
                                  d_expert=64, moe_every=2))
    assert family(moe) == "gpt-moe" and len(moe.moe_blocks) == 2
    m, d = OPS["gpt-moe"]["fp32"], OPS["gpt"]["fp32"]
    want = m.fixed + m.per_microbatch + 2 * (m.per_block + m.per_block_microbatch) + 2 * (
        d.per_block + d.per_block_microbatch)
    assert ops_per_step(moe, 4, 1, "fp32", "none") == want
    assert ops_per_step(moe, 4, 1, "fp32", "none", moe=4) > want  # all four as MoE blocks: more


def test_the_floor_is_what_the_gpu_does_not_cover_and_only_for_eager_stacks():
    config = ck.ParallelConfig(precision="bf16")
    slow = dataclasses.replace(H200, op_seconds=50e-6)  # a host ten times slower than assumed: host-bound
    p = price(SMALL, config, 16, slow)
    floor = ops_per_step(SMALL, 12, 1, "bf16", "none") * 50e-6
    rest = sum(v for k, v in p.breakdown.items() if k != "host")
    assert floor > rest and p.breakdown["host"] == pytest.approx(floor - rest, rel=1e-12)
    assert p.step_seconds == pytest.approx(floor, rel=1e-12)
    assert price(SMALL, config, 16, H200).breakdown["host"] == 0.0  # 5 us: the GPU covers it
    fused = slow.with_stack("megatron-core")
    assert price(SMALL, config, 16, fused).breakdown["host"] == 0.0
    assert any("no host floor priced" in a for a in price(SMALL, config, 16, fused).assumptions)


def test_the_bubble_hides_none_of_the_host():
    config = ck.ParallelConfig(pp=4, microbatches=4, schedule="1f1b", precision="bf16")
    slow = dataclasses.replace(H200, op_seconds=50e-6)
    p = price(SMALL, config, 16, slow)
    floor = ops_per_step(SMALL, 3, 4, "bf16", "none") * 50e-6
    busy = sum(v for k, v in p.breakdown.items() if k not in ("host", "bubble"))
    assert p.breakdown["bubble"] > 0 and p.breakdown["host"] == pytest.approx(floor - busy, rel=1e-12)


def test_a_measured_preset_takes_the_launch_sweep_and_carries_it_said_so():
    from tests.unit.test_measured import _curves
    curves = {**_curves(), "launch": {"kernels": 800, "host_seconds_per_op": 7e-6, "device_seconds_per_op": 2e-6}}
    hw = measured_preset(H200, curves)
    assert hw.op_seconds == 7e-6 and hw.kernel_seconds == 2e-6
    assert "800 tiny add_ kernels" in hw.sources["op_seconds"] and "measured on NVIDIA H200" in hw.sources["op_seconds"]
    assert measured_preset(H200, _curves()).op_seconds == H200.op_seconds  # no sweep: the assumption stays
    h100 = carry_over(hw, HARDWARE["8xH100-SXM"])
    assert h100.op_seconds == 7e-6 and "carried over from 8xH200-SXM" in h100.sources["op_seconds"]
    assert carry_over(measured_preset(H200, _curves()), HARDWARE["8xH100-SXM"]).op_seconds == H200.op_seconds


def _program(**per_op):
    return [{"family": f, "ops": 2000, "step_seconds": 2000 * s, "seconds_per_op": s} for f, s in per_op.items()]


def test_a_measured_preset_prices_each_family_at_its_own_program_sweep():
    from tests.unit.test_measured import _curves
    curves = {**_curves(), "launch": {"kernels": 800, "host_seconds_per_op": 6e-6, "device_seconds_per_op": 2e-6},
              "program": _program(gpt=2e-5, **{"gpt-moe": 3e-5}) + [{"family": "llama", "skipped": "no transformers"}]}
    hw = measured_preset(H200, curves)
    assert hw.family_op_seconds == {"gpt": 2e-5, "gpt-moe": 3e-5} and hw.op_seconds == 2e-5  # not the add_'s 6 us
    assert hw.kernel_seconds == 2e-6 and "a tiny add_ takes 6.00 us" in hw.sources["family_op_seconds"]
    assert "gpt family's training step" in hw.sources["op_seconds"]
    moe = ModelShape.of(GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=4, n_experts=4, top_k=2,
                                  d_expert=64))
    llama = dataclasses.replace(SMALL, gated=True, name="LlamaForCausalLM")
    mixtral = dataclasses.replace(moe, gated=True, name="MixtralForCausalLM")
    assert op_seconds(hw, SMALL) == (2e-5, "gpt") and op_seconds(hw, moe) == (3e-5, "gpt-moe")
    assert op_seconds(hw, llama)[0] == 2e-5 and op_seconds(hw, mixtral)[0] == 3e-5  # their kin's
    assert op_seconds(H200, moe) == (H200.op_seconds, "op_seconds")  # a datasheet preset: the assumption
    config = ck.ParallelConfig(precision="bf16")
    assert host_seconds(moe, config, 4, hw, "none") == pytest.approx(ops_per_step(moe, 4, 1, "bf16", "none") * 3e-5)
    assert host_seconds(moe, config, 4, hw, "none") != pytest.approx(host_seconds(moe, config, 4, H200, "none"))
    h100 = carry_over(hw, HARDWARE["8xH100-SXM"])
    assert h100.family_op_seconds == hw.family_op_seconds
    assert "carried over from 8xH200-SXM" in h100.sources["family_op_seconds"]
    assert any("gpt 20, gpt-moe 30 us an operator of each family's own step" in a
               for a in price(SMALL, config, 16, hw).assumptions)


def test_a_failed_program_sweep_falls_back_to_the_launch_sweep():
    from tests.unit.test_measured import _curves
    curves = {**_curves(), "launch": {"kernels": 800, "host_seconds_per_op": 6e-6},
              "program": [{"error": "RankError: rank 0 failed"}]}
    hw = measured_preset(H200, curves)
    assert hw.family_op_seconds == {} and hw.op_seconds == 6e-6 and "lower bound" in hw.sources["op_seconds"]
