"""``ck.profile(engine, batches, steps=1)``: this rank's training steps under ``torch.profiler``, cut into
compute, communication (by mesh axis), copy and idle, with the share of communication hidden behind
compute, and a Chrome / Perfetto trace of one rank or of every rank (``merge_traces``).

Every rank calls it, as it calls ``train_step``. ``batches``: one batch ``(inputs, targets)`` for every
step, a function ``step -> batch`` (0, 1, ...) or an iterable of batches; ``local`` goes to
``train_step``. Rank 0 of dp=2 x tp=2 (4 CPU ranks with gloo on 2 cores)::

    p = ck.profile(engine, data.batch(1, 8))     # one step; p.losses == [its loss]
    p.intervals[4:6]  # seconds since the profile began, back to back from 0 to p.wall
    # [Interval(start=0.00037, end=0.00057, kind='compute', name='forward 0', axis=None, record=None),
    #  Interval(start=0.00057, end=0.00123, kind='comm', name='all_reduce@tp (g forward)', axis='tp', record=0)]
    p.totals()     # {'compute': 0.0053, 'comm': 0.0273, 'copy': 0.0, 'idle': 0.0026}
    p.by_axis()    # {'tp': 0.0252, 'dp': 0.0022}: waited in, by axis (with ZeRO also "ZeRO all_gather", ...;
                   # under sp the dp reduction is 'dp_sp')
    p.summary()    # 'rank 0: 35.2 ms: compute 5.3, communication 27.3 (tp 25.2, dp 2.2), copy 0.0, idle 2.6 ms;
                   #  0% of 17.3 ms communication hidden'   (p.overlap == 0.0: tp's all-reduces block)
    p.chrome_trace("rank0.json")   # ui.perfetto.dev; merge_traces(profiles, path): every rank, a lane each

The training thread's wall interval is cut into intervals; the first rule that holds names each:

comm     blocked on a collective the engine recorded (``mesh.log``): a blocking call from launch to
         return, an async one (gradient buckets, ZeRO's prefetched gathers, pipeline sends and receives)
         from its ``wait()`` to return. One interval per record of the steps (``record``: its index in
         ``Profile.records``), named op@axis (tag), ZeRO's dp gathers and reduce-scatters "ZeRO ...".
copy     a top-level copy op (aten::copy_, to, _to_copy, pin_memory): host <-> device and offload
         copies on a GPU; without one (the device is an account over host memory) host copies.
compute  any other op the profiler saw on the thread (an async collective's launch too), and gaps
         between ops shorter than ``min_idle`` (Python between two ops).
idle     the rest: no op, no recorded collective (a pipeline rank between its actions).

Overlap: gloo runs each collective in a worker thread, and the profiler records that run
(``gloo:all_reduce``, ...; ``nccl:*`` on a GPU); each record takes the first free one of its op that
starts within its launch..ready span (gloo runs a reduce-scatter as an all-reduce, ``comm.all_reduce``
a pair's small sum as an all-gather; ``matched`` counts them). A record's communication time is that
backend span (its own launch..ready where none matched; a receive's runs from its post, so it holds the wait for
the sender); the part of it while the training thread ran compute or copy is hidden. A blocking collective is hidden
0 (the thread waits in it); a bucket all-reduce that gloo ran while backward went on is hidden whole.
``overlap`` = hidden / communication time over the records (0 without any).
"""
from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import Axis
from ..comm.collectives import one_shot_record


__all__ = ["Interval", "Profile", "ProfileError", "profile", "check_profile", "merge_traces", "profile_figure",
           "KINDS", "engine_phases"]

KINDS = ("compute", "comm", "copy", "idle")
COPY_OPS = ("aten::copy_", "aten::to", "aten::_to_copy", "aten::pin_memory")
_MARK = "colab_kit.observe.profile"
_FAMILIES = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all", "broadcast", "reduce", "send", "recv")


class ProfileError(ValueError):
    """A Profile whose intervals do not cover its wall interval once, or do not match its records."""


@dataclass
class Interval:
    start: float            # seconds since the profile began (this rank's clock)
    end: float
    kind: str               # one of KINDS
    name: str
    axis: str | None = None  # comm: the mesh axis of its record
    record: int | None = None  # comm: its index in Profile.records


@dataclass
class Profile:
    """One rank's profiled steps (see the module docstring); plain data, picklable, times in seconds."""

    rank: int
    config: str
    start: float            # time.perf_counter() when the profile began (monotonic: one clock per host)
    wall: float             # the profiled steps' wall time on this rank
    intervals: list = field(default_factory=list)
    records: list = field(default_factory=list)   # the engine's CommRecords of these steps, in order
    spans: list = field(default_factory=list)     # per record: (start, end) of its communication time
    hidden: list = field(default_factory=list)    # per record: seconds of it hidden behind compute / copy
    steps: list = field(default_factory=list)     # (start, end) of each step
    losses: list = field(default_factory=list)
    matched: int = 0        # records matched to a backend event of the profiler
    profiler_wall: float = 0.0  # the same wall interval as the profiler measured it
    outer_wall: float = 0.0     # this rank's clock around the profiler's mark: profiler_wall lies in [wall, outer_wall]

    def totals(self) -> dict:
        return {k: sum(iv.end - iv.start for iv in self.intervals if iv.kind == k) for k in KINDS}

    def by_axis(self) -> dict:
        out: dict = {}
        for iv in self.intervals:
            if iv.kind == "comm":
                key = iv.name.split(" (")[0] if iv.name.startswith("ZeRO") else iv.axis
                out[key] = out.get(key, 0.0) + iv.end - iv.start
        return out

    @property
    def overlap(self) -> float:
        total = sum(b - a for a, b in self.spans)
        return sum(self.hidden) / total if total > 0 else 0.0

    def summary(self) -> str:
        t, ms = self.totals(), lambda s: f"{s * 1e3:.1f}"
        axes = ", ".join(f"{k} {ms(v)}" for k, v in self.by_axis().items())
        return (f"rank {self.rank}: {ms(self.wall)} ms: compute {ms(t['compute'])}, communication {ms(t['comm'])}"
                f"{f' ({axes})' if axes else ''}, copy {ms(t['copy'])}, idle {ms(t['idle'])} ms; "
                f"{self.overlap:.0%} of {ms(sum(b - a for a, b in self.spans))} ms communication hidden")

    def chrome_trace(self, path=None) -> dict:
        """This rank's trace (``merge_traces([self], path)``)."""
        return merge_traces([self], path)


def profile(engine, batches, steps: int = 1, *, local: bool | None = None, min_idle: float = 50e-6) -> Profile:
    """Run ``steps`` training steps of ``engine`` under ``torch.profiler``; this rank's ``Profile``. They are
    real steps: the optimizer steps, and ``engine.records`` and ``timeline()`` have them."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive whole number, got {steps!r}")
    batch_of = _batch_source(batches)
    log, cuda = engine.mesh.log, engine.mesh.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    first, losses, bounds = len(log.records), [], []
    with torch.profiler.profile(activities=acts) as prof:
        pre = time.perf_counter()
        with torch.profiler.record_function(_MARK):
            t0 = time.perf_counter()
            for i in range(steps):
                s = time.perf_counter()
                losses.append(engine.train_step(batch_of(i), local=local))
                if cuda:
                    torch.cuda.synchronize()
                bounds.append((s - t0, time.perf_counter() - t0))
            wall = time.perf_counter() - t0
        outer = time.perf_counter() - pre
    records = log.records[first:]
    p = Profile(engine.mesh.global_rank, engine.config.describe(), t0, wall, records=list(records),
                steps=bounds, losses=losses, outer_wall=outer)
    times = [(r.end - t0 - r.seconds, r.end - t0, r.waited - t0 if r.waited is not None else None)
             for r in records]  # (launch, ready, wait called) of each record, since t0 (the records' own stamps)
    _build(p, engine, prof.events(), times, min_idle)
    return p


def _batch_source(batches):
    if callable(batches):
        return batches
    if isinstance(batches, (tuple, list)) and batches and isinstance(batches[0], torch.Tensor):
        return lambda step: batches
    it = iter(batches)
    return lambda step: next(it)


def _family(name: str) -> str | None:
    flat = name.lower().replace("_", "").replace("tensor", "").replace("base", "")
    return next((f for f in _FAMILIES if f.replace("_", "") in flat), None)


def _build(p: Profile, engine, events, times, min_idle: float) -> None:
    """Intervals, backend spans and hidden seconds of ``p`` from the profiler's ``events`` and each
    record's ``(launch, ready, wait called or None)``, all in seconds since ``p.start``."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    mark = next(e for e in cpu if e.name == _MARK)
    base, p.profiler_wall = mark.time_range.start, (mark.time_range.end - mark.time_range.start) * 1e-6

    def at(us):
        return (us - base) * 1e-6

    tops = [e for e in cpu if e.cpu_parent is mark and e.thread == mark.thread]
    compute = _union([(at(e.time_range.start), at(e.time_range.end)) for e in tops])
    copies = _union([(at(e.time_range.start), at(e.time_range.end)) for e in tops  # aten::to to its own device:
                     if e.name in COPY_OPS and (e.name != "aten::to" or e.cpu_children)])  # no copy, no child
    blocked, last = [], 0.0
    for launch, ready, wait in times:  # disjoint on one thread; clipped to each other and to the wall
        a = min(max(wait if wait is not None else launch, last, 0.0), p.wall)
        last = max(a, min(ready, p.wall))
        blocked.append((a, last))
    backend = sorted((at(e.time_range.start), at(e.time_range.end), _family(e.name)) for e in events
                     if e.name.startswith(("gloo:", "nccl:")))
    used, p.spans = set(), [None] * len(times)
    for i in sorted(range(len(times)), key=lambda i: times[i][0]):  # in launch order: the backend's first
        launch, ready, _ = times[i]  # run of this op after it (gloo runs a reduce-scatter as an all-reduce;
        rec = p.records[i]  # a pair's small blocking all-reduce may be an all-gather: comm.all_reduce's one-shot)
        ops = ((rec.op, "all_reduce") if rec.op == "reduce_scatter"
               else ("all_reduce", "all_gather") if one_shot_record(rec) else (rec.op,))
        j = next((j for j, (a, b, f) in enumerate(backend) if j not in used and f in ops
                  and launch - 1e-3 <= a <= ready), None)
        used.add(j)  # (an async op's launch is taken after dist returned: gloo may have begun it already)
        p.spans[i] = (launch, ready) if j is None else (backend[j][0], max(backend[j][0], min(backend[j][1], ready)))
    p.matched = len(used - {None})
    p.intervals = _paint(p, engine, compute, copies, blocked, min_idle)
    busy = _union([(iv.start, iv.end) for iv in p.intervals if iv.kind in ("compute", "copy")])
    # hidden from the record's launch on: a backend span may begin up to the matching tolerance before it (the
    # clocks differ), and the compute just before a blocking call is not communication hidden behind it
    p.hidden = [_measure(busy, max(a, times[i][0]), b) for i, (a, b) in enumerate(p.spans)]


def _union(spans):
    out: list = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _inside(union, starts, t: float) -> bool:
    i = bisect.bisect_right(starts, t) - 1
    return i >= 0 and t < union[i][1]


def _measure(union, a: float, b: float) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union)


def engine_phases(engine, offset: float):
    """The engine's compute events of its last step (forward 0, backward 0, 1F0, optimizer step, ...)
    as ``(start, end, name)`` in the profile's seconds; none where its step's start is not known."""
    t0 = engine.step.t0
    return [(t0 - offset + e["start"], t0 - offset + e["end"], e["name"])
            for e in engine.timeline() if e["kind"] == "compute"]


def _merge(ivs: list) -> list:
    out: list[Interval] = []
    for iv in ivs:
        if out and out[-1].kind == iv.kind != "comm" and out[-1].name == iv.name:
            out[-1].end = iv.end
        else:
            out.append(iv)
    return out


def _paint(p: Profile, engine, compute, copies, blocked, min_idle: float) -> list:
    """The intervals: each record's blocked span as its comm interval (in order, 0 s long where it never
    blocked), the time between them cut where an op, a copy or an engine phase begins or ends."""
    phases = engine_phases(engine, p.start)
    cuts = sorted({t for u in (compute, copies) for s in u for t in s} | {t for a, b, _ in phases for t in (a, b)})
    copy_at, compute_at, out, pos = [a for a, _ in copies], [a for a, _ in compute], [], 0.0
    for i, (a, b) in enumerate([*blocked, (p.wall, p.wall)]):
        lo, hi = bisect.bisect_right(cuts, pos), bisect.bisect_left(cuts, a)
        for x, y in zip([pos, *cuts[lo:hi]], [*cuts[lo:hi], a]):
            mid = (x + y) / 2
            if y <= x:
                continue
            if _inside(copies, copy_at, mid):
                out.append(Interval(x, y, "copy", "copy"))
            elif _inside(compute, compute_at, mid):
                out.append(Interval(x, y, "compute", next((n for s, e, n in phases if s <= mid < e), "compute")))
            else:
                out.append(Interval(x, y, "idle", "idle"))
        if i < len(blocked):
            rec = p.records[i]
            zero = engine.config.zero and rec.axis in (Axis.DP, Axis.DP_SP) \
                and rec.op in ("all_gather", "reduce_scatter")
            name = (f"ZeRO {rec.op}" if zero else f"{rec.op}@{rec.axis}") + (f" ({rec.tag})" if rec.tag else "")
            out.append(Interval(a, b, "comm", name, rec.axis, i))
        pos = b
    out = _merge(out)
    for i, iv in enumerate(out):  # gaps between ops shorter than min_idle (Python): the compute beside them
        near = [out[j] for j in (i - 1, i + 1) if 0 <= j < len(out) and out[j].kind == "compute"]
        if iv.kind == "idle" and iv.end - iv.start < min_idle and near:
            iv.kind, iv.name = "compute", near[0].name
    return _merge(out)


def check_profile(p: Profile, tol: float = 0.05, slack: float = 1e-4) -> None:
    """Raise ``ProfileError`` unless ``p``'s intervals run back to back from 0 to ``p.wall`` (no gap, no
    overlap), sum to ``p.wall`` within ``tol``, the profiler's own measure of the steps lies between ``p.wall``
    and ``p.outer_wall`` (this rank's clock read inside and outside the profiler's mark: a rank descheduled
    between two reads widens the bracket, never breaks it) within ``tol`` plus ``slack`` s of clock grain,
    and its comm intervals are its records one to one (same count, order and axes)."""
    ivs, eps = p.intervals, 1e-9
    if not ivs or abs(ivs[0].start) > eps or abs(ivs[-1].end - p.wall) > eps:
        span = f"{ivs[0].start}..{ivs[-1].end}" if ivs else "nothing"
        raise ProfileError(f"rank {p.rank}: intervals span {span}, the wall 0..{p.wall}")
    for a, b in zip(ivs, ivs[1:]):
        if abs(b.start - a.end) > eps:
            what = "gap" if b.start > a.end else "overlap"
            raise ProfileError(f"rank {p.rank}: a {what} between {a} and {b}")
    for iv in ivs:
        if iv.kind not in KINDS or iv.end < iv.start:
            raise ProfileError(f"rank {p.rank}: bad interval {iv}")
    total = sum(iv.end - iv.start for iv in ivs)
    if abs(total - p.wall) > tol * p.wall:
        raise ProfileError(f"rank {p.rank}: intervals sum to {total:.6f} s, the wall is {p.wall:.6f} s")
    low, high = p.wall * (1 - tol) - slack, max(p.wall, p.outer_wall) * (1 + tol) + slack
    if not low <= p.profiler_wall <= high:
        raise ProfileError(f"rank {p.rank}: intervals sum to {total:.6f} s, the profiler's wall is "
                           f"{p.profiler_wall:.6f} s, outside [{low:.6f}, {high:.6f}] around this rank's own clock")
    got = [(iv.record, iv.axis) for iv in ivs if iv.kind == "comm"]
    want = [(i, r.axis) for i, r in enumerate(p.records)]
    if got != want:
        raise ProfileError(f"rank {p.rank}: comm intervals (record, axis) {got} are not the records' {want}")


def merge_traces(profiles, path=None) -> dict:
    """One Chrome / Perfetto trace of ``profiles`` (one per rank): a process per rank, its training thread
    (the intervals) and its communication as the backend ran it (``spans``, hidden seconds in ``args``).
    Ranks are placed on their hosts' monotonic clock, from the earliest start: ranks of one host line up
    (clocks of different hosts do not). Written as JSON to ``path`` when given; returned either way."""
    t0, out = min(p.start for p in profiles), []
    for p in profiles:
        off, pid = p.start - t0, p.rank
        out += [{"ph": "M", "name": n, "pid": pid, "tid": tid, "args": args} for n, tid, args in (
            ("process_name", 0, {"name": f"rank {pid} ({p.config})"}), ("process_sort_index", 0, {"sort_index": pid}),
            ("thread_name", 0, {"name": "training thread"}), ("thread_name", 1, {"name": "communication (backend)"}))]
        out += [{"ph": "X", "name": iv.name, "cat": iv.kind, "pid": pid, "tid": 0, "ts": _us(off + iv.start),
                 "dur": _us(iv.end - iv.start), "args": {"axis": iv.axis, "record": iv.record}} for iv in p.intervals]
        out += [{"ph": "X", "name": f"{r.op}@{r.axis}", "cat": "comm", "pid": pid, "tid": 1, "ts": _us(off + a),
                 "dur": _us(b - a), "args": {"tag": r.tag, "bytes": r.bytes, "hidden_s": h}}
                for r, (a, b), h in zip(p.records, p.spans, p.hidden)]
    trace = {"traceEvents": out, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


_COLOURS = {"compute": "#4c78a8", "comm": "#f58518", "copy": "#54a24b", "idle": "#d3d3d3"}


def profile_figure(profiles, title: str = "Profiled step per rank (measured)"):
    """A plotly Gantt chart: one lane per rank, its intervals coloured by kind (ms since its start)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for kind in KINDS:
        ivs = [(f"rank {p.rank}", iv) for p in profiles for iv in p.intervals if iv.kind == kind]
        fig.add_bar(x=[(iv.end - iv.start) * 1e3 for _, iv in ivs], base=[iv.start * 1e3 for _, iv in ivs],
                    y=[lane for lane, _ in ivs], customdata=[iv.name for _, iv in ivs], orientation="h", name=kind,
                    marker_color=_COLOURS[kind], hovertemplate="%{customdata}<br>%{base:.3f} ms + %{x:.3f} ms")
    fig.update_layout(barmode="overlay", title=title, xaxis_title="ms since the rank's profile began", height=120
                      + 40 * max(1, len(profiles)), template="plotly_white", yaxis={"autorange": "reversed"})
    return fig
