"""Tier 1: ZB-V list-scheduled from per-stage costs (``colab_kit.pipeline.costs``), no processes.

With equal costs the timed scheduler writes the unit-step plan action for action; on uneven
costs every plan it writes keeps ZB-V's rules (one F, I, W per stage and microbatch, in
order, dependencies across ranks, no deadlock once lowered, at most 2p chunk-microbatches
held) and is never planned slower than the unit-step plan under the same costs; on the
costs measured on CPU ranks it is strictly shorter. Bad costs are refused with the rule.
"""
from __future__ import annotations

import random

import pytest

from colab_kit.pipeline import build_plan, lower, simulate, steps
from colab_kit.pipeline.plan import PipelinePlan
from colab_kit.pipeline.costs import _zb_v_clocked, measured_costs, stage_costs, zb_v_timed
from tests.helpers import assert_f_i_w_in_order, assert_one_f_i_w_each

ZBV = [(pp, m) for pp in range(1, 5) for m in range(1, 3 * pp + 1)]
MEASURED = {"F": 2.1, "I": 2.7, "W": 1.6, (0, "I"): 0.0, (0, "W"): 4.0}  # the costs module's example


def random_costs(rng, pp):
    c = {(s, k): rng.uniform(0.0, 3.0) for s in range(2 * pp) for k in "FIW"}
    if rng.random() < 0.5:
        c[0, "I"] = 0.0  # the first stage never splits: its I is free, its W the whole backward
    return c


def test_equal_costs_write_the_unit_step_plan():
    for pp, m in ZBV:
        unit = build_plan("zb-v", pp, m, 2)
        assert zb_v_timed(pp, m, {"F": 1, "I": 1, "W": 1}) == unit.actions, (pp, m)
        assert build_plan("zb-v", pp, m, 2, costs={"F": 0.5, "I": 0.5, "W": 0.5}).actions == unit.actions


def test_plans_from_uneven_costs_keep_every_zb_v_rule_and_never_plan_slower():
    rng, shorter = random.Random(0), 0
    for pp, m in ZBV:
        for costs in [MEASURED] + [random_costs(rng, pp) for _ in range(4)]:
            plan = build_plan("zb-v", pp, m, 2, costs=costs)
            assert plan.placement == "v" and plan.chunks == 2
            assert_one_f_i_w_each(plan, pp, m)
            assert_f_i_w_in_order(plan, pp, m)
            for r, row in enumerate(plan.actions):
                assert {a.stage for a in row} <= set(plan.stages_of(r))
            low = lower(plan)  # steps() checks dependencies across ranks; every action gets a timestep
            assert sum(a is not None for row in steps(low) for a in row) == sum(map(len, low.actions))
            assert max(simulate(plan).peak_held) <= 2 * pp, (pp, m)
            fitted, unit = simulate(plan, costs).makespan, simulate(build_plan("zb-v", pp, m, 2), costs).makespan
            assert fitted <= unit + 1e-9, (pp, m, costs)
            shorter += fitted < unit - 1e-9
    assert shorter > len(ZBV)  # most uneven costs give a strictly shorter plan


def test_the_schedulers_clock_is_the_simulated_makespan():
    """``zb_v_plan`` compares the timed V with the unit one by the scheduler's own clock (one simulation fewer: a
    third of a fitted plan's time at pp 16 x 128 microbatches): that clock is ``simulate``'s, to the rounding."""
    rng = random.Random(1)
    for pp, m in ZBV:
        for costs in [MEASURED] + [random_costs(rng, pp) for _ in range(4)]:
            for reserve in (False, True):
                clocked = _zb_v_clocked(pp, m, costs, reserve)
                if clocked is None:
                    continue
                plan = PipelinePlan(pp, m, 2, "zb-v", clocked[0], placement="v")
                assert clocked[1] == pytest.approx(simulate(plan, stage_costs(costs, 2 * pp)).makespan, rel=1e-12)


def test_the_costs_measured_on_cpu_ranks_give_a_shorter_plan():
    unit, fitted = build_plan("zb-v", 2, 8, 2), build_plan("zb-v", 2, 8, 2, costs=MEASURED)
    assert fitted.actions != unit.actions
    assert simulate(fitted, MEASURED).makespan < simulate(unit, MEASURED).makespan - 4  # 109.4 against 113.5
    # a rank that fills up with chunk-0 forwards would wait for itself: the scheduler then keeps the
    # last slot for the chunk-1 forward, and still writes a valid plan
    stuck = {(0, "F"): 1.62, (0, "I"): 0.70, (0, "W"): 1.30, (1, "F"): 1.77, (1, "I"): 2.83, (1, "W"): 0.77,
             (2, "F"): 1.88, (2, "I"): 2.27, (2, "W"): 1.87, (3, "F"): 2.54, (3, "I"): 1.85, (3, "W"): 2.91}
    assert zb_v_timed(2, 6, stuck) is None and zb_v_timed(2, 6, stuck, reserve=True) is not None
    steps(lower(build_plan("zb-v", 2, 6, 2, costs=stuck)))


def test_measured_costs_are_the_median_per_stage_and_kind_of_a_timeline():
    events = [dict(action=f"{s}{k}{i}", kind="compute", start=0.0, end=d, stage=s)
              for s, k, i, d in [(0, "F", 0, 0.002), (0, "F", 1, 0.004), (0, "F", 2, 0.003), (0, "I", 0, 0.0),
                                 (0, "W", 0, 0.005), (1, "F", 0, 0.001), (1, "I", 0, 0.002), (1, "W", 0, 0.001)]]
    events.append(dict(action="0SF0", kind="comm", start=0.0, end=1.0))  # communication is no cost
    events.append(dict(name="paused", kind="idle", start=0.0, end=9.0))
    assert measured_costs(events, range(2)) == {(0, "F"): 0.003, (0, "I"): 0.0, (0, "W"): 0.005,
                                                (1, "F"): 0.001, (1, "I"): 0.002, (1, "W"): 0.001}
    with pytest.raises(RuntimeError, match="no measured duration for 2F, 2I, 2W: run a training step"):
        measured_costs(events, range(3))


def test_on_a_gpu_the_measured_cost_is_the_actions_device_seconds():
    """A GPU's compute action is issued in microseconds and runs for milliseconds: its CUDA events' seconds
    (``device_seconds``, which the executor sets on CUDA) are its cost, not the host's issue time."""
    events = [dict(action=f"0{k}0", kind="compute", start=0.0, end=1e-5, device_seconds=d, stage=0)
              for k, d in (("F", 0.004), ("I", 0.002), ("W", 0.003))]
    assert measured_costs(events, range(1)) == {(0, "F"): 0.004, (0, "I"): 0.002, (0, "W"): 0.003}


@pytest.mark.parametrize("costs, words", [
    ({"F": 1, "I": 1}, ["missing (0, 'W')", "kind defaults"]),
    ({"F": 1, "I": -1, "W": 1}, ["stage 0's I must be a finite number >= 0"]),
    ({"F": 1, "I": 1, "W": 1, (9, "F"): 1}, ["unknown cost keys [(9, 'F')]", "stage in 0..3"]),
    ({"F": 1, "I": 1, "W": 1, "B": 2}, ["unknown cost keys ['B']"]),
])
def test_bad_costs_are_refused_with_the_rule(costs, words):
    with pytest.raises(ValueError) as info:
        build_plan("zb-v", 2, 4, 2, costs=costs)
    for w in words:
        assert w in str(info.value), str(info.value)
    assert stage_costs({"F": 1, "I": 2, "W": 3, (1, "W"): 0}, 2)[1, "W"] == 0.0


def test_costs_shape_only_zb_v():
    with pytest.raises(ValueError, match="costs shape only the zb-v schedule .* not 'zb-h1'"):
        build_plan("zb-h1", 2, 4, costs={"F": 1, "I": 1, "W": 1})


def test_flop_costs_plan_and_replan_keeps_the_shorter():
    """The engine's first V is ordered on the stages' FLOPs (``flop_costs``): under the costs bench/pp.py
    measured on CPU ranks (d=128 x 8, pp=2) it simulates shorter than the unit-step V; and
    ``shorter_plan`` (what ``replan()`` installs) keeps whichever of two plans those costs favour."""
    from colab_kit.models import GPTConfig
    from colab_kit.pipeline.costs import flop_costs, shorter_plan

    measured = {(0, "F"): 3.58, (0, "I"): 0.01, (0, "W"): 7.03, (1, "F"): 3.83, (1, "I"): 4.38, (1, "W"): 2.82,
                (2, "F"): 3.80, (2, "I"): 4.53, (2, "W"): 2.88, (3, "F"): 4.16, (3, "I"): 4.59, (3, "W"): 2.89}
    gpt = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=8)
    unit, flops = build_plan("zb-v", 2, 8, 2), build_plan("zb-v", 2, 8, 2, costs=flop_costs(gpt, 4))
    assert_one_f_i_w_each(flops, 2, 8)
    assert_f_i_w_in_order(flops, 2, 8)
    cost = stage_costs(measured, 4)
    assert simulate(flops, cost).makespan < 0.95 * simulate(unit, cost).makespan  # 182.6 against 198.6
    assert shorter_plan(unit, flops, measured) is flops and shorter_plan(flops, unit, measured) is flops
    assert shorter_plan(unit, unit, measured) is unit  # a tie keeps the first
