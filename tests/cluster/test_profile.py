"""``engine.profile`` and ``engine.memory_timeline``: each rank's step cut into compute / comm / copy / idle intervals, checked with
``colab_kit.observe.profile.check_profile`` (back to back from 0 to the wall, no gap or overlap, summing to the
wall within 5%, the profiler's own measure of it between the wall and this rank's clock read outside the
profiler's mark, within 5%; one comm interval per comm record, same axes);
the merged Chrome trace; made-up profiles that the same check rejects.

The memory timeline of a step begins and ends with what ``engine.memory()`` says the rank holds, its
activations reach the engine's own meter of the step, its model states peak where ``StatePeak`` (the
benchmarks' instrument) puts the next step's, and its peak is ``engine.memory()["step_peak"]``.

One spawn of 2 ranks profiles every config in turn (dp, tp, pp, ZeRO-2, ZeRO-3).
"""
import json

import pytest
import torch

import colab_kit as ck
from colab_kit.comm import CommRecord
from colab_kit.datasets import SyntheticTokens
from colab_kit.memory.peak import StatePeak
from colab_kit.memory.timeline import CATEGORIES, MemoryTimeline, timeline_figure
from colab_kit.models import GPT, GPTConfig
from colab_kit.observe.profile import Interval, Profile, ProfileError, check_profile, merge_traces, profile_figure

GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
CONFIGS = {"dp": dict(dp=2), "tp": dict(tp=2), "pp": dict(pp=2, microbatches=2), "zero2": dict(dp=2, zero=2),
           "zero3": dict(dp=2, zero=3)}


def profile_configs():
    """On each rank: one warm-up step, then one profiled step of every config."""
    data, out = SyntheticTokens(64, 16, seed=1), {}
    for name, kw in CONFIGS.items():
        torch.manual_seed(0)
        engine = ck.boost(GPT(GPT_CFG), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), ck.ParallelConfig(**kw))
        engine.train_step(data.batch(0, 8))
        p = ck.profile(engine, lambda step: data.batch(1 + step, 8))
        out[name] = {"profile": p, "comm": engine.comm(last_step=True), "record": engine.records[-1]}
        before = engine.memory()
        tl = ck.memory_timeline(engine, data.batch(2, 8))
        after = engine.memory()
        with StatePeak(engine.module, engine.optimizer, engine.data_parallel) as states:
            engine.train_step(data.batch(3, 8))
        out[name].update(timeline=tl, before=before, after=after, states_peak=states.peak,
                         roofs={k: ck.roofline(engine, c, peak=1e11) for k, c in ROOF_CONSTANTS.items()},
                         last=engine.comm(last_step=True), throughput=ck.throughput(engine))
        engine.close()
    return out


@pytest.fixture(scope="module")
def profiled():
    return ck.launch(profile_configs, 2)


def _consts(alpha: float, beta: float) -> dict:
    ops = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "sendrecv")
    return {"comm": {"2": {op: {"alpha": alpha * (2 if op == "all_reduce" else 1), "beta": beta} for op in ops}}}


ROOF_CONSTANTS = {"slow": _consts(1e-3, 1e8), "fast": _consts(1e-9, 1e15)}


AXES = {"dp": {"dp"}, "tp": {"tp"}, "pp": {"pp"}, "zero2": {"dp"}, "zero3": {"dp"}}


def test_intervals_cover_each_step_and_match_the_comm_records(profiled):
    for rank, res in enumerate(profiled):
        for name in CONFIGS:
            p, got = res[name]["profile"], res[name]
            check_profile(p)  # covers 0..wall once, sums to it within 5%, the profiler's wall bracketed, 1:1 records
            assert p.rank == rank and p.losses == [got["record"]["loss"]]
            assert [(r.op, r.axis, r.tag, r.bytes) for r in p.records] == \
                [(d["op"], d["axis"], d["tag"], d["bytes"]) for d in got["comm"]], (name, rank)
            comm = [iv for iv in p.intervals if iv.kind == "comm"]
            assert len(comm) == len(got["comm"]) > 0 and [iv.axis for iv in comm] == [d["axis"] for d in got["comm"]]
            assert AXES[name] <= {iv.axis for iv in comm}, (name, {iv.axis for iv in comm})
            assert got["record"]["seconds"] <= p.wall  # the engine's own step time, inside the profiled call
            totals = p.totals()
            assert totals["compute"] > 0 and sum(totals.values()) == pytest.approx(p.wall, rel=1e-6)
            assert 0.0 <= p.overlap <= 1.0 and len(p.hidden) == len(p.spans) == len(p.records)
            for (a, b), h, rec in zip(p.spans, p.hidden, p.records):
                assert 0.0 <= h <= b - a + 1e-9
                if rec.tag == "loss":  # a blocking collective: the training thread waits in it, nothing hidden
                    assert h == 0.0
            assert p.matched >= 1, (name, rank, p.matched)  # the profiler saw the backend run them
        names = {iv.name.split(" (")[0] for iv in res["zero2"]["profile"].intervals if iv.kind == "comm"}
        assert {"ZeRO reduce_scatter", "ZeRO all_gather", "all_reduce@dp"} <= names, names
        assert set(res["zero2"]["profile"].by_axis()) >= {"ZeRO reduce_scatter", "ZeRO all_gather", "dp"}
        dp = res["dp"]["profile"]
        assert {iv.name for iv in dp.intervals if iv.kind == "compute"} >= {"forward 0", "backward 0"}


def test_merged_chrome_trace_has_one_lane_per_rank(profiled, tmp_path):
    profiles = [res["pp"]["profile"] for res in profiled]
    path = tmp_path / "trace.json"
    merge_traces(profiles, path)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == [0, 1] and all(v.startswith(f"rank {k} ") for k, v in names.items())
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1} and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    for p in profiles:
        lane = [e for e in spans if e["pid"] == p.rank and e["tid"] == 0]
        assert len(lane) == len(p.intervals) and sum(e["dur"] for e in lane) == pytest.approx(p.wall * 1e6, rel=1e-3)
    one = profiles[1].chrome_trace()
    assert {e["pid"] for e in one["traceEvents"]} == {1}
    fig = profile_figure(profiles)
    assert {y for t in fig.data for y in t.y} == {"rank 0", "rank 1"}


def _made_up(**change) -> Profile:
    """A rank's step of 1 s: compute, a dp all-reduce, idle; ``change`` replaces fields."""
    ivs = [Interval(0.0, 0.4, "compute", "forward 0"), Interval(0.4, 0.6, "comm", "all_reduce@dp", "dp", 0),
           Interval(0.6, 1.0, "idle", "idle")]
    fields = dict(rank=0, config="dp=2", start=0.0, wall=1.0, intervals=ivs,
                  records=[CommRecord("all_reduce", "dp", 4096, 0.2)], spans=[(0.4, 0.6)], hidden=[0.0],
                  profiler_wall=1.0, outer_wall=1.001)
    fields.update(change)
    return Profile(**fields)


def test_the_check_rejects_gaps_overlaps_sums_and_unmatched_records():
    check_profile(_made_up())
    comp, comm, idle = _made_up().intervals
    bad = {"gap": [Interval(0.0, 0.35, "compute", "f"), comm, idle],
           "overlap": [Interval(0.0, 0.45, "compute", "f"), comm, idle],
           "span": [comp, comm, Interval(0.6, 0.9, "idle", "idle")]}
    for what, ivs in bad.items():
        with pytest.raises(ProfileError, match=what):
            check_profile(_made_up(intervals=ivs))
    for longer_or_shorter in (1.2, 0.8):  # the profiler saw more than this rank's outer clock, or less than its steps
        with pytest.raises(ProfileError, match="the profiler's wall"):
            check_profile(_made_up(profiler_wall=longer_or_shorter))
    check_profile(_made_up(profiler_wall=1.2, outer_wall=1.25))  # descheduled around the mark: the bracket widens
    with pytest.raises(ProfileError, match="not the records"):  # the record's axis differs
        check_profile(_made_up(records=[CommRecord("all_reduce", "tp", 4096, 0.2)]))
    with pytest.raises(ProfileError, match="not the records"):  # two records, one comm interval
        check_profile(_made_up(records=[CommRecord("all_reduce", "dp", 4096, 0.2)] * 2))
    with pytest.raises(ProfileError, match="bad interval"):
        check_profile(_made_up(intervals=[comp, Interval(0.4, 0.6, "network", "x"), idle]))


class _Cluster:
    """Stands in for a ``ck.Cluster``: ``run(fn, *args)`` answers for every rank with ``answer(args)``."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def run(self, fn, *args):
        self.calls.append(args)
        return self.answer(args)


def test_profile_view_draws_every_rank_and_refuses_a_missing_engine_before_any_step(profiled):
    from colab_kit.notebook.magics.pipeline_views import NoTimeline, profile_view

    profiles = [res["tp"]["profile"] for res in profiled]
    text, fig = profile_view(_Cluster(lambda args: profiles if args[2] else [None, None]), "engine", "batch")
    assert [line.split(":")[0] for line in text.splitlines()[1:]] == ["  rank 0", "  rank 1"] and "hidden" in text
    assert {y for t in fig.data for y in t.y} == {"rank 0", "rank 1"}
    missing = _Cluster(lambda args: [None, "no batch in a variable 'batch'"])
    with pytest.raises(NoTimeline, match=r"ranks \[1\]: no batch in a variable 'batch'"):
        profile_view(missing)
    assert missing.calls == [("engine", "batch", False, "profile")]  # checked only: no rank stepped


STATES = ("params", "grads", "optimizer")


def test_memory_timeline_meets_the_engines_own_instruments(profiled):
    for rank, res in enumerate(profiled):
        for name in CONFIGS:
            got = res[name]
            tl, before, after = got["timeline"], got["before"], got["after"]
            assert tl.rank == rank and len(tl.times) == len(tl.ops) > 100 and tl.times == sorted(tl.times)
            assert tl.held(0) == {**{k: before[k] for k in STATES}, "activations": 0, "in_flight": 0,
                                  "temporaries": 0}, (name, rank)
            assert {k: tl.held(-1)[k] for k in STATES} == {k: after[k] for k in STATES}, (name, rank)
            assert tl.held(-1)["activations"] == 0  # backward let go of everything it saved
            acts = max(tl.series["activations"])
            if name == "pp":  # the executor's count: each microbatch's saved bytes, held until its backward
                assert after["activations"] * 0.95 <= acts <= after["activations"] * 1.05, (name, acts, after)
            else:  # the engine's meter of the same step's forward, to the byte
                assert acts == after["activations"], (name, rank, acts, after["activations"])
            states = [sum(tl.series[c][i] for c in STATES + ("in_flight",)) for i in range(len(tl.times))]
            assert max(states) == got["states_peak"], (name, rank, max(states), got["states_peak"])
            assert after["step_peak"] == tl.peak == sum(tl.at_peak.values())
            assert tl.peak > sum(tl.held(0).values()) + acts // 2  # a step holds more than it begins with
            assert tl.alive_at_peak and sum(r["nbytes"] for r in tl.alive_at_peak) <= tl.peak
            assert tl.phase_at(tl.peak_index) != "between phases", tl.summary()
        assert res["zero2"]["timeline"].held(0)["grads"] * 2 == res["dp"]["timeline"].held(0)["grads"]


def test_memory_timeline_figure_and_a_wrong_timeline_is_not_its_peak(profiled):
    tls = [res["zero3"]["timeline"] for res in profiled]
    fig = timeline_figure(tls)
    stacked = [t for t in fig.data if t.stackgroup]
    assert len(stacked) == len(CATEGORIES) * 2 and {t.name for t in stacked} == set(CATEGORIES)
    marks = [t for t in fig.data if t.text == ("peak",)]
    assert [m.y[0] for m in marks] == [tl.peak / 1e6 for tl in tls]
    one = MemoryTimeline(0, "x", [0.0, 1.0], ["(start)", "(end)"],
                         {c: [1, 5] if c == "params" else [0, 0] for c in CATEGORIES})
    assert one.peak == 5 and one.peak_index == 1 and one.at_peak["params"] == 5 and one.phase_at(1) == "between phases"


def test_roofline_places_each_step_by_its_records_and_the_constants(profiled):
    from colab_kit.observe.roofline import roofline_figure

    for rank, res in enumerate(profiled):
        for name in CONFIGS:
            got = res[name]
            slow, fast = got["roofs"]["slow"], got["roofs"]["fast"]
            records = [r for r in got["last"] if r["axis"] in ("dp", "tp", "pp")]
            assert slow.wire_bytes == sum(r["wire"] for r in got["last"]) > 0, name
            alpha = lambda r: 2e-3 if r["op"] == "all_reduce" else 1e-3  # noqa: E731
            assert slow.comm_s == pytest.approx(sum(alpha(r) + r["wire"] / 1e8 for r in records), rel=1e-9)
            assert slow.latency_s == pytest.approx(sum(alpha(r) for r in records), rel=1e-9)
            assert slow.collectives == len(records) == sum(v[0] for v in slow.by_op.values())
            tp = got["throughput"]
            assert slow.flops == tp["flops_per_step"] / 2 and slow.compute_s == slow.flops / 1e11
            assert slow.measured_s == tp["step_seconds"] and slow.mfu == pytest.approx(slow.achieved / 1e11)
            assert slow.bound == "communication" and "latency" in slow.why()  # 1-2 ms a collective, tiny steps
            assert fast.bound == "compute" and fast.roof == 1e11 and slow.roof < 1e11
            assert slow.intensity == slow.flops / slow.wire_bytes and slow.ridge > slow.intensity
            assert fast.ridge < fast.intensity
    fig = roofline_figure([res[n]["roofs"]["slow"] for res in profiled[:1] for n in CONFIGS])
    markers = [t for t in fig.data if t.mode == "markers"]
    assert len(markers) == len(CONFIGS) and all(t.y[0] > 0 for t in markers)
