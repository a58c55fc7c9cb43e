"""The pipeline's span in the cost model (``planner.local.step``): the schedule's own plan, simulated with each
action's compute and collectives, on a core per rank or on shared cores (``shared_cores.makespan``)."""
from __future__ import annotations

import functools

from ...config import ParallelConfig
from ...pipeline import build_plan_for, simulate
from ...pipeline.simulate import prepare
from .shared_cores import makespan


@functools.lru_cache(maxsize=512)
def _plan(schedule: str, pp: int, m: int, chunks: int, model_key: tuple):
    """The plan the engine runs (``build_plan_for``) with ``simulate.prepare``'s dependencies, built once
    for all the costs it is timed under."""
    cls, fields = model_key
    plan = build_plan_for(ParallelConfig(pp=pp, microbatches=m, schedule=schedule, chunks=chunks), cls(**dict(fields)))
    return plan, prepare(plan)


@functools.lru_cache(maxsize=4096)
def _pipeline_units(schedule: str, pp: int, m: int, chunks: int, model_key: tuple, costs: tuple) -> float:
    """Makespan of the plan the engine runs (``build_plan_for``) with a core per rank, in the units of
    ``costs``: (F, B, I, W) of every stage, then what the last stage adds to each (the head and the loss).
    ``model_key``: the model config's class and fields (hashable)."""
    plan, prepared = _plan(schedule, pp, m, chunks, model_key)
    table: dict = dict(zip("FBIW", costs[:4]))  # per kind, and (last stage, kind) with the head
    table.update({(pp * chunks - 1, k): c + x for k, c, x in zip("FBIW", costs[:4], costs[4:])})
    return float(simulate(plan, table, prepared).makespan)


def placement(cfg, cores: int) -> tuple:
    """The cores of the ranks each pipeline rank stands for (its dp replicas, sp and tp peers) when rank g
    is bound to core ``g % cores`` (``launch.bind_rank``), in the rank order ``rank = ((pp_i * dp + dp_i) *
    sp + sp_i) * tp + tp_i``. dp=2 x pp=2 on 2 cores: stage 0 is ranks 0, 1, stage 1 ranks 2, 3::

        >>> from colab_kit.config import ParallelConfig
        >>> placement(ParallelConfig(dp=2, pp=2), 2)
        ((0, 1), (0, 1))
    """
    per = cfg.dp * cfg.sp * cfg.tp
    return tuple(tuple(sorted((r * per + j) % cores for j in range(per))) for r in range(cfg.pp))


def bubble(cfg, model_key, f: float, rc: float, c_fwd: float, c_bwd: float, head: float, cores: float,
           latency: float = 0.0, w: float | None = None, bound: bool = False) -> float:
    """Seconds the fullest rank waits in the schedule beyond the work the cost model charges it. Each action
    is its compute at one rank's own speed (``f`` a forward, ``rc`` its recomputation, ``w`` a zero-bubble
    W: the Linears' weight gradients; I is the backward less W) and the stage's tp and sp collectives it
    runs (F ``c_fwd``; B and I ``c_bwd``, where the backward's collectives are; W none); the last stage's
    actions also run the head and the loss (``head`` a forward of them; its backward, 2 ``head``, split
    evenly between I and W). Three cases:

    - a core per rank: ``pipeline.simulate`` of the plan;
    - fewer cores than ranks, ``bound`` (``launch.bind_rank``, the constants say so): ``shared_cores.makespan``
      with each rank sharing only its own core (``placement``), ``latency`` on each message between stages;
      dp=2 x pp=2 on 2 cores puts each replica on one core, where a stage's bubble is its other stage's turn;
    - fewer cores, not bound, one pipeline (dp = 1): ``shared_cores.makespan``: a rank that waits leaves its core
      to those that compute, a rank uses one core at most;
    - fewer cores, not bound, dp replicas of the pipeline: they meet only at the step's end and drift apart
      (engine timelines, dp=2 x pp=2 on 4 ranks / 2 cores: 3-5 ms within a step), so a core one replica's
      bubble frees goes as often to the other replica, off the critical path, and the step waits for the
      later one: ``pipeline.simulate`` with every action at the speed of all ranks busy (``cores / ranks``).

    The span less the rank's charged work (compute at the all-busy speed, as ``step_seconds`` charges it,
    and its collectives), both from the same rounded costs: the ratios are rounded to 2 digits so that
    configs share a simulation (``ck.plan`` at scale prices thousands)."""
    w = f if w is None else w
    work = {"F": f, "B": 2 * f + rc, "I": 2 * f + rc - w, "W": w}
    wait = {"F": c_fwd, "B": c_bwd, "I": c_bwd, "W": 0.0}
    extra = {"F": head, "B": 2 * head, "I": head, "W": head}
    unit = f + c_fwd
    if unit <= 0:
        return 0.0

    def r2(x):
        return float(f"{x / unit:.2g}")

    key = tuple((r2(work[k]), r2(wait[k]), r2(extra[k])) for k in "FBIW")
    share = min(1.0, cores / cfg.world_size)
    if cores >= cfg.world_size:
        span = _pipeline_units(cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks, model_key,
                               tuple(a + c for a, c, _ in key) + tuple(x for _, _, x in key))
    elif bound:
        span = _shared_units(cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks, model_key, key, 1, 1.0, r2(latency),
                             placement(cfg, int(cores)))
    elif cfg.dp > 1:
        span = _pipeline_units(cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks, model_key,
                               tuple(a / share + c for a, c, _ in key) + tuple(x / share for _, _, x in key))
    else:
        span = _shared_units(cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks, model_key, key,
                             cfg.world_size // cfg.pp, float(f"{cores:.3g}"), r2(latency))
    kinds = "FIW" if cfg.schedule in ("zb-h1", "zb-v") else "FB"
    table = dict(zip("FBIW", key))
    charged = sum(cfg.microbatches * cfg.chunks * (table[k][0] / share + table[k][1])
                  + cfg.microbatches * table[k][2] / share for k in kinds)
    return max(0.0, span - charged) * unit


@functools.lru_cache(maxsize=1024)
def _shared_units(schedule: str, pp: int, m: int, chunks: int, model_key: tuple, key: tuple, group: int,
                  cores: float, latency: float = 0.0, where: tuple | None = None) -> float:
    """``shared_cores.makespan`` of the plan the engine runs, in the units of ``bubble``'s key."""
    plan, _ = _plan(schedule, pp, m, chunks, model_key)
    costs: dict = {k: (a, c) for k, (a, c, _) in zip("FBIW", key)}  # per kind, and (last stage, kind)
    costs.update({(pp * chunks - 1, k): (a + x, c) for k, (a, c, x) in zip("FBIW", key)})
    return makespan(plan, costs, group, cores, latency, None if where is None else list(where))
