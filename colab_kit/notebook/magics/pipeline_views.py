"""What ``%colossal schedule`` and ``%colossal timeline`` show, as plain functions (no IPython).

``schedule_view`` builds a plan in the kernel (no cluster) and simulates it::

    >>> text, fig = schedule_view(pp=4, microbatches=8, schedule="1f1b")
    >>> print(text)
    1f1b, pp=4, microbatches=8 (planned: simulated with F=1, B=2, I=1, W=1 time units)
      bubble 27.3% of rank time (textbook (p-1)/(m+p-1) = 27.3%), makespan 33 units
      peak activations held per rank: 4, 3, 2, 1 microbatches

``timeline_view(cluster, "engine")`` gathers ``engine.timeline()`` from every rank: the
measured events of its last step, drawn with the idle gaps between them.
``profile_view(cluster, "engine", "batch")`` runs one profiled step of it on every rank
(``ck.profile(engine, batch)``) and draws each rank's intervals on one lane.
"""
from __future__ import annotations
from ...engine.core import Engine
from ...memory.timeline import memory_timeline, timeline_figure
from ...observe.profile import profile, profile_figure
from ...pipeline import build_plan, simulate
from ...pipeline.simulate import theory_bubble
from colab_kit.notebook.cluster.remote import namespace

from typing import Any

__all__ = ["schedule_view", "timeline_view", "profile_view", "NoTimeline", "no_engine"]

DEFAULTS: dict[str, Any] = {"pp": 4, "microbatches": 8, "schedule": "1f1b", "chunks": 1}


def schedule_view(config=None, *, pp=None, microbatches=None, schedule=None, chunks=None):
    """(summary text, simulated timeline figure) of a schedule; unset values come from ``config``
    (when it has pp > 1), else ``DEFAULTS`` (interleaved and zb-v default to chunks=2). Bad shapes raise
    ``ConfigError`` with the rule."""
    from ...viz.pipeline import schedule_figure

    base = config if config is not None and config.pp > 1 else None
    given = dict(pp=pp, microbatches=microbatches, schedule=schedule, chunks=chunks)
    v = {k: given[k] if given[k] is not None else getattr(base, k) if base is not None else DEFAULTS[k]
         for k in DEFAULTS}
    if chunks is None and v["schedule"] in ("interleaved", "zb-v") and v["chunks"] == 1:
        v["chunks"] = 2
    if chunks is None and v["schedule"] not in ("interleaved", "zb-v"):
        v["chunks"] = 1
    plan = build_plan(v["schedule"], v["pp"], v["microbatches"], v["chunks"])
    t = simulate(plan)
    p, m = plan.pp, plan.microbatches
    book = (p - 1) / (m + p - 1)
    own = theory_bubble(plan.schedule, p, m, plan.chunks)
    formula = {"interleaved": "(p-1)/(v*m+p-1)", "zb-h1": "(p-1)/(3m+p-1)",
               "zb-v": "(p-1)/(6m+p-1)"}.get(plan.schedule)
    lines = [f"{plan.schedule}, pp={p}, microbatches={m}" + (f", chunks={plan.chunks}" if plan.chunks > 1 else "")
             + " (planned: simulated with F=1, B=2, I=1, W=1 time units)",
             f"  bubble {t.bubble_fraction:.1%} of rank time (textbook (p-1)/(m+p-1) = {book:.1%}"
             + (f"; this schedule's {formula} = {own:.1%}" if formula else "") + f"), makespan {t.makespan:g} units",
             f"  peak activations held per rank: {', '.join(map(str, t.peak_activations))} microbatches"
             + (f" of one chunk (a chunk is 1/{plan.chunks} of the rank's layers)" if plan.chunks > 1 else "")]
    if t.peak_held != t.peak_activations:
        lines.append(f"  (held until the W pass, as colab_kit's executor does: {', '.join(map(str, t.peak_held))})")
    if plan.schedule == "zb-v":
        lines.append("  (the unit-step V; an engine orders its V on its stages' FLOPs, "
                     "ck.pipeline.build_plan_for(config, model_cfg), and engine.pipeline.replan() on measured costs)")
    return "\n".join(lines), schedule_figure(t)


class NoTimeline(LookupError):
    """The ranks have no engine of that name, or it has not trained a step."""


def _rank_timeline(var: str):
    """On a rank: the events of ``var``'s last step, or None when there is no such engine."""
    eng = namespace().get(var)
    return eng.timeline() if eng is not None and hasattr(eng, "timeline") else None


def _rank_holds(var: str) -> tuple[str | None, list[str]]:
    """On a rank: the type of what ``var`` holds (None: no such variable), and the variables holding an engine."""
    ns = namespace()
    held = type(ns[var]).__name__ if var in ns else None
    return held, sorted(n for n, v in list(ns.items()) if isinstance(v, Engine) and not n.startswith("_"))


def no_engine(cluster, var: str, then: str = "") -> str:
    """Why ``--var var`` names no engine on some ranks, and what would work (asks the ranks).

    Where ``var`` holds something else (``--var data``: a batch; ``--var model``), it says what (a tuple, a
    GPT), never advising to overwrite it with an engine; the variables that hold an engine on every rank are
    named (``--var NAME``); building one is suggested only where no rank holds any. ``then``: what to do next
    with the engine, ``{name}`` standing for its variable (``timeline``: train a step)."""
    try:
        got = cluster.run(_rank_holds, var, progress=None)
    except Exception:  # noqa: BLE001 - a cluster that cannot answer now: the plain rule, not its error
        return (f"no engine in a variable {var!r} on every rank (the ranks could not be asked what it holds): name "
                "the variable that holds one with --var NAME")
    missing = [r for r, (_, engines) in enumerate(got) if var not in engines]
    if not missing:
        return f"every rank holds an engine in {var!r} now: run the command again"
    kinds: dict[str | None, list[int]] = {}
    for r in missing:
        kinds.setdefault(got[r][0], []).append(r)
    said = [f"{var!r} on {_ranks(rs)} holds {_a(kind)}, not an engine" if kind else
            f"{_ranks(rs)} {'has' if len(rs) == 1 else 'have'} no engine in a variable {var!r}"
            for kind, rs in kinds.items()]
    everywhere = sorted(set.intersection(*(set(engines) for _, engines in got)))
    somewhere = sorted(set().union(*(engines for _, engines in got)) - set(everywhere))
    if everywhere:
        name = everywhere[0]
        fix = f"name one with --var NAME: the engines on every rank are in {', '.join(map(repr, everywhere))}"
    elif somewhere:
        name = "NAME"
        fix = (f"engines are in {', '.join(map(repr, somewhere))} on some ranks only: build the engine on every rank "
               f"(a %%colossal cell without --ranks) and name its variable with --var NAME")
    else:
        name = var if set(kinds) == {None} else "engine" if var != "engine" else "eng"  # never over the user's data
        build = f"{name} = ck.boost(model, optimizer_factory, config, mesh=mesh)"
        fix = (f"no variable on the ranks holds an engine: build one (in a %%colossal cell: {build}), or name its "
               f"variable with --var NAME" if name == var else
               f"no variable on the ranks holds an engine: build one under another name (in a %%colossal cell: "
               f"{build}) and give --var {name}")
    if then:
        fix += f"; then {then.format(name=name)}"
    return "; ".join(said) + ": " + fix


def _a(kind: str) -> str:
    return f"an {kind}" if kind[:1].lower() in "aeiou" else f"a {kind}"


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"


def timeline_view(cluster, var: str = "engine"):
    """(summary text, measured Gantt figure) of the last step of ``var`` on every rank.

    Raises ``NoTimeline`` saying what to do when a rank has no such engine or it has
    not trained a step yet.
    """
    from ...viz.pipeline import schedule_figure
    from ...viz.schedule_data import event_cells, measured_bubble

    got = cluster.run(_rank_timeline, var)
    if any(events is None for events in got):
        raise NoTimeline(no_engine(cluster, var, then="train a step first if it has not ({name}.train_step(batch) "
                                                      "in a %%colossal cell)"))
    if not any(got):
        raise NoTimeline(f"the engine {var!r} on the ranks has not trained a step yet: "
                         f"run {var}.train_step(batch) on every rank first")
    totals: dict = {}
    for c in event_cells(got, idle=True):
        if c.lane == 0:
            kind = "idle" if c.kind == "idle" else "comm" if c.kind in ("SF", "RF", "SB", "RB", "comm") else "compute"
            totals.setdefault(c.rank, {"compute": 0.0, "comm": 0.0, "idle": 0.0})[kind] += c.end - c.start
    lines = [f"last step of {var!r} on {len(got)} ranks (measured; ms since each rank's step began):"]
    lines += [f"  rank {r}: compute {t['compute']:.1f} ms, communication (sending, or waiting to receive) "
              f"{t['comm']:.1f} ms, idle {t['idle']:.1f} ms"
              for r, t in sorted(totals.items())]
    if any(e.get("action") for events in got for e in events):
        lines.append(f"  pipeline bubble (measured): {measured_bubble(got):.1%} of rank time")
    return "\n".join(lines), schedule_figure(got)


def _rank_profile(var: str, data: str, run: bool, method: str = "profile"):
    """On a rank: what is missing for a profiled step of ``var`` on ``data`` (or, with ``run``, the result of
    ``var.<method>(batch)``: its Profile, or its MemoryTimeline)."""
    ns = namespace()
    eng, batch = ns.get(var), ns.get(data)
    if eng is None or not hasattr(eng, "train_step"):
        return f"no engine in a variable {var!r}"
    if batch is None:
        return f"no batch in a variable {data!r}"
    if run and method == "memory_timeline" and callable(batch):
        batch = batch(eng.step_count)
    report = profile if method == "profile" else memory_timeline
    return report(eng, batch) if run else None


def _checked(cluster, var: str, data: str, method: str) -> list:
    """Every rank's ``var.<method>(data)``, once every rank is known to have both (``NoTimeline`` if not)."""
    missing = {r: why for r, why in enumerate(cluster.run(_rank_profile, var, data, False, method)) if why}
    if any(why.startswith("no engine") for why in missing.values()):  # what --var holds instead, where engines are
        raise NoTimeline(no_engine(cluster, var))
    if missing:
        raise NoTimeline(f"ranks {sorted(missing)}: {next(iter(missing.values()))}: define {var} = ck.boost(...) "
                         f"and {data} = (inputs, targets) (or a function step -> batch) on every rank, "
                         f"or name them with --var and --data")
    return cluster.run(_rank_profile, var, data, True, method)


def profile_view(cluster, var: str = "engine", data: str = "batch"):
    """(summary text, one lane per rank figure) of one step of ``var`` on ``data`` profiled on every rank
    (``colab_kit.observe.profile``); ``NoTimeline`` saying what to define where a rank lacks either (checked on
    every rank before any of them steps)."""
    got = _checked(cluster, var, data, "profile")
    lines = [f"one profiled step of {var!r} on {len(got)} ranks (measured with torch.profiler):"]
    lines += [f"  {p.summary()}" for p in got]
    return "\n".join(lines), profile_figure(got)


def memory_timeline_view(cluster, var: str = "engine", data: str = "batch"):
    """(text, figure) of one step of ``var`` on ``data`` with every rank's memory over the step (sampled after
    each op on CPU, CUDA's allocator log on a GPU: ``colab_kit.memory.timeline``): per rank its peak, the
    categories there and its largest storages."""
    got = _checked(cluster, var, data, "memory_timeline")
    how = ("from CUDA's allocator log" if all(tl.source == "cuda history" for tl in got)
           else "measured after every op" if all(tl.source == "dispatch" for tl in got) else "measured")
    lines = [f"memory over one step of {var!r} on {len(got)} ranks ({how}):"]
    for tl in got:
        lines.append(f"  {tl.summary()}")
        for row in tl.alive_at_peak[:3]:
            what = row["name"] or f"{row['op']} {row['shape']}"
            lines.append(f"      {row['nbytes'] / 1e6:8.3f} MB  {row['category']:<12} {what}")
    return "\n".join(lines), timeline_figure(got)
