"""Pieces of the planner's cost model (``colab_kit.planner.local.step``) that need no processes: the pipeline's
span on shared cores, the zero-bubble split of a backward, recomputation and the constants' version."""
from __future__ import annotations

import pytest

import colab_kit as ck
from colab_kit.memory.estimator import config_estimate
from colab_kit.models import GPTConfig
from colab_kit.pipeline import build_plan, simulate
from colab_kit.planner import EXAMPLE_CONSTANTS
from colab_kit.planner.local.step import step_seconds
from colab_kit.planner.local.shared_cores import makespan

SMALL = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=4)


@pytest.mark.parametrize("schedule,pp,m", [("gpipe", 2, 3), ("1f1b", 4, 8), ("zb-h1", 3, 6), ("interleaved", 2, 4)])
def test_a_core_per_rank_is_the_schedules_own_timeline(schedule, pp, m):
    """With cores to spare, shared.makespan is pipeline.simulate's makespan for the same costs."""
    plan = build_plan(schedule, pp, m, **({"chunks": 2} if schedule == "interleaved" else {}))
    costs = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    want = simulate(plan, costs).makespan
    assert makespan(plan, {k: (v, 0.0) for k, v in costs.items()}, group=1, cores=64) == pytest.approx(want)
    # the same time split as work and waiting in collectives is the same span
    assert makespan(plan, {k: (v / 2, v / 2) for k, v in costs.items()}, cores=64) == pytest.approx(want)


def test_shared_cores_lie_between_the_two_bounds_and_waiting_holds_no_core():
    """pp=4 GPipe on 2 cores: no shorter than the work over the cores (12 s of it on each of 4 ranks: 24 s)
    or than the schedule with a core each (21 s), and shorter than every action at half speed (42 s); time
    spent waiting in a collective holds no core, so it costs less than the same time computing."""
    plan = build_plan("gpipe", 4, 4)
    shared = makespan(plan, {"F": (1, 0), "B": (2, 0)}, cores=2)
    assert 24 <= shared < 42 and shared >= simulate(plan).makespan
    assert shared == 27.0  # the fill and drain leave cores idle that no rank can use
    waiting = makespan(plan, {"F": (0.5, 0.5), "B": (1, 1)}, cores=2)
    assert waiting < shared


def test_a_message_latency_lies_on_the_path_from_stage_to_stage():
    """One microbatch through 2 stages: F0, F1, B1, B0 one after another, plus a message each way."""
    plan = build_plan("gpipe", 2, 1)
    costs = {"F": (1.0, 0.0), "B": (2.0, 0.0)}
    assert makespan(plan, costs, cores=64) == 6.0
    assert makespan(plan, costs, cores=64, latency=0.25) == 6.5


def _seconds(cfg: dict, consts=EXAMPLE_CONSTANTS, batch: int = 16):
    c = ck.ParallelConfig(**cfg)
    return step_seconds(SMALL, c, batch, consts, config_estimate(SMALL, c, batch, "adamw", host_share=None))


def test_recomputation_costs_its_measured_ops_and_runs_the_forwards_collectives_again():
    consts = dict(EXAMPLE_CONSTANTS, recompute={"op_seconds": 3 * EXAMPLE_CONSTANTS["dispatch"]["op_seconds"]})
    plain, parts, _ = _seconds({"dp": 2, "tp": 2}, consts)
    again, rparts, rcount = _seconds({"dp": 2, "tp": 2, "recompute": True}, consts)
    cheap, _, _ = _seconds({"dp": 2, "tp": 2, "recompute": True})  # constants without it: one forward's ops
    assert plain < cheap < again
    _, _, count = _seconds({"dp": 2, "tp": 2})
    assert rcount["tp"] - count["tp"] == SMALL.n_layers  # 1D: the attention's all-reduce again, not fc2's
    assert rparts["comm:tp"] > parts["comm:tp"]


def test_zero_bubble_w_is_the_weight_gradients_not_a_forward():
    """Where ops dominate (EXAMPLE_CONSTANTS: a slow matmul-free op cost), W is small, so ZB-H1 fills less of
    the bubble than F = I = W = 1 would say, and its Linears' extra ops are charged: not faster than 1F1B."""
    slow_ops = dict(EXAMPLE_CONSTANTS, dispatch={"op_seconds": 1e-4}, cores=1)
    zb, _, _ = _seconds({"pp": 4, "microbatches": 4, "schedule": "zb-h1"}, slow_ops)
    f1b, _, _ = _seconds({"pp": 4, "microbatches": 4, "schedule": "1f1b"}, slow_ops)
    assert zb >= f1b
    fast_ops = dict(EXAMPLE_CONSTANTS, dispatch={"op_seconds": 1e-9})  # FLOPs dominate: zero bubble pays off
    zb, zparts, _ = _seconds({"pp": 4, "microbatches": 4, "schedule": "zb-h1"}, fast_ops)
    f1b, fparts, _ = _seconds({"pp": 4, "microbatches": 4, "schedule": "1f1b"}, fast_ops)
    assert zb < f1b and zparts.get("bubble", 0) < fparts["bubble"]


def test_shared_cores_price_the_bubble_of_one_pipeline_and_of_its_replicas():
    """4 ranks on 2 cores: one pipeline (pp=4) hands an idle rank's core to the others, so its bubble is
    less than with a core per rank at the same per-rank speed; dp replicas (dp=2 x pp=2) drift apart and
    are priced at the speed of all ranks busy."""
    two, many = dict(EXAMPLE_CONSTANTS, cores=2), dict(EXAMPLE_CONSTANTS, cores=1024)
    _, parts, _ = _seconds({"pp": 4, "microbatches": 4}, two)
    _, own, _ = _seconds({"pp": 4, "microbatches": 4}, many)
    # the constants are what a rank does with every rank busy: the compute charged is the same
    assert parts["compute"] == pytest.approx(own["compute"], rel=1e-12)
    # a core per rank: the bubble is the schedule's, (p-1)/(m+p-1) = 3/7 of the span (a little less of the
    # fullest rank's time, which also runs the head); on 2 cores the idle ranks' cores absorb most of it
    assert 0.35 < own["bubble"] / (own["bubble"] + own["compute"]) <= 3 / 7
    # (GPipe pp=4 m=4: with a core each the span is 21 forwards against 12 charged, 9 idle; on 2 cores a
    # rank alone runs at twice the all-busy speed: 27 of those half forwards, 13.5, against 12 charged)
    assert 0 < parts["bubble"] < own["bubble"] / 3
    _, rparts, _ = _seconds({"dp": 2, "pp": 2, "microbatches": 2}, two)
    assert rparts["bubble"] > 0  # replicas priced at the all-busy speed: the schedule's own bubble


def test_cached_constants_of_another_version_are_measured_again(tmp_path, monkeypatch):
    import importlib
    import json

    mod = importlib.import_module("colab_kit.planner.local.constants")  # the module; ck.planner.constants is its function
    monkeypatch.setenv("COLAB_KIT_CACHE", str(tmp_path))
    path = mod.cache_path()
    stale = {"4": {"matmul": {"flops_per_s": 1.0}, "dispatch": {"op_seconds": 1.0}, "comm": {}}}
    tmp_path.joinpath(path.rsplit("/", 1)[1]).write_text(json.dumps(stale))
    assert mod.cached(4) is None  # version 1: its dispatch meant 3 times what it means now
    calls = []
    monkeypatch.setattr(mod, "measure", lambda ranks: calls.append(ranks) or dict(stale["4"], version=mod.VERSION))
    assert mod.constants(ranks=4)["version"] == mod.VERSION and calls == [4]  # the stale entry measured again
    assert mod.constants(ranks=4)["version"] == mod.VERSION and calls == [4]  # and then cached
    current = dict(stale["4"], version=mod.VERSION)
    assert mod.cached(4) == current
    # repeats: measured that many times, each figure the median (tests/ranks/test_planner.py measures once)
    rates = iter([9.0, 1.0, 2.0])
    monkeypatch.setattr(mod, "measure", lambda ranks: calls.append(ranks) or dict(
        current, matmul={"flops_per_s": next(rates)}))
    assert mod.constants(refresh=True, ranks=4, repeats=3)["matmul"] == {"flops_per_s": 2.0} and calls == [4] * 4
    assert mod.cached(4)["matmul"] == {"flops_per_s": 2.0}


def test_bound_ranks_share_only_their_own_core():
    """Ranks bound to cores (``launch.bind_rank``; the constants' ``bound``): a busy rank shares its core with
    the busy ranks bound to it, not with the whole machine. pp=4 GPipe on 2 cores puts stages 0 and 2 on one
    core: F of stages 0 and 2 at once run at half speed though stage 1's core may be idle (30 half-forwards
    against 27 shared freely); dp=2 x pp=2 puts each replica's two stages on one core, so a stage's bubble is
    its other stage's turn and the replica takes its two stages' work, nothing more."""
    from colab_kit.planner.local.bubble import placement
    plan4 = build_plan("gpipe", 4, 4)
    costs = {"F": (1, 0), "B": (2, 0)}
    assert placement(ck.ParallelConfig(pp=4), 2) == ((0,), (1,), (0,), (1,))
    assert makespan(plan4, costs, cores=2) == pytest.approx(27.0)
    assert makespan(plan4, costs, placement=[(0,), (1,), (0,), (1,)]) == pytest.approx(30.0)
    # a core per rank, bound or not: the schedule's own timeline
    assert makespan(plan4, costs, placement=[(0,), (1,), (2,), (3,)]) == pytest.approx(simulate(plan4).makespan)
    # dp=2 x pp=2: replica d on core d; 2 microbatches x (F + B) = 6 s of work per stage, 12 per core
    where = placement(ck.ParallelConfig(dp=2, pp=2), 2)
    assert where == ((0, 1), (0, 1))
    assert makespan(build_plan("gpipe", 2, 2), costs, placement=list(where)) == pytest.approx(12.0)
    with pytest.raises(ValueError, match="placement lists 1 pipeline ranks' cores, the plan has 2"):
        makespan(build_plan("gpipe", 2, 2), costs, placement=[(0,)])
    # in the step's price: bound, the replica's bubble is gone; not bound, it is the schedule's own
    two = dict(EXAMPLE_CONSTANTS, cores=2)
    _, free, _ = _seconds({"dp": 2, "pp": 2, "microbatches": 2}, two)
    _, bound, _ = _seconds({"dp": 2, "pp": 2, "microbatches": 2}, dict(two, bound=True))
    assert free["bubble"] > 0 and bound.get("bubble", 0.0) < free["bubble"] / 4


def test_the_optimizer_costs_its_ops_and_its_elements_passes():
    """With ``element_seconds`` (constants version 4) the optimizer's step is its ops plus its elements at
    that rate: the test GPT's 53 tensors x 10 ops and 210,304 elements, worked by hand; ZeRO 1 steps a
    quarter of the elements (on dp=4) in one flat piece per gradient bucket; SGD with momentum 3 passes of AdamW's 10;
    constants without the figure price one read and write of the bytes instead (the older model), which
    is less: the test fails if the figure is dropped or double-counted."""
    from colab_kit.planner.local.step import _optimizer

    consts = dict(EXAMPLE_CONSTANTS, optimizer={"op_seconds": 6e-6, "element_seconds": 1e-8})
    cfg = ck.ParallelConfig(dp=4)
    mem = config_estimate(SMALL, cfg, 16)
    assert mem["params"] == 4 * 210_304
    want = 53 * 10 * 6e-6 + 210_304 * 1e-8
    assert _optimizer(cfg, consts, mem, SMALL) == pytest.approx(want)
    z1 = ck.ParallelConfig(dp=4, zero=1)
    got = _optimizer(z1, consts, config_estimate(SMALL, z1, 16), SMALL)
    assert got == pytest.approx(2 * 10 * 6e-6 + 210_304 / 4 * 1e-8)  # two buckets: a core per rank here
    assert _optimizer(cfg, consts, mem, SMALL, "sgd-momentum") == pytest.approx(53 * 3 * 6e-6 + 210_304 * 1e-8 * 3 / 10)
    bf16 = ck.ParallelConfig(dp=4, precision="bf16")  # 2-byte parameters, the same elements (the fp32 masters)
    assert _optimizer(bf16, consts, config_estimate(SMALL, bf16, 16), SMALL) == pytest.approx(want)
    older = dict(consts, optimizer={"op_seconds": 6e-6})
    bytes_only = 53 * 10 * 6e-6 + 2 * (mem["params"] + mem["grads"] + mem["optimizer"]) / 1e10
    assert _optimizer(cfg, older, mem, SMALL) == pytest.approx(bytes_only) and bytes_only < want
