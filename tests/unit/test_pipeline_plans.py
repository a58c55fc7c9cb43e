"""Tier 1: pipeline plans as data, with no processes.

Every schedule over a grid of shapes is checked (order rules at every timestep, before and
after lowering), simulated against the textbook bubble, and broken plans are shown to be
caught with the rank, position and rule named.
"""
from __future__ import annotations

import itertools

import pytest

from colab_kit.config import SCHEDULES as CONFIG_SCHEDULES
from colab_kit.config import ConfigError, ParallelConfig
from colab_kit.pipeline import (Action, PipelinePlan, PlanError, build_plan, build_plan_for, check, lower,
                                message_tag, parse, peer, simulate, steps)
from colab_kit.pipeline.schedules import SCHEDULE_PLACEMENT
from colab_kit.pipeline.simulate import theory_bubble

from tests.helpers import assert_f_i_w_in_order, assert_one_f_i_w_each

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")


def shapes():
    """(schedule, pp, microbatches, chunks): pp 1..5, microbatches 1..8 (zb-v, pp <= 4: to 3*pp), chunks 1..3."""
    for s, pp, m in itertools.product(SCHEDULES, range(1, 6), range(1, 13)):
        if s == "zb-v":
            if m <= (max(8, 3 * pp) if pp <= 4 else 8):
                yield s, pp, m, 2
        elif m > 8:
            continue
        elif s != "interleaved":
            yield s, pp, m, 1
        elif m % pp == 0:
            yield from ((s, pp, m, v) for v in (2, 3))


GRID = list(shapes())


def compute_events(timeline):
    return [[e for e in row if not e[2].is_comm] for row in timeline.events]


# --------------------------------------------------------------------------- the grid
def test_every_schedule_checks_lowers_and_simulates_over_the_grid():
    assert len(GRID) > 150
    for shape in GRID:
        plan = build_plan(*shape)
        lowered = check(lower(plan))
        check(plan)
        assert lowered.lowered and not plan.lowered and lowered.n_stages == plan.n_stages
        assert [lowered.compute(r) for r in range(plan.pp)] == plan.actions, shape
        # with free communication the lowered plan runs exactly like the compute plan
        assert compute_events(simulate(lowered)) == simulate(plan).events, shape
        assert PipelinePlan.parse(str(lowered), plan.schedule, lowered=True) == lowered, shape


def test_order_rules_hold_at_every_timestep_of_the_lockstep_run():
    """An oracle independent of check's dependency code: the timestep each action ran at."""
    for shape in GRID:
        plan = lower(build_plan(*shape))
        at = {a: t for t, row in enumerate(steps(plan)) for a in row if a is not None}
        n = plan.n_stages
        for a, t in at.items():
            s, mb = a.stage, a.microbatch
            bwd = lambda stage: at.get(Action(stage, "B", mb), at.get(Action(stage, "I", mb)))  # noqa: E731
            if a.kind == "F" and s > 0:
                assert at[Action(s - 1, "F", mb)] < t, (shape, a)
            if a.kind in ("B", "I"):
                assert at[Action(s, "F", mb)] < t, (shape, a)
                assert s == n - 1 or bwd(s + 1) < t, (shape, a)
            if a.kind == "W":
                assert at[Action(s, "I", mb)] < t, (shape, a)
            if a.kind in ("RF", "RB"):
                from colab_kit.pipeline.lowering import match
                assert at[match(a)] < t, (shape, a)


def test_each_action_sits_on_its_rank_and_each_stage_gets_every_microbatch():
    for s, pp, m, v in GRID:
        plan = build_plan(s, pp, m, v)
        assert len(plan.actions) == pp
        for r, row in enumerate(plan.actions):
            assert all(plan.rank_of(a.stage) == r for a in row)
            assert sorted({a.stage for a in row}) == sorted(plan.stages_of(r))
        kinds = ("I", "W") if s.startswith("zb") else ("B",)
        for kind in ("F",) + kinds:
            have = sorted((a.stage, a.microbatch) for row in plan.actions for a in row if a.kind == kind)
            assert have == sorted(itertools.product(range(pp * v), range(m))), (s, pp, m, v, kind)


def test_printed_plans_of_the_docstring():
    assert str(build_plan("1f1b", 4, 8)).splitlines()[0] == (
        "rank 0: 0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7")
    assert str(build_plan("1f1b", 4, 8)).splitlines()[3] == (
        "rank 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7")
    zb = str(build_plan("zb-h1", 4, 8)).splitlines()
    assert zb[3].startswith("rank 3: 3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4") and zb[3].endswith("3W4 3W5 3W6 3W7")
    assert str(lower(build_plan("1f1b", 2, 2))) == ("rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1\n"
                                                    "rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1")
    import colab_kit.pipeline.lowering as lowering
    import colab_kit.pipeline.schedules as mod
    for schedule in ("1f1b", "zb-h1"):
        for line in str(build_plan(schedule, 4, 8)).splitlines():
            assert line in mod.__doc__
    unwrapped = " ".join(mod.__doc__.split())  # the zb-v lines are wrapped after 24 actions
    for line in str(build_plan("zb-v", 4, 8, 2)).splitlines():
        assert line in unwrapped
    for line in str(lower(build_plan("zb-v", 2, 1, 2))).splitlines():
        assert line in lowering.__doc__
    assert "1RF2 2RB0 2I0 1I0 1SB0 2W0 1F2" in str(lower(build_plan("zb-v", 2, 4, 2))).splitlines()[1]
    assert "1RF2 2RB0 2I0 1I0 1SB0 2W0 1F2" in lowering.__doc__


def test_interleaved_follows_megatron_chunk_order():
    plan = build_plan("interleaved", pp=2, microbatches=4, chunks=2)
    # rank 0 holds stages 0 and 2: groups of pp microbatches through chunk 0, then chunk 1;
    # 2*(pp-1-r) + (v-1)*pp = 4 warm-up forwards, then 1F1B over virtual microbatches
    assert str(plan).splitlines()[0] == "rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    assert str(plan).splitlines()[1] == "rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    # m == pp: every forward first (Megatron's all-warm-up case)
    plan = build_plan("interleaved", pp=2, microbatches=2, chunks=2)
    assert [a.kind for a in plan.actions[1]] == ["F"] * 4 + ["B"] * 4


def test_pp1_interleaved_keeps_every_chunk_on_rank_0_without_communication():
    plan = lower(build_plan("interleaved", pp=1, microbatches=2, chunks=3))
    assert plan.pp == 1 and plan.n_stages == 3
    assert not any(a.is_comm for a in plan.actions[0])
    check(plan)


# --------------------------------------------------------------------------- zb-v
ZBV = [(pp, m) for pp in range(1, 5) for m in range(1, 3 * pp + 1)]


def test_zb_v_puts_two_chunks_per_rank_in_a_v():
    plan = build_plan("zb-v", 4, 8, 2)
    assert plan.placement == "v" and "placement='v'" in repr(plan)
    assert [plan.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [plan.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert build_plan("interleaved", 4, 8, 2).stages_of(0) == [0, 4]  # 'loop' as before
    assert set(SCHEDULE_PLACEMENT) == set(CONFIG_SCHEDULES) and SCHEDULE_PLACEMENT["zb-v"] == "v"
    assert [peer(parse(x), plan) for x in ("0SF0", "6SF0", "7SB0", "4SB0")] == [1, 0, 1, 3]  # 4SB0: the tip
    assert build_plan("zb-v", 1, 3, 2).stages_of(0) == [0, 1]  # pp=1: both chunks on rank 0
    # the tip of the V (stage 3 -> 4) is a hand-off in rank 3's memory; rank 0 talks to rank 1 both ways
    low = lower(plan)
    tip = [str(a) for a in low.actions[3] if a.is_comm and (a.stage, a.kind) in ((3, "SF"), (4, "RF"), (4, "SB"),
                                                                                 (3, "RB"))]
    assert tip == [] and not any(a.is_comm for a in lower(build_plan("zb-v", 1, 3, 2)).actions[0])
    assert {a.kind for a in low.actions[0] if a.is_comm} == {"SF", "RF", "SB", "RB"}
    assert {(a.stage, a.kind) for a in low.actions[0] if a.is_comm} == {(0, "SF"), (0, "RB"), (7, "RF"), (7, "SB")}
    # printed and read back: the schedule's name, or the actions alone, give the placement
    assert PipelinePlan.parse(str(plan), "zb-v") == plan
    assert PipelinePlan.parse(str(plan)).placement == "v"
    assert PipelinePlan.parse("rank 0: 0F0 2F0\nrank 1: 1F0 3F0").placement == "loop"
    with pytest.raises(ValueError, match="unknown placement 'w'"):
        PipelinePlan(2, 1, 2, "custom", placement="w")


def test_check_names_the_placement_of_a_misplaced_action():
    text = str(build_plan("zb-v", 2, 1, 2)).replace("3F0", "2F0", 1)  # 2F0 moved onto rank 0
    with pytest.raises(PlanError, match=r"2F0 belongs on rank 1 \('v' placement\)"):
        check(PipelinePlan.parse(text, "zb-v"))


def test_zb_v_has_exactly_one_f_i_and_w_per_stage_and_microbatch():
    for pp, m in ZBV:
        assert_one_f_i_w_each(build_plan("zb-v", pp, m, 2), pp, m)


def test_zb_v_runs_f_then_i_then_w_and_microbatches_in_order_on_each_rank():
    for pp, m in ZBV:
        assert_f_i_w_in_order(build_plan("zb-v", pp, m, 2), pp, m)


def test_zb_v_respects_dependencies_across_ranks_and_runs_to_the_end_lowered():
    for pp, m in ZBV:
        plan = build_plan("zb-v", pp, m, 2)
        at = {a: t for t, row in enumerate(steps(plan)) for a in row if a is not None}
        for a, t in at.items():
            s, mb = a.stage, a.microbatch
            if a.kind == "F" and s > 0:
                assert at[Action(s - 1, "F", mb)] < t, (pp, m, a)
            if a.kind == "I":
                assert at[Action(s, "F", mb)] < t and (s == 2 * pp - 1 or at[Action(s + 1, "I", mb)] < t), (pp, m, a)
        low = lower(plan)
        assert sum(a is not None for row in steps(low) for a in row) == sum(map(len, low.actions))  # no deadlock


def test_zb_v_holds_at_most_2p_chunk_microbatches_on_every_rank():
    for pp, m in ZBV:
        t = simulate(build_plan("zb-v", pp, m, 2))
        one_f_one_b_first_rank = simulate(build_plan("1f1b", pp, m)).peak_held[0]  # whole microbatches
        # held from F until W (the executor keeps a stage's input for W): 2*min(p, m) chunks, i.e.
        # what 1F1B's first rank holds, but on every rank
        assert t.peak_held == [2 * min(pp, m)] * pp == [2 * one_f_one_b_first_rank] * pp, (pp, m)


def test_zb_v_makespan_is_the_floor_6m_plus_p_minus_1_and_below_zb_h1():
    for pp, m in ZBV:
        v, h = simulate(build_plan("zb-v", pp, m, 2)), simulate(build_plan("zb-h1", pp, m))
        # rank p-1 idles p-1 chunk forwards before its first input, then runs 6m chunk passes
        assert v.makespan >= 6 * m + pp - 1
        if m >= pp:
            assert v.makespan == 6 * m + pp - 1, (pp, m)
            assert v.bubble_fraction == pytest.approx(theory_bubble("zb-v", pp, m, 2))
        # a chunk is half a rank's layers: in whole-rank units ZB-V's step is 3m + (p-1)/2 when m >= p
        if pp > 1:
            assert v.makespan / 2 < h.makespan and v.bubble_fraction < h.bubble_fraction, (pp, m)
        else:
            assert v.makespan / 2 == h.makespan == 3 * m and v.bubble_fraction == 0
    v, h, f = (simulate(build_plan(s, 4, 8, c)) for s, c in (("zb-v", 2), ("zb-h1", 1), ("1f1b", 1)))
    assert (v.makespan, h.makespan, f.makespan) == (51, 27, 33)  # the module docstring's figures
    assert [round(x.bubble_fraction, 3) for x in (v, h, f)] == [0.059, 0.111, 0.273]


# --------------------------------------------------------------------------- refused shapes
@pytest.mark.parametrize("args, words", [
    (("interleaved", 2, 3, 2), ["divisible by pp=2", "microbatches=2 or 4"]),
    (("interleaved", 2, 4, 1), ["chunks > 1", "chunks=2"]),
    (("1f1b", 2, 4, 2), ["needs schedule='interleaved'", "chunks=1"]),
    (("zb-v", 2, 4, 1), ["schedule='zb-v'", "needs chunks=2", "set chunks=2"]),
    (("gpipe", 2, 0, 1), ["microbatches must be a positive", "microbatches=1"]),
    (("gpipe", 0, 4, 1), ["pp must be a positive"]),
    (("zb-h2", 2, 4, 1), ["unknown schedule", "'zb-h1'"]),
])
def test_shapes_a_schedule_cannot_take_raise_config_error(args, words):
    with pytest.raises(ConfigError) as info:
        build_plan(*args)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_build_plan_for_a_config():
    cfg = ParallelConfig(pp=2, microbatches=4, schedule="interleaved", chunks=2)
    plan = build_plan_for(cfg)
    assert (plan.schedule, plan.pp, plan.microbatches, plan.chunks, plan.n_stages) == ("interleaved", 2, 4, 2, 4)


# --------------------------------------------------------------------------- parse, lowering helpers
def test_plan_parse_round_trip_and_inference():
    plan = build_plan("zb-h1", 3, 5)
    back = PipelinePlan.parse(str(plan), "zb-h1")
    assert back == plan and back.chunks == 1 and back.microbatches == 5 and not back.lowered
    bare = PipelinePlan.parse("0F0 1F0 1B0 0B0\n")  # no rank prefix; two stages on one rank
    assert (bare.pp, bare.chunks, bare.n_stages, bare.schedule) == (1, 2, 2, "custom")
    assert "PipelinePlan('zb-h1', pp=3" in repr(plan)
    with pytest.raises(ValueError, match="rank 1 .* rank 0 was expected"):
        PipelinePlan.parse("rank 1: 1F0")


def test_lowering_helpers_pair_the_two_ends():
    send, recv = parse("2SF0"), parse("3RF0")
    assert peer(send, 4) == 3 and peer(recv, 4) == 2
    assert message_tag(send, 8) == message_tag(recv, 8) != message_tag(parse("3SB0"), 8)
    assert message_tag(parse("3SB0"), 8) == message_tag(parse("2RB0"), 8)
    # the cross-chunk hop of the interleaved schedule: stage 1 (rank 1) -> stage 2 (rank 0)
    assert peer(parse("1SF0"), 2) == 0 and "1SF0" in str(lower(build_plan("interleaved", 2, 2, 2)))


def test_steps_runs_in_lockstep():
    rows = steps(lower(build_plan("1f1b", 2, 1)))
    assert [[str(a) if a else "." for a in row] for row in rows] == [
        ["0F0", "."], ["0SF0", "."], [".", "1RF0"], [".", "1F0"], [".", "1B0"], [".", "1SB0"],
        ["0RB0", "."], ["0B0", "."]]


# --------------------------------------------------------------------------- broken plans are caught
def refused(text: str, rule: str, rank: int, position: int | None) -> str:
    with pytest.raises(PlanError) as info:
        check(PipelinePlan.parse(text))
    e = info.value
    assert (e.rule, e.rank, e.position) == (rule, rank, position), str(e)
    assert isinstance(e, ValueError) and f"rank {rank}" in str(e)
    return str(e)


def test_check_catches_a_backward_before_its_forward():
    msg = refused("rank 0: 0B0 0F0\nrank 1: 1F0 1B0", "own", 0, 0)
    assert "0B0 comes before 0F0" in msg and "backward after its own forward" in msg


def test_check_catches_w_before_i_and_missing_or_duplicated_actions():
    assert "W after its I" in refused("rank 0: 0F0 0W0 0I0", "w", 0, 1)
    assert "no W for stage 1 microbatch 0" in refused("rank 0: 0F0 0I0 0W0\nrank 1: 1F0 1I0", "count", 1, None)
    assert "appears twice" in refused("rank 0: 0F0 0F0 0B0", "count", 0, 1)
    assert "belongs on rank 1" in refused("rank 0: 0F0 0B0 1F0\nrank 1: 1B0", "placement", 0, 2)


def test_check_catches_a_deadlocking_order_and_shows_the_stuck_grid():
    msg = refused("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0", "deadlock", 0, 1)
    assert "deadlocks at timestep 1" in msg
    assert "waits 0B0" in msg and "waits 1F1" in msg
    assert "0B0 waits for 1B0" in msg and "1F1 waits for 0F1" in msg


def test_check_catches_a_deadlocking_lowered_order():
    text = ("rank 0: 0F0 0SF0 0RB0 0B0 0F1 0SF1 0RB1 0B1\n"
            "rank 1: 1RF1 1F1 1B1 1SB1 1RF0 1F0 1B0 1SB0")
    msg = refused(text, "deadlock", 0, 2)
    assert "waits 0RB0" in msg and "waits 1RF1" in msg and "0RB0 waits for 1SB0" in msg


def test_check_catches_missing_and_misplaced_communication():
    good = str(lower(build_plan("1f1b", 2, 2)))
    assert "1F1 needs 1RF1 before it" in refused(good.replace(" 1RF1", ""), "recv", 1, 4)
    assert "0B1 needs 0RB1 before it" in refused(good.replace(" 0RB1", ""), "recv", 0, 6)
    assert "stage -1 does not exist" in refused(good.replace("0F0", "0RF0 0F0"), "send", 0, 0)
    assert "hand tensors over locally" in refused("rank 0: 0F0 0SF0 1RF0 1F0 1B0 0B0", "send", 0, 1)
    no_send = good.replace(" 1SB1", "")
    assert "1B1 produces 0B1's input but no 1SB1 follows it" in refused(no_send, "send", 1, 6)
    swapped = good.replace("0F0 0SF0", "0SF0 0F0")
    assert "before 0F0, the compute that produces" in refused(swapped, "send", 0, 0)
    out_of_order = good.replace("0RB0 0B0 0RB1 0B1", "0RB1 0B1 0RB0 0B0")
    assert "in the order they are sent" in refused(out_of_order, "fifo", 0, 4)


def test_swapped_order_in_a_generated_plan_is_caught():
    plan = build_plan("1f1b", 3, 4)
    plan.actions[1][0], plan.actions[1][2] = plan.actions[1][2], plan.actions[1][0]  # 1B0 before 1F0
    with pytest.raises(PlanError, match="rank 1 position 0: 1B0 comes before 1F0"):
        check(plan)


# --------------------------------------------------------------------------- simulated timelines
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_the_textbook_one(schedule):
    for pp, m in itertools.product(range(1, 6), range(1, 9)):
        t = simulate(build_plan(schedule, pp, m))
        assert t.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1)), (pp, m)
        assert t.makespan == 3 * (m + pp - 1)


def test_1f1b_holds_fewer_activations_than_gpipe():
    for pp, m in itertools.product(range(1, 6), range(1, 9)):
        assert simulate(build_plan("gpipe", pp, m)).peak_activations == [m] * pp
        assert simulate(build_plan("1f1b", pp, m)).peak_activations == [min(pp - r, m) for r in range(pp)]


def test_interleaved_shrinks_the_bubble_by_the_number_of_chunks():
    for pp, m, v in itertools.product(range(2, 6), range(1, 9), (2, 3)):
        if m % pp:
            continue
        t = simulate(build_plan("interleaved", pp, m, v))
        assert t.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1)), (pp, m, v)
        assert t.bubble_fraction < simulate(build_plan("1f1b", pp, m)).bubble_fraction


def test_zb_h1_has_a_smaller_bubble_than_1f1b_with_the_same_peak_activations():
    for pp, m in itertools.product(range(2, 6), range(1, 9)):
        zb, ref = simulate(build_plan("zb-h1", pp, m)), simulate(build_plan("1f1b", pp, m))
        assert zb.bubble_fraction < ref.bubble_fraction, (pp, m)
        assert zb.peak_activations == ref.peak_activations, (pp, m)
        # held until W as well: never above what 1F1B's first rank holds
        assert max(zb.peak_held) == max(ref.peak_held), (pp, m)
        if m >= pp:  # the paper's (p-1)(F+I-W) idle per rank: 3m + p - 1 time units
            assert zb.makespan == 3 * m + pp - 1
            assert zb.bubble_fraction == pytest.approx(theory_bubble("zb-h1", pp, m))


def test_costs_and_communication_time_are_respected():
    plan = lower(build_plan("1f1b", 2, 2))
    assert simulate(plan).makespan == 9
    slow = simulate(plan, costs={"SF": 1, "SB": 1})
    assert slow.makespan > 9
    for row in slow.events:
        for s, e, a in row:
            assert e - s == {"F": 1, "B": 2, "SF": 1, "SB": 1}.get(a.kind, 0)


def test_timeline_grid_and_records():
    t = simulate(build_plan("1f1b", 2, 3))
    lines = t.grid().splitlines()
    assert lines[0].split() == ["time", "|", "rank", "0", "|", "rank", "1"]
    assert lines[1].split() == ["0", "|", "0F0", "|", "."]
    assert lines[3].split() == ["2", "|", ".", "|", "1B0"]
    assert len(lines) == 1 + t.makespan and str(t) == t.grid()
    assert (t.makespan, t.bubble_fraction) == (12, 0.25)
    rec = t.records()
    assert len(rec) == 12 and rec[0] == dict(rank=0, start=0, end=1, action="0F0", stage=0, kind="F", microbatch=0)
    half = simulate(build_plan("zb-h1", 2, 2), costs={"F": 0.5, "I": 0.5, "W": 0.5})
    assert "0.5" in half.grid()


def test_simulate_refuses_a_broken_plan():
    with pytest.raises(PlanError, match="deadlock"):
        simulate(PipelinePlan.parse("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0"))
    with pytest.raises(PlanError):
        check(PipelinePlan(2, 1, 1, "custom", [[Action(0, "F", 0), Action(0, "B", 0)]]))  # one rank list for pp=2


def test_docstring_examples_are_true():
    import doctest
    import importlib

    # importlib: the package attributes ``check`` and ``simulate`` are the functions
    for name in ("schedules", "check", "simulate"):
        mod = importlib.import_module(f"colab_kit.pipeline.{name}")
        result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, mod.__name__
