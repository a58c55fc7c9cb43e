"""The pipeline's span in the cost model (``planner.cost``): the schedule's own plan, simulated with each
action's compute and collectives, on a core per rank or on shared cores (``shared.makespan``)."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=512)
def _plan(schedule: str, pp: int, m: int, chunks: int, model_key: tuple):
    """The plan the engine runs (``build_plan_for``) with ``simulate.prepare``'s dependencies, built once
    for all the costs it is timed under."""
    from ..config import ParallelConfig
    from ..pipeline import build_plan_for
    from ..pipeline.simulate import prepare
    cls, fields = model_key
    plan = build_plan_for(ParallelConfig(pp=pp, microbatches=m, schedule=schedule, chunks=chunks), cls(**dict(fields)))
    return plan, prepare(plan)


@functools.lru_cache(maxsize=4096)
def _pipeline_units(schedule: str, pp: int, m: int, chunks: int, recompute: bool,
                    model_key: tuple, costs: tuple = ()) -> tuple[float, float]:
    """(makespan, busy time of the busiest rank) of the plan the engine runs (``build_plan_for``),
    in units of one stage forward. ``model_key``: the model config's class and fields (hashable);
    ``costs``: (F, B, I, W) of every stage, then those the last stage adds (the head and the loss), in
    those units; () for the defaults (F = 1, B = 2, I = W = 1; B = 3 and I = 2 with recomputation)."""
    from ..pipeline import simulate
    plan, prepared = _plan(schedule, pp, m, chunks, model_key)
    if costs:
        table = dict(zip("FBIW", costs[:4]))
        table.update({(pp * chunks - 1, k): c + x for k, c, x in zip("FBIW", costs[:4], costs[4:])})
    else:
        table = {"F": 1, "B": 3, "I": 2, "W": 1} if recompute else {"F": 1, "B": 2, "I": 1, "W": 1}
    t = simulate(plan, table, prepared)
    return float(t.makespan), float(max(t.busy))


def _span(cfg, model_key, f: float, rc: float, c_fwd: float, c_bwd: float, head: float, cores: float,
          latency: float = 0.0, w: float | None = None) -> float:
    """Seconds from the first forward to the last action of the schedule, each action its compute at one
    rank's own speed (``f`` a forward, ``rc`` its recomputation) and the stage's tp and sp collectives it
    runs: F ``c_fwd``, B and I ``c_bwd`` (I computes the input gradients, which is where the backward's
    collectives are; W, the deferred weight gradients, has none); the recomputation runs in B or I; the
    last stage's actions also run the head and the loss (``head`` a forward of them; its backward,
    2 ``head``, split evenly between I and W). With a core per rank, ``pipeline.simulate``; with fewer
    cores than ranks, ``shared.makespan`` (a rank that waits leaves its core to those that compute).
    The ratios are rounded to 2 digits so that configs share a simulation (``ck.plan`` at scale
    prices thousands)."""
    w = f if w is None else w
    work = {"F": f, "B": 2 * f + rc, "I": 2 * f + rc - w, "W": w}
    wait = {"F": c_fwd, "B": c_bwd, "I": c_bwd, "W": 0.0}
    extra = {"F": head, "B": 2 * head, "I": head, "W": head}
    unit = f + c_fwd
    r2 = lambda x: float(f"{x / unit:.2g}")  # noqa: E731
    key = tuple((r2(work[k]), r2(wait[k]), r2(extra[k])) for k in "FBIW")
    if cores >= cfg.world_size:
        span, _ = _pipeline_units(cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks, cfg.recompute, model_key,
                                  tuple(w + c for w, c, _ in key) + tuple(x for _, _, x in key))
    elif cfg.dp > 1:
        # dp replicas of the pipeline meet only at the step's end; they drift apart (engine timelines,
        # dp=2 x pp=2 on 4 ranks / 2 cores: 3-5 ms within a step), so a core one replica's bubble frees
        # goes as often to the other replica, off the critical path, and the step waits for the later
        # one: every action at the speed of all ranks busy (``cores / ranks`` of its own)
        share = cores / cfg.world_size
        span, _ = _pipeline_units(cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks, cfg.recompute, model_key,
                                  tuple(w / share + c for w, c, _ in key) + tuple(x / share for _, _, x in key))
    else:
        span = _shared_units(cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks, model_key, key,
                             cfg.world_size // cfg.pp, float(f"{cores:.3g}"), r2(latency))
    return span * unit


@functools.lru_cache(maxsize=1024)
def _shared_units(schedule: str, pp: int, m: int, chunks: int, model_key: tuple, key: tuple, group: int,
                  cores: float, latency: float = 0.0) -> float:
    """``shared.makespan`` of the plan the engine runs, in the units of ``_span``'s key."""
    from .shared import makespan
    plan, _ = _plan(schedule, pp, m, chunks, model_key)
    costs = {k: (w, c) for k, (w, c, _) in zip("FBIW", key)}
    costs.update({(pp * chunks - 1, k): (w + x, c) for k, (w, c, x) in zip("FBIW", key)})
    return makespan(plan, costs, group, cores, latency)
