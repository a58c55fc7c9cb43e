"""Cost of the notebook layer: ``%colossal`` against raw ipyparallel, side by side in one run.

    python bench/cluster.py [--n 4] [--starts 3] [--noops 40]

1. start: ``%colossal start -n N`` through the magic (engines + torch.distributed + ranks table)
   against ``ipyparallel.Cluster(n=N).start_and_connect_sync()`` followed by a hand-written
   torch.distributed init on every engine (env:// rendezvous); each followed by a stop.
2. no-op cell: ``%%colossal`` with ``pass`` against ``client[:].execute("pass")`` on the same engines.

The two sides alternate so that machine load hits both alike; medians and ratios are
printed. Run by hand, not in CI.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import socket
import statistics
import time

try:
    from _results import row, write
except ImportError:  # run as a module (python -m bench.cluster)
    from bench._results import row, write


def _init_by_hand(rank: int, world: int, port: int) -> int:
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    return dist.get_rank()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_start(n: int):
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=n, log_level=40)
    cluster.start_cluster_sync()
    client = cluster.connect_client_sync()
    client.wait_for_engines(n, timeout=300, interactive=False)
    port = _free_port()
    ids = sorted(client.ids)[:n]
    ars = [client[e].apply_async(_init_by_hand, r, n, port) for r, e in enumerate(ids)]
    assert [ar.get() for ar in ars] == list(range(n))
    return cluster, client


def magic(shell, line: str, cell: str | None = None) -> None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        result = shell.run_cell(f"%colossal {line}" if cell is None else f"%%colossal {line}\n{cell}")
    if not result.success:
        raise RuntimeError(f"%colossal {line} failed: {result.error_in_exec or result.error_before_exec}")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    import os

    from IPython.core.interactiveshell import InteractiveShell

    import colab_kit as ck

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--starts", type=int, default=3)
    p.add_argument("--noops", type=int, default=40)
    args = p.parse_args(argv)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "colab_kit")
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; n={args.n}")

    ours, raw = [], []
    for i in range(args.starts):
        ours.append(timed(lambda: magic(shell, f"start -n {args.n}")))
        magic(shell, "stop")
        holder = {}
        raw.append(timed(lambda: holder.update(c=raw_start(args.n))))
        holder["c"][1].close()
        holder["c"][0].stop_cluster_sync()
        print(f"  start {i + 1}: %colossal {ours[-1]:.2f} s, raw ipyparallel + dist init {raw[-1]:.2f} s")
    rows = [_report(f"%colossal start -n {args.n} (engines + torch.distributed)", ours, raw)]
    figures = {"start_s": {"colab_kit": ours, "raw": raw}}

    magic(shell, f"start -n {args.n}")
    cluster = ck.magics.state(shell).cluster
    view = cluster._client[cluster._ids]
    view.block = True
    ours, raw = [], []
    for _ in range(3):  # warm both paths
        magic(shell, "", "pass")
        view.execute("pass")
    for _ in range(args.noops):
        ours.append(timed(lambda: magic(shell, "", "pass")))
        raw.append(timed(lambda: view.execute("pass")))
    rows.append(_report(f"no-op %%colossal cell on {args.n} ranks", ours, raw, unit=1e3, label="ms"))
    figures["noop_s"] = {"colab_kit": ours, "raw": raw}
    magic(shell, "stop")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    write("cluster", rows, figures, vars(args), argv)


def _report(what: str, ours: list[float], raw: list[float], unit: float = 1.0, label: str = "s") -> dict:
    a, b = statistics.median(ours) * unit, statistics.median(raw) * unit
    print(f"{what}: %colossal median {a:.2f} {label}, raw median {b:.2f} {label}, ratio {a / b:.2f}x "
          f"({len(ours)} runs each, alternating)")
    return row(what, f"%colossal {a:.2f} {label}", f"ipyparallel by hand {b:.2f} {label}", a / b,
               f"medians of {len(ours)} runs each, alternating")


if __name__ == "__main__":
    main()
