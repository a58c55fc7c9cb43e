"""Cost of the notebook layer: ``%colossal`` against raw ipyparallel, side by side in one run.

    python bench/cluster.py [--n 4] [--starts 3] [--noops 40]

1. start: ``%colossal start -n N`` through the magic (engines + torch.distributed + ranks table)
   against ``ipyparallel.Cluster(n=N).start_and_connect_sync()`` followed by a hand-written
   torch.distributed init on every engine (env:// rendezvous); each followed by a stop.
2. restart: ``%colossal restart`` (kill the engines, start new ones, torch.distributed again) against
   ``stop_engines_sync()``, ``start_engines_sync()``, waiting for them and the same init by hand.
3. memory: after three dp steps of a small GPT on each side's fresh engines, the PSS of every process the
   engines need (colab_kit: the fork server, engines and nannies; ipyparallel: engines and nannies).
4. no-op cell: ``%%colossal`` with ``pass`` against ``client[:].execute("pass")`` on the same engines.

Within each start of 1: the first training cell on the fresh engines (``boost`` of a small GPT and three dp
steps: what an engine imports at its first ``boost`` is part of it), then ``%colossal stop`` against
``client.close()`` and ``cluster.stop_cluster_sync()``, each until its call returns.

colab_kit forks its local engines from a server that has imported torch once per kernel
(``colab_kit/notebook/cluster/forked.py``) and runs the controller's heartbeat at 0.5 s; ipyparallel's side is
as its users start it (new interpreters, the 3 s heartbeat). The first ``%colossal start`` of the run also
starts the fork server: it is printed, and it is one of the runs the median is taken over.

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


def raw_restart(cluster, client, n: int) -> None:
    """What a user of plain ipyparallel does to get fresh engines: stop them, start new ones, init again."""
    cluster.stop_engines_sync()
    deadline = time.monotonic() + 60
    while client.ids and time.monotonic() < deadline:
        time.sleep(0.05)
    cluster.start_engines_sync(n)
    client.wait_for_engines(n, timeout=300, interactive=False)
    port = _free_port()
    ids = sorted(client.ids)[:n]
    ars = [client[e].apply_async(_init_by_hand, r, n, port) for r, e in enumerate(ids)]
    assert [ar.get() for ar in ars] == list(range(n))


def _train_a_little(world: int) -> None:
    import torch

    import colab_kit as ck
    from colab_kit.datasets import SyntheticTokens
    from colab_kit.models import GPT, GPTConfig

    engine = ck.boost(GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_heads=8, n_layers=2)),
                      lambda ps: torch.optim.AdamW(ps, lr=1e-3), ck.ParallelConfig(dp=world))
    for step in range(3):
        engine.train_step(SyntheticTokens(64, 16).batch(step, 8))
    engine.close()


def _getpid() -> int:
    import os
    return os.getpid()


def _pss(engine_pids: list[int], server: bool) -> int:
    """PSS of the engines, their nannies (children) and, for colab_kit, the fork server they were forked from."""
    import psutil

    procs = [psutil.Process(p) for p in engine_pids]
    procs += [c for p in procs for c in p.children()]
    if server:
        from colab_kit.notebook.cluster import forked
        assert forked.server_pid() is not None, "colab_kit's engines were not forked (COLAB_KIT_FORK_ENGINES=0?)"
        procs.append(psutil.Process(forked.server_pid()))
    return sum(p.memory_full_info().pss for p in procs)


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

    ours, raw, ours_cell, raw_cell, ours_stop, raw_stop = [], [], [], [], [], []
    for i in range(args.starts):
        ours.append(timed(lambda: magic(shell, f"start -n {args.n}")))
        cluster = ck.magics.state(shell).cluster
        ours_cell.append(timed(lambda: cluster.run(_train_a_little, args.n)))
        ours_stop.append(timed(lambda: magic(shell, "stop")))
        holder = {}
        raw.append(timed(lambda: holder.update(c=raw_start(args.n))))
        raw_cell.append(timed(lambda: holder["c"][1][:].apply_sync(_train_a_little, args.n)))
        raw_stop.append(timed(lambda: (holder["c"][1].close(), holder["c"][0].stop_cluster_sync())))
        first = " (the first also starts the fork server)" if i == 0 else ""
        print(f"  start {i + 1}: %colossal {ours[-1]:.2f} s{first}, raw ipyparallel + dist init {raw[-1]:.2f} s; "
              f"first training cell {ours_cell[-1]:.2f} / {raw_cell[-1]:.2f} s; stop {ours_stop[-1]:.2f} / "
              f"{raw_stop[-1]:.2f} s")
    rows = [_report(f"%colossal start -n {args.n} (engines + torch.distributed)", ours, raw),
            _report(f"first training cell on {args.n} fresh engines (imports the engine: boost + 3 dp steps)",
                    ours_cell, raw_cell),
            _report(f"%colossal stop of {args.n} engines (until the call returns)", ours_stop, raw_stop)]
    figures = {"start_s": {"colab_kit": ours, "raw": raw}, "first_cell_s": {"colab_kit": ours_cell, "raw": raw_cell},
               "stop_s": {"colab_kit": ours_stop, "raw": raw_stop}}

    ours, raw = [], []
    magic(shell, f"start -n {args.n}")
    for i in range(args.starts):
        ours.append(timed(lambda: magic(shell, "restart")))
    magic(shell, "stop")
    cluster, client = raw_start(args.n)
    for i in range(args.starts):
        raw.append(timed(lambda: raw_restart(cluster, client, args.n)))
    client.close()
    cluster.stop_cluster_sync()
    print(f"  restarts: %colossal {', '.join(f'{t:.2f}' for t in ours)} s; "
          f"raw ipyparallel + dist init {', '.join(f'{t:.2f}' for t in raw)} s")
    rows.append(_report(f"%colossal restart on {args.n} ranks (new engines + torch.distributed)", ours, raw,
                        alternating=False))
    figures["restart_s"] = {"colab_kit": ours, "raw": raw}

    magic(shell, f"start -n {args.n}")
    cluster = ck.magics.state(shell).cluster
    cluster.run(_train_a_little, args.n)
    ours_bytes = _pss([row["pid"] for row in cluster.ranks()], server=True)
    raw_cluster, raw_client = raw_start(args.n)
    raw_client[:].apply_sync(_train_a_little, args.n)
    raw_bytes = _pss(raw_client[:].apply_sync(_getpid), server=False)
    raw_client.close()
    raw_cluster.stop_cluster_sync()
    print(f"memory of {args.n} engines after three steps: %colossal {ours_bytes / 2**20:.0f} MiB, "
          f"ipyparallel {raw_bytes / 2**20:.0f} MiB")
    rows.append(row(f"memory of {args.n} engines after three dp steps (PSS)", f"%colossal {ours_bytes / 2**20:.0f} MiB",
                    f"ipyparallel by hand {raw_bytes / 2**20:.0f} MiB", ours_bytes / raw_bytes,
                    "colab_kit's side includes its fork server"))
    figures["memory_bytes"] = {"colab_kit": ours_bytes, "raw": raw_bytes}
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


def _report(what: str, ours: list[float], raw: list[float], unit: float = 1.0, label: str = "s",
            alternating: bool = True) -> dict:
    a, b = statistics.median(ours) * unit, statistics.median(raw) * unit
    how = "alternating" if alternating else "one side's runs, then the other's"
    print(f"{what}: %colossal median {a:.2f} {label}, raw median {b:.2f} {label}, ratio {a / b:.2f}x "
          f"({len(ours)} runs each, {how})")
    return row(what, f"%colossal {a:.2f} {label}", f"ipyparallel by hand {b:.2f} {label}", a / b,
               f"medians of {len(ours)} runs each, {how}")


if __name__ == "__main__":
    main()
