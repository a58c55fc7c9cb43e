"""One rank's measurements for ``constants`` (inside ``ck.launch``, every rank calling ``measure_rank`` at once):
the compute windows (``measure_compute``), the optimizer's step, and every collective of ``OPS`` on every group
size, each timed in a running loop (``_trial``: what it adds to rounds of compute, the module docstring of
``constants`` says why). ``constants.combine`` makes the constants of every rank's."""
from __future__ import annotations

import math
import os
import statistics
import time

from ... import comm
from ...comm import wire_bytes
from ...config import Axis, ParallelConfig
from ...launch import allowed_cores
from ...mesh import ProcessMesh
from ...observe.measured import VERSION
from .measure_compute import SYNC, Burst, compute_rates, optimizer_step, per_call, timed

__all__ = ["OPS", "measure_rank"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "sendrecv")
_SIZES = (1 << 10, 1 << 14, 1 << 18)  # fp32 elements per rank's payload: 4 KiB, 64 KiB, 1 MiB
_LARGE = {"all_reduce": 1 << 20, "reduce_scatter": 1 << 20, "all_gather": 1 << 20}
"""A fourth point, 4 MiB, for the collectives that carry gradients and parameters (dp's bucket all-reduce,
ZeRO's reduce-scatters and gathers: megabytes): fitted on 1 MiB at most, a 4-rank all-reduce of a 1.6 MB
gradient read 5.5 ms in the model and took 8.6-10.4 ms in a step (gloo, 4 ranks on 2 cores)."""


def measure_rank(ranks: int) -> dict:
    """This rank's measurements (inside a spawn of ``ranks`` ranks, all calling it); ``combine`` makes the
    constants of every rank's."""
    import warnings

    import torch
    import torch.distributed as dist


    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's renamed collectives
    if dist.get_backend() == "nccl":  # one GPU per rank: measure on it
        torch.set_default_device(torch.device("cuda", torch.cuda.current_device()))
        SYNC[0] = torch.cuda.synchronize
    dist.barrier()
    burst = Burst()
    for _ in range(3):  # first calls are slow (allocations, the checkpoint's set-up)
        burst()
        burst.step_sized()
        burst.step_recomputed()
    rates = [compute_rates(burst)]
    # recomputation: what a step with its blocks recomputed adds, per op of the blocks' forward (windows
    # alternating with plain steps, every rank at once; its first calls are slow, set-up)
    recompute = statistics.median((per_call(burst.step_recomputed, 0.15) - per_call(burst.step, 0.15)) / burst.block_ops
                                  for _ in range(3))
    big, other = torch.randn(1 << 20), torch.randn(1 << 20)  # on the rank's device
    dist.barrier()
    mem = timed(lambda: big.add_(other), 5)
    opt_ops, opt_step = optimizer_step()
    opt_seconds = statistics.median(per_call(opt_step) / opt_ops for _ in range(3))
    # the elements' passes: AdamW over a GPT's parameters past the caches, beyond its ops
    wide_ops, wide_step = optimizer_step(burst.optimizer_shapes)
    elements = sum(math.prod(s) for s in burst.optimizer_shapes)
    opt_elements = statistics.median(max(0.0, per_call(wide_step) - wide_ops * opt_seconds) / elements
                                     for _ in range(3))
    # every point's trials in turns (``_TRIALS`` passes over a group size's points): a slow spell of the
    # machine (a tenth of a second or more on a shared VM) falls on many points a little, not on one
    # point's every trial
    points: dict = {}
    trials: dict = {}
    for n in [k for k in range(2, ranks + 1) if ranks % k == 0]:
        # the ranks in groups of n (every group busy at once), through colab_kit.comm on a mesh:
        # the collectives the engine calls, as it calls them (autograd-free, recorded)
        mesh = ProcessMesh.shared(ParallelConfig(dp=ranks // n, tp=n))
        mine: dict = {}
        for op in OPS:
            for size in _SIZES + ((_LARGE[op],) if op in _LARGE else ()):
                size -= size % n  # a reduce-scatter or all-to-all splits it in n (groups of 3, 6, ...)
                t = torch.ones(size, device=mesh.device)
                wire = wire_bytes("send" if op == "sendrecv" else op, size * 4, n)  # each way: one message
                points.setdefault(f"{n}/{op}", []).append(wire)
                mine[(f"{n}/{op}", wire)] = (_collective_fn(op, t, mesh, n), [])
        for _ in range(_TRIALS):
            for fn, got in mine.values():
                got.append(_trial(fn, burst))
        trials.update(mine)
        mesh.log.records.clear()  # the records of a measurement are nobody's step
        mesh.release()
    points = {key: [(wire, statistics.median(trials[(key, wire)][1]) / (2 if key.endswith("/send") else 1))
                    for wire in wires] for key, wires in points.items()}
    rates.append(compute_rates(burst))
    return {"version": VERSION, "ranks": ranks, "threads_per_rank": torch.get_num_threads(),
            "cores": os.cpu_count() or 1,
            "matmul": {"flops_per_s": statistics.median(f for r in rates for f in r[1])},
            "dispatch": {"op_seconds": statistics.median(o for r in rates for o in r[0])},
            "activation": {"seconds_per_byte": statistics.median(a for r in rates for a in r[2])},
            "recompute": {"op_seconds": max(0.0, recompute)},
            "memory": {"bytes_per_s": 3 * big.numel() * 4 / mem},
            "optimizer": {"op_seconds": opt_seconds, "element_seconds": opt_elements},
            "points": points, "backend": dist.get_backend(), "torch": torch.__version__,
            "affinity": allowed_cores()}

_TRIALS = 5
"""Trials per (group size, collective, size) point; its figure is their median (``_trial``)."""


def _collective_fn(op: str, t, mesh, n: int):
    """One ``op`` of ``t`` over the mesh's "tp" groups, as a call (send: an isend/irecv round trip between
    pairs, a pipeline's message twice; sendrecv: a ``comm.sendrecv`` exchange, a ring's step)."""
    import torch


    me = mesh.rank(Axis.TP)
    if op == "all_reduce":
        return lambda: comm.all_reduce(t, mesh, Axis.TP, tag="planner constants")
    if op == "all_gather":
        return lambda: comm.all_gather(t, mesh, Axis.TP, tag="planner constants")
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(t, mesh, Axis.TP, tag="planner constants")
    if op == "broadcast":
        return lambda: comm.broadcast(t, mesh, Axis.TP, tag="planner constants")
    if op == "all_to_all":
        return lambda: comm.all_to_all(t, mesh, Axis.TP, 0, 0, tag="planner constants")
    # pairs (0, 1), (2, 3), ... of each group: sendrecv exchanges a message each way at once
    # (the ring's step); send is a ping-pong of isend / irecv (a pipeline's), a round trip
    peer = me ^ 1 if (me ^ 1) < n else None
    buf = torch.empty_like(t)

    def fn():
        if peer is None:
            return
        if op == "sendrecv":
            for pending in comm.sendrecv(t, buf, mesh, Axis.TP, to=peer, source=peer, tag="planner constants"):
                pending.wait()
            return
        first, then = (comm.isend, comm.irecv) if me % 2 == 0 else (comm.irecv, comm.isend)
        first(t if first is comm.isend else buf, mesh, Axis.TP, peer, tag="planner constants").wait()
        then(t if then is comm.isend else buf, mesh, Axis.TP, peer, tag="planner constants").wait()
    return fn


def _trial(fn, burst, reps: int = 6) -> float:
    """Seconds one call of ``fn`` (a collective) adds to a running loop (the module docstring's "in step"):
    ``reps`` rounds of a small piece of compute (one tiny forward and backward, as between a block's
    collectives) then the collective, minus the same rounds without it, every rank busy alike; one full
    ``burst`` of compute before, as a step's."""
    import torch.distributed as dist

    burst()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        burst.light()
        fn()
    SYNC[0]()
    t1 = time.perf_counter()
    dist.barrier()
    t2 = time.perf_counter()
    for _ in range(reps):
        burst.light()
    SYNC[0]()
    t3 = time.perf_counter()
    return max(0.0, (t1 - t0) - (t3 - t2)) / reps
