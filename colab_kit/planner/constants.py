"""The machine's constants for the planner's cost model, measured in a few seconds and cached.

``constants(ranks=4)`` starts ``ranks`` local processes once (``ck.launch``, gloo on CPU) and
measures, all ranks at the same time (so that they share the cores the way a real run does):

- ``matmul``: each rank runs fp32 matmuls ``[512, 256] @ [256, 1024]`` back to back (``_per_call``)
  with the threads ``ck.launch`` gives it (cores / ranks): FLOPs per second per rank with
  ``ranks`` ranks running at once (the slowest rank's);
- ``dispatch``: a tiny Linear + GELU forward and backward, run back to back, over the autograd ops of its
  graph (``count_ops``): seconds of overhead per op, what dominates a small model on CPU;
- ``memory``: ``a.add_(b)`` over 4 MiB, bytes read and written per second (the optimizer step);
- ``comm``: for every group size ``n`` that divides ``ranks`` (the ranks split into ``ranks / n``
  groups, every group busy at once) and each of all_reduce, all_gather, reduce_scatter,
  broadcast, all_to_all, and send/recv (a ping-pong between pairs), the time of a few
  sizes, each after a short matmul (as in a step, where ranks reach a collective at different
  moments: with more ranks than cores, waiting for a peer's turn is most of a small collective's
  cost), fitted to ``seconds = alpha + wire_bytes / beta`` where ``wire_bytes`` is
  ``colab_kit.comm.wire_bytes``: the bytes the engine's comm records call wire bytes.

The result is cached as JSON in ``$COLAB_KIT_CACHE`` (default ``~/.cache/colab_kit``) under
``constants-<host>-<torch version>.json``, one entry per rank count; ``refresh=True`` measures
again. Every collective's time is the median of 7 runs (ranks that wait for their turn on shared cores are
part of what a run pays). A test passes fixed numbers instead (``ck.plan(..., constants={...})``).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time

__all__ = ["constants", "measure", "cache_path", "count_ops", "OPS"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send")
_SIZES = (1 << 10, 1 << 14, 1 << 18)  # fp32 elements per rank's payload: 4 KiB, 64 KiB, 1 MiB
_MATMUL = (512, 256, 1024)


def cache_path() -> str:
    import torch
    root = os.environ.get("COLAB_KIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "colab_kit")
    return os.path.join(root, f"constants-{platform.node() or 'host'}-{torch.__version__.split('+')[0]}.json")


def constants(refresh: bool = False, ranks: int = 4) -> dict:
    """The constants measured with ``ranks`` local ranks (cached; ``refresh`` measures again)."""
    path = cache_path()
    cached = {}
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as fh:
                cached = json.load(fh)
        except (OSError, ValueError):
            cached = {}
    key = str(ranks)
    if refresh or key not in cached:
        cached[key] = measure(ranks)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + f".{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(cached, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    return cached[key]


def measure(ranks: int = 4) -> dict:
    """Measure now (see the module docstring); about 2-4 s on 4 CPU ranks plus process start."""
    from ..launch import launch
    t0 = time.perf_counter()
    per_rank = launch(_measure_rank, ranks, ranks)
    out = per_rank[0]
    out["matmul"]["flops_per_s"] = min(r["matmul"]["flops_per_s"] for r in per_rank)  # the slowest rank
    out["seconds_to_measure"] = round(time.perf_counter() - t0, 2)
    return out


def _fit(xs, ys) -> tuple[float, float]:
    """Least squares ``y = a + b x`` with a, b >= 0 (b > 0)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    b = max(b, 1e-15)
    a = max(my - b * mx, 0.0)
    return a, b


_SYNC = [lambda: None]  # torch.cuda.synchronize on a GPU rank: a time is read after the work is done


def _per_call(fn, window: float = 0.08, windows: int = 3) -> float:
    """Seconds per call of ``fn``: calls run back to back for ``window`` seconds of wall time (every
    rank busy at once, so ranks sharing cores share them here too), the best of ``windows``
    windows (a window that another job's burst of load fell on says nothing about this machine)."""
    fn()
    best = float("inf")
    for _ in range(windows):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < window:
            fn()
            calls += 1
        _SYNC[0]()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _time(fn, reps: int, between=None) -> float:
    fn()
    ts = []
    for _ in range(reps):
        if between is not None:
            between()
        _SYNC[0]()
        t = time.perf_counter()
        fn()
        _SYNC[0]()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)  # ranks waiting for each other's turn on shared cores is part of the cost


def _measure_rank(ranks: int) -> dict:
    import warnings

    import torch
    import torch.distributed as dist

    from ..comm import wire_bytes

    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's renamed collectives
    rank = dist.get_rank()
    if dist.get_backend() == "nccl":  # one GPU per rank: measure on it
        torch.set_default_device(torch.device("cuda", torch.cuda.current_device()))
        _SYNC[0] = torch.cuda.synchronize
    dist.barrier()
    m, k, n = _MATMUL
    a, b = torch.randn(m, k), torch.randn(k, n)
    rate = 2 * m * k * n / _per_call(lambda: a @ b)
    lin, x = torch.nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
    tiny = _per_call(lambda: torch.nn.functional.gelu(lin(x)).sum().backward())
    op_seconds = tiny / count_ops(lambda: torch.nn.functional.gelu(lin(x)).sum())
    big, other = torch.randn(1 << 20), torch.randn(1 << 20)  # on the rank's device
    dist.barrier()
    mem = _time(lambda: big.add_(other), 5)
    comm = {}
    for n in [k for k in range(2, ranks + 1) if ranks % k == 0]:
        groups = [dist.new_group(list(range(g, g + n))) for g in range(0, ranks, n)]
        group, me = groups[rank // n], rank % n
        first = rank - me
        comm[str(n)] = {}
        for op in OPS:
            pts = []
            for size in _SIZES:
                payload = _payload(op, size, n)
                pts.append((wire_bytes(op, size * 4, n), _collective(op, payload, group, n, me, first)))
            a, inv = _fit([p[0] for p in pts], [p[1] for p in pts])
            comm[str(n)][op] = {"alpha": a, "beta": 1.0 / inv}
        for g in groups:
            dist.destroy_process_group(g)
    return {"ranks": ranks, "threads_per_rank": torch.get_num_threads(), "cores": os.cpu_count() or 1,
            "matmul": {"flops_per_s": rate},
            "dispatch": {"op_seconds": op_seconds},
            "memory": {"bytes_per_s": 3 * big.numel() * 4 / mem},
            "comm": comm, "backend": dist.get_backend(), "torch": torch.__version__}


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


def _payload(op, size, n):
    import torch
    return torch.ones(size)


def _collective(op: str, t, group, n: int, me: int, first: int, reps: int = 7) -> float:
    import torch
    import torch.distributed as dist

    a, b = torch.randn(256, 256), torch.randn(256, 256)  # ~33 MFLOP: a few ms, about one layer's forward
    burst = lambda: a @ b  # noqa: E731  compute between collectives, as in a step: ranks arrive apart

    if op == "all_reduce":
        fn = lambda: dist.all_reduce(t, group=group)  # noqa: E731
    elif op == "all_gather":
        out = torch.empty(t.numel() * n)
        fn = lambda: dist.all_gather_into_tensor(out, t, group=group)  # noqa: E731
    elif op == "reduce_scatter":
        out = torch.empty(t.numel() // n)
        fn = lambda: dist.reduce_scatter_tensor(out, t, group=group)  # noqa: E731
    elif op == "broadcast":
        fn = lambda: dist.broadcast(t, src=first, group=group)  # noqa: E731
    elif op == "all_to_all":
        out = torch.empty_like(t)
        fn = lambda: dist.all_to_all_single(out, t, group=group)  # noqa: E731
    else:  # send: ping-pong between pairs (0, 1), (2, 3), ... of the group; one way is half a round trip
        peer = first + (me ^ 1) if (me ^ 1) < n else None
        buf = torch.empty_like(t)

        def fn():
            if peer is None:
                return
            if me % 2 == 0:
                dist.send(t, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(t, peer)
        dist.barrier(group=group)
        return _time(fn, reps, burst) / 2
    dist.barrier(group=group)
    return _time(fn, reps, burst)
