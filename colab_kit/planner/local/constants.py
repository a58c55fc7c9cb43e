"""The machine's constants for the planner's cost model, measured once and cached.

Measuring takes about 20 s with 4 ranks on 2 cores (19.9 s on the CI machine, AMD EPYC: ``constants(refresh=True,
ranks=4)``), nearly all of it the timed windows below; after that every call reads the cache.

``constants(ranks=4)`` starts ``ranks`` local processes once (``ck.launch``, gloo on CPU) and
measures, all ranks at the same time (so that they share the cores the way a real run does):

- ``matmul``, ``dispatch`` and ``activation``: every rank, starting together from a barrier, repeats one
  piece of compute for the same 0.2 s window (``compute_rates``, three windows before the collectives and three
  after): a forward and backward of a GPT with 8 features and two blocks (its tensors a few numbers, so
  its time is its ops': seconds per op, 3 ops per forward op of its graph, ``count_ops``), one fp32
  ``[256, 256] @ [256, 256]`` matmul (FLOPs per second), and the same GPT at a model's size (d=64, 4 rows
  of 32 tokens): what it takes beyond its ops and its matmul FLOPs, per byte its forward saves for
  backward, is the elementwise work that FLOPs do not count. With the threads ``ck.launch`` gives a rank
  (cores / ranks) and every rank busy from the start of a window to its end, the sharing of cores is in
  the numbers; the medians, of the slowest rank. In one process these three price the 4-block test
  GPT's forward and backward on 4 rows at 3.6 ms (measured 3.61, by hand, once); before ``activation`` the per-op figure
  was a step's time over its forward ops, 3 times an op, which made up for the elementwise work at one
  size and overcharged more microbatches. (Measured on a graph of one Linear + GELU, as this module first
  did, one backward call's own start-up was spread over 4 ops and read 2.5x a GPT's per-op cost; timed as
  a burst per rank, the ranks that finished last ran on an emptier machine.)
- ``recompute``: seconds a step with its blocks recomputed (``colab_kit.recompute``: torch's non-reentrant
  checkpoint) adds per op of the blocks' forward, from windows of 0.15 s alternating the same GPT with and
  without, three pairs, the median (the slowest rank's). On CPU this is 2-3 times a forward's own ops, not one
  forward: the checkpoint's saved-tensor hooks run in the first forward and again when backward unpacks, around
  the forward run again (one process, the 4-block test GPT, 4 rows: a step 3.9 ms, 8.0 ms recomputed, its
  forward 1.5 ms);
- ``memory``: ``a.add_(b)`` over 4 MiB, bytes read and written per second (the optimizer step);
- ``optimizer``: seconds per op of an AdamW step over 32 small tensors (``op_seconds``), every rank
  stepping at once for a window of 0.1 s (``per_call``), the median of three: a small model's step costs
  its optimizer's ops, about 10 per tensor, not its bytes; and seconds per element (``element_seconds``)
  of AdamW over the parameters of a GPT past the caches (d=256, two blocks: 1.6M elements in 29
  tensors), what its step takes beyond those ops: torch's CPU AdamW makes about 10 passes over each
  tensor (one per op), so a step costs its elements' passes, not one read and write of its bytes; and in
  a training step forward and backward have streamed through the caches before it runs, so its states
  come from memory. Per element on 4 ranks bound to 2 cores (by hand, once): 4.4 ns up to 110k
  elements, 5.8-6.7 ns at 210k-810k, 10.8 ns at 1.6M; the 4-block test GPT's step (53 tensors, 210k
  elements) took 4.5 ms alone and 5.1-5.4 ms between forward-backward passes, where the bytes at the
  memory rate with the ops had priced it at 3.1 ms and these figures price it at 5.6;
- ``comm``: for every group size ``n`` that divides ``ranks`` (the ranks split into ``ranks / n``
  groups, every group busy at once: the "tp" axis of a ``ProcessMesh``) and each of all_reduce,
  all_gather, reduce_scatter, broadcast, all_to_all, send (a ping-pong of ``comm.isend`` /
  ``irecv`` between pairs, half the round trip: a pipeline's message) and sendrecv (pairs
  exchanging a message each way at once with ``comm.sendrecv``: a ring's step), called through
  ``colab_kit.comm`` as the engine calls them (records and all), the seconds one collective adds
  to a step at a few sizes, fitted to ``seconds = alpha + wire_bytes / beta`` where ``wire_bytes``
  is ``colab_kit.comm.wire_bytes``: the bytes the engine's comm records call wire bytes.

  The collectives that carry gradients and parameters (all_reduce, reduce_scatter, all_gather) get a
  fourth size, 4 MiB: dp's buckets and ZeRO's are megabytes, and a fit that stopped at 1 MiB priced a
  4-rank all-reduce of a 1.6 MB gradient at 5.5 ms where a step spent 8.6-10.4.

  "Adds to a step" is measured in step, not alone: ``reps`` rounds of a small piece of compute
  (one tiny forward and backward, what a block does between two collectives) followed by the
  collective, minus the same rounds without it, every rank busy alike; the median of 5 such
  trials per rank, then the median over ranks (each rank sees a collective differently: the one
  that came first waited longest). The trials go in turns over all the points of a group size
  (a slow spell of the machine falls on many points a little), and the ranks are bound to their
  cores as ``ck.launch`` binds them (``launch.bind_rank``; ``bound`` in the result says so, and the
  planner then shares a core among its own ranks only): left to the OS, a 2-rank all-reduce's
  cost moved between 1.1 and 2.1 ms from one measurement to the next (six measurements, by hand), as
  the OS put the pair on one core or on two. With more ranks than cores most of a small collective's cost
  is waiting for a peer's turn on a core, and only a measurement inside a running loop sees that
  as a step does. (Timed alone after a burst of compute, as this module first did, the ranks
  arrived milliseconds apart and a Ulysses all-to-all read 1.5-2.4x what it adds to a step.)

  Worked example, 4 ranks bound on 2 cores (gloo; six measurements each way, by hand): an all_to_all of 4 KiB per rank
  on groups of 2 adds 0.9-1.2 ms, on one group of 4 1.7-2.3 ms; an all_reduce 1.4-1.8 ms and 2.0-2.6 ms (the
  OS placing the ranks: 1.1-2.1 and 3.3-5.0); ``alpha`` is nearly all of it at these sizes.

An entry cached by an older ``VERSION`` is measured again. The result is cached as JSON in ``$COLAB_KIT_CACHE``
(default ``~/.cache/colab_kit``) under ``constants-<host>-<torch version>.json``, one entry per rank count;
``refresh=True`` measures again. A test passes fixed numbers instead (``ck.plan(..., constants={...})``).
"""
from __future__ import annotations

import json
import os
import statistics
import time

from ...launch import allowed_cores, cores_for_rank, host_cores, launch
from ...observe.measured import VERSION, cache_path, cached, is_current, read_cache
from .measure_rank import OPS, measure_rank

__all__ = ["constants", "cached", "measure", "measure_rank", "combine", "cache_path", "median_of", "OPS", "LOCAL",
           "VERSION"]

LOCAL = "this machine"
"""The hardware name of the constants measured here (``constants(ranks=4)``, cached): ``ck.estimate``'s and
``ck.dry_run``'s ``hardware=LOCAL`` prices with them."""


def constants(refresh: bool = False, ranks: int = 4, repeats: int = 1) -> dict:
    """The constants measured with ``ranks`` local ranks (cached; ``refresh`` measures again). ``repeats``:
    when measuring, measure that many times and keep each figure's median (``median_of``): one
    measurement on busy shared cores can be off by tens of percent in any one figure."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: give a whole number of measurements, 1 or more (3 takes a median)")
    path = cache_path()
    table = read_cache(path)
    key = str(ranks)
    if refresh or not is_current(table.get(key)):
        table[key] = median_of([measure(ranks) for _ in range(repeats)])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + f".{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(table, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    return table[key]


def median_of(measurements: list[dict]) -> dict:
    """Each number's median over ``measurements`` (dicts of the same shape, as ``measure`` returns);
    other values are the first one's. With one measurement, that measurement::

        >>> median_of([{"matmul": {"flops_per_s": 9.0}, "torch": "x"}, {"matmul": {"flops_per_s": 1.0}, "torch": "x"},
        ...            {"matmul": {"flops_per_s": 2.0}, "torch": "x"}])
        {'matmul': {'flops_per_s': 2.0}, 'torch': 'x'}
    """
    first = measurements[0]
    if isinstance(first, dict):
        return {k: median_of([m[k] for m in measurements]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(measurements)
    return first


def measure(ranks: int = 4) -> dict:
    """Measure now (see the module docstring): about 15 s on 4 CPU ranks of a 2-core machine, process start
    included (``constants_seconds`` in bench/results/plan.json)."""
    t0 = time.perf_counter()
    per_rank = launch(measure_rank, ranks, ranks)
    out = combine(per_rank)
    allowed = allowed_cores()
    out["cores"] = host_cores()  # the engine's rule for ranks sharing cores counts the same (launch.ranks_share_cores)
    # bound: every rank ran on cores_for_rank's cores (the planner then shares each core among its own ranks)
    out["bound"] = all(r.get("affinity") == cores_for_rank(i, ranks, allowed) for i, r in enumerate(per_rank))
    out["seconds_to_measure"] = round(time.perf_counter() - t0, 2)
    return out


def combine(per_rank: list[dict]) -> dict:
    """The constants from every rank's ``measure_rank`` (rank order): compute rates of the slowest rank,
    each collective fitted to the ranks' median (``_fit_points``)."""
    out = {k: v for k, v in per_rank[0].items() if k not in ("points", "affinity")}
    out["matmul"] = {"flops_per_s": min(r["matmul"]["flops_per_s"] for r in per_rank)}  # the slowest rank
    out["dispatch"] = {"op_seconds": max(r["dispatch"]["op_seconds"] for r in per_rank)}
    out["activation"] = {"seconds_per_byte": max(r["activation"]["seconds_per_byte"] for r in per_rank)}
    out["optimizer"] = {k: max(r["optimizer"][k] for r in per_rank) for k in per_rank[0]["optimizer"]}
    if all("recompute" in r for r in per_rank):
        out["recompute"] = {"op_seconds": max(r["recompute"]["op_seconds"] for r in per_rank)}
    out["comm"] = _fit_points([r["points"] for r in per_rank])
    return out



def _fit_points(per_rank: list[dict]) -> dict:
    """``{n: {op: {alpha, beta}}}`` fitted to the median over ranks of each (n, op, size)'s seconds:
    every rank's own view of a collective differs (the one that came first waited longest), their
    median is the collective's cost to a typical rank, and one rank's bad sample does not set it."""
    comm: dict = {}
    for key in per_rank[0]:
        n, op = key.split("/")
        pts = [(wire, statistics.median(r[key][i][1] for r in per_rank))
               for i, (wire, _) in enumerate(per_rank[0][key])]
        a, inv = _fit([p[0] for p in pts], [p[1] for p in pts])
        comm.setdefault(n, {})[op] = {"alpha": a, "beta": 1.0 / inv}
    return comm


def _fit(xs, ys) -> tuple[float, float]:
    """Least squares ``y = a + b x`` with a, b >= 0 (b > 0)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    b = max(b, 1e-15)
    a = max(my - b * mx, 0.0)
    return a, b
