"""The machine's constants for the planner's cost model, measured in a few seconds and cached.

``constants(ranks=4)`` starts ``ranks`` local processes once (``ck.launch``, gloo on CPU) and
measures, all ranks at the same time (so that they share the cores the way a real run does):

- ``matmul``, ``dispatch`` and ``activation``: every rank, starting together from a barrier, repeats one
  piece of compute for the same 0.2 s window (``_rates``, three windows before the collectives and three
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
  stepping at once for a window of 0.1 s (``_window``), the median of three: a small model's step costs
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
import math
import os
import statistics
import time

from ..observe.measured import VERSION, _current, _read_cache, cache_path, cached
from .. import comm
from ..comm import wire_bytes
from ..config import ParallelConfig
from ..launch import allowed_cores, cores_for_rank, host_cores, launch
from ..memory.formulas import activation_bytes
from ..mesh import ProcessMesh
from ..models import GPT, GPTConfig
from ..pipeline.costs import flops_per_token
from ..recompute import recompute_blocks

__all__ = ["constants", "cached", "measure", "measure_rank", "combine", "cache_path", "count_ops", "OPS"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "sendrecv")
_SIZES = (1 << 10, 1 << 14, 1 << 18)  # fp32 elements per rank's payload: 4 KiB, 64 KiB, 1 MiB
_LARGE = {"all_reduce": 1 << 20, "reduce_scatter": 1 << 20, "all_gather": 1 << 20}
"""A fourth point, 4 MiB, for the collectives that carry gradients and parameters (dp's bucket all-reduce,
ZeRO's reduce-scatters and gathers: megabytes): fitted on 1 MiB at most, a 4-rank all-reduce of a 1.6 MB
gradient read 5.5 ms in the model and took 8.6-10.4 ms in a step (gloo, 4 ranks on 2 cores)."""
def constants(refresh: bool = False, ranks: int = 4, repeats: int = 1) -> dict:
    """The constants measured with ``ranks`` local ranks (cached; ``refresh`` measures again). ``repeats``:
    when measuring, measure that many times and keep each figure's median (``median_of``): one
    measurement on busy shared cores can be off by tens of percent in any one figure."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: give a whole number of measurements, 1 or more (3 takes a median)")
    path = cache_path()
    table = _read_cache(path)
    key = str(ranks)
    if refresh or not _current(table.get(key)):
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
    """Measure now (see the module docstring); about 8-10 s on 4 CPU ranks plus process start."""
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


_SYNC = [lambda: None]  # torch.cuda.synchronize on a GPU rank: a time is read after the work is done


def _time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        _SYNC[0]()
        t = time.perf_counter()
        fn()
        _SYNC[0]()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _optimizer_step(shapes=((64,),) * 32):
    """(ops dispatched by one step, the step) of AdamW over tensors of ``shapes`` (default 32 of 64
    elements: what a small model's optimizer costs is its ops, about 10 per tensor on CPU, where torch
    loops over the tensors; ``measure_rank`` also steps a GPT's parameter shapes for the elements' cost)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    params = [torch.zeros(shape, requires_grad=True) for shape in shapes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()  # its states exist, as from the second step on

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        opt.step()
    return max(1, Count.ops), opt.step


def measure_rank(ranks: int) -> dict:
    """This rank's measurements (inside a spawn of ``ranks`` ranks, all calling it); ``combine`` makes the
    constants of every rank's."""
    import warnings

    import torch
    import torch.distributed as dist


    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's renamed collectives
    if dist.get_backend() == "nccl":  # one GPU per rank: measure on it
        torch.set_default_device(torch.device("cuda", torch.cuda.current_device()))
        _SYNC[0] = torch.cuda.synchronize
    dist.barrier()
    burst = _Burst()
    for _ in range(3):  # first calls are slow (allocations, the checkpoint's set-up)
        burst()
        burst.step_sized()
        burst.step_recomputed()
    rates = [_rates(burst)]
    # recomputation: what a step with its blocks recomputed adds, per op of the blocks' forward (windows
    # alternating with plain steps, every rank at once; its first calls are slow, set-up)
    recompute = statistics.median((_window(burst.step_recomputed, 0.15) - _window(burst.step, 0.15)) / burst.block_ops
                                  for _ in range(3))
    big, other = torch.randn(1 << 20), torch.randn(1 << 20)  # on the rank's device
    dist.barrier()
    mem = _time(lambda: big.add_(other), 5)
    opt_ops, opt_step = _optimizer_step()
    opt_seconds = statistics.median(_window(opt_step) / opt_ops for _ in range(3))
    # the elements' passes: AdamW over a GPT's parameters past the caches, beyond its ops
    wide_ops, wide_step = _optimizer_step(burst.optimizer_shapes)
    elements = sum(math.prod(s) for s in burst.optimizer_shapes)
    opt_elements = statistics.median(max(0.0, _window(wide_step) - wide_ops * opt_seconds) / elements
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
    rates.append(_rates(burst))
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


def _window(fn, window: float = 0.1) -> float:
    """Seconds per call of ``fn`` repeated by every rank at once for ``window`` seconds from a barrier."""
    import torch.distributed as dist
    dist.barrier()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < window:
        fn()
        n += 1
    _SYNC[0]()
    return (time.perf_counter() - t0) / n


def _rates(burst, window: float = 0.2, trials: int = 3) -> tuple[list, list, list]:
    """([seconds per op], [matmul FLOPs per second], [seconds per activation byte]) of ``trials`` windows each
    (``_window``): every rank starts together (a barrier) and repeats the burst's tiny GPT forward and
    backward, then its matmul, then the same GPT at a model's size, for ``window`` seconds of its clock.
    All ranks are busy from the start of a window to its end, so the cores are shared alike all through it
    (a burst timed by itself ends at a different moment on each rank, and the last ones to finish ran alone:
    their per-op reading spread by 30% between two measurements).

    Per op: the tiny GPT's step over 3 ops per forward op (a backward runs about twice its forward's ops);
    its tensors are a few numbers, so its time is the ops' own. Per activation byte: what the sized GPT's
    step takes beyond its ops (at that rate) and its matmul FLOPs (forward and backward, at the matmul
    rate), over the bytes its forward saves for backward (``memory.formulas.activation_bytes``): the
    elementwise work (LayerNorm, GELU, softmax, dropout, adds and their gradients) that grows with the
    activations and that FLOPs do not count."""
    ops, flops, act = [], [], []
    for _ in range(trials):
        per_op = _window(burst.step, window) / (3 * burst.ops)
        rate = 2 * 256 ** 3 / _window(burst.matmul, window)
        rest = _window(burst.step_sized, window) - 3 * burst.sized_ops * per_op - 3 * burst.sized_flops / rate
        ops.append(per_op)
        flops.append(rate)
        act.append(max(0.0, rest) / burst.sized_bytes)
    return ops, flops, act


def count_ops(fn) -> int:
    """Autograd nodes of the graph ``fn()`` builds (its ops that have a backward): walked from the
    output's ``grad_fn``, so nothing but the forward runs."""
    out = fn()
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return max(1, sum(1 for n in seen if type(n).__name__ != "AccumulateGrad"))


class _Burst:
    """The compute: a GPT of two blocks with 8 features (``step``, forward and backward: the op mix of
    the model the planner prices, about 60 autograd ops to one ``backward()`` call as in a real step), a
    ``[256, 256] @ [256, 256]`` matmul (``matmul``), both timed in windows by ``_rates``; called, the
    load run before each trial of a collective; ``light``, the compute inside a trial."""

    def __init__(self, tiny: int = 2):
        import torch
        import torch.nn.functional as F

        self.lin, self.x = torch.nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
        self.a, self.b = torch.randn(256, 256), torch.randn(256, 256)
        g = GPTConfig(vocab_size=8, seq_len=4, d_model=8, n_heads=4, n_layers=2)
        gpt, tokens = GPT(g), torch.zeros(1, 4, dtype=torch.long)
        self._gpt = lambda: F.cross_entropy(gpt(tokens).flatten(0, 1), tokens.flatten())
        self.tiny, self.ops = tiny, count_ops(self._gpt)
        sized = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2)  # a model's size, 4 rows
        big, rows = GPT(sized), torch.zeros(4, 32, dtype=torch.long)
        # the optimizer's elements: a GPT's parameters past the caches (d=256, two blocks: 1.6M elements,
        # 26 MB with their gradients and AdamW's two states), as in a step, where forward and backward
        # have streamed activations and gradients through the caches before the optimizer runs
        wide = GPTConfig(vocab_size=64, seq_len=32, d_model=256, n_heads=4, n_layers=2)
        self.optimizer_shapes = [tuple(p.shape) for p in GPT(wide).parameters()]
        self._sized = lambda: F.cross_entropy(big(rows).flatten(0, 1), rows.flatten())
        lin, att, head = flops_per_token(sized)
        self.sized_ops, self.sized_flops = count_ops(self._sized), rows.numel() * (2 * (lin + att) + head)
        self.sized_bytes = activation_bytes(sized, 4)["held"]
        rc = GPT(g)
        recompute_blocks(rc)
        self._gpt_rc = lambda: F.cross_entropy(rc(tokens).flatten(0, 1), tokens.flatten())

        def one_block():
            return gpt.blocks[0](torch.zeros(1, 4, 8, requires_grad=True)).sum()

        self.block_ops = g.n_layers * (count_ops(one_block) - 1)

    def _forward(self):
        import torch
        return torch.nn.functional.gelu(self.lin(self.x)).sum()

    def step(self):
        self._gpt().backward()

    def step_sized(self):
        """A forward and backward of a GPT of a model's size (d=64, 2 blocks, 4 rows of 32 tokens)."""
        self._sized().backward()

    def step_recomputed(self):
        """The same step with every block recomputed (``colab_kit.recompute``)."""
        self._gpt_rc().backward()

    def matmul(self):
        self.a @ self.b

    def __call__(self):
        for _ in range(self.tiny):
            self.step()
        self.matmul()
        _SYNC[0]()

    def light(self):
        """One tiny forward and backward: the compute between two collectives of a block."""
        self._forward().backward()


_TRIALS = 5
"""Trials per (group size, collective, size) point; its figure is their median (``_trial``)."""


def _collective_fn(op: str, t, mesh, n: int):
    """One ``op`` of ``t`` over the mesh's "tp" groups, as a call (send: an isend/irecv round trip between
    pairs, a pipeline's message twice; sendrecv: a ``comm.sendrecv`` exchange, a ring's step)."""
    import torch


    me = mesh.rank("tp")
    if op == "all_reduce":
        return lambda: comm.all_reduce(t, mesh, "tp", tag="planner constants")
    if op == "all_gather":
        return lambda: comm.all_gather(t, mesh, "tp", tag="planner constants")
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(t, mesh, "tp", tag="planner constants")
    if op == "broadcast":
        return lambda: comm.broadcast(t, mesh, "tp", tag="planner constants")
    if op == "all_to_all":
        return lambda: comm.all_to_all(t, mesh, "tp", 0, 0, tag="planner constants")
    # pairs (0, 1), (2, 3), ... of each group: sendrecv exchanges a message each way at once
    # (the ring's step); send is a ping-pong of isend / irecv (a pipeline's), a round trip
    peer = me ^ 1 if (me ^ 1) < n else None
    buf = torch.empty_like(t)

    def fn():
        if peer is None:
            return
        if op == "sendrecv":
            for pending in comm.sendrecv(t, buf, mesh, "tp", to=peer, source=peer, tag="planner constants"):
                pending.wait()
            return
        first, then = (comm.isend, comm.irecv) if me % 2 == 0 else (comm.irecv, comm.isend)
        first(t if first is comm.isend else buf, mesh, "tp", peer, tag="planner constants").wait()
        then(t if then is comm.isend else buf, mesh, "tp", peer, tag="planner constants").wait()
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
    _SYNC[0]()
    t1 = time.perf_counter()
    dist.barrier()
    t2 = time.perf_counter()
    for _ in range(reps):
        burst.light()
    _SYNC[0]()
    t3 = time.perf_counter()
    return max(0.0, (t1 - t0) - (t3 - t2)) / reps
