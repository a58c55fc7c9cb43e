"""``Cluster``: ipyparallel engines, one per rank, with torch.distributed initialised.

    >>> with ck.Cluster(n=4) as cluster:            # 4 local engines, gloo on CPU
    ...     cluster.run(lambda x: torch.distributed.get_rank() * x, 10)
    [0, 10, 20, 30]

Rank = the engine's index in sorted engine-id order. Every engine's namespace has
``rank``, ``config`` and ``mesh`` (see ``colab_kit.cluster.remote``), so code sent with
``cluster.execute(code)`` or a ``%%colossal`` cell reads them directly::

    cluster.set_config(ck.ParallelConfig(dp=2, tp=2))
    cluster.execute("print(rank, mesh.ranks('tp'))")
    # rank 0 prints "0 [0, 1]", rank 1 "1 [0, 1]", rank 2 "2 [2, 3]", rank 3 "3 [2, 3]"

Failures: a rank that raises is reported with its rank and traceback (``RankError``).
Ranks still running after a short grace period (typically waiting in a collective
for the failed rank) are given up on: the call returns, the cluster is marked as
needing ``restart()`` (its process group is unusable), and the error says so. A
timeout with no failure raises ``RankTimeout``; its ranks keep running, and the
next call is refused until they finish (or ``restart()`` stops them).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import re
import signal
import socket
import sys
import time

from . import remote
from ..config import ParallelConfig
from ..errors import RankError, RankTimeout
from .results import RankOutput, RankTable, rank_output, split, unwrap_call, unwrap_execute, unwrap_plain

__all__ = ["Cluster", "ClusterError", "RankOutput", "RankTable", "RESTART_ADVICE"]

RESTART_ADVICE = ("the cluster's process group is now unusable: run %colossal restart (or cluster.restart()) "
                  "to get fresh engines with the same config")


class ClusterError(RuntimeError):
    """The cluster cannot do what was asked (not started, failed to start, needs a restart)."""


def _preload_torch(config=None):
    """ipyparallel config whose engines import torch while they start up: that overlaps the
    import with the engines' registration (about 2 s less for 4 engines on 2 cores)."""
    from traitlets.config import Config

    config = Config(config or {})
    if "engine_args" not in config.EngineLauncher:
        config.EngineLauncher.engine_args = ["--IPEngine.startup_command=import torch, torch.distributed"]
    return config


def _launcher_names() -> list[str]:
    from importlib.metadata import entry_points

    return sorted(e.name for e in entry_points(group="ipyparallel.engine_launchers"))


class Cluster:
    """ipyparallel engines with torch.distributed up on every one of them.

    n: engines (ranks); None means one per GPU when CUDA is available, else 4.
    engines: ipyparallel's engine launcher ("local", "mpi", "slurm", "ssh", ...).
    timeout: seconds to wait for engines to register and for the rendezvous.
    backend: "gloo" or "nccl"; None picks nccl when every engine has its own GPU.
    grace: seconds the other ranks get to finish after one failed.
    collective_timeout: the process group's timeout, so a rank left waiting in a
        collective gives up by itself instead of blocking its engine forever.
    ipp_kwargs: passed to ``ipyparallel.Cluster`` (profile, controller_ip, ...).
    """

    def __init__(self, n: int | None = None, engines: str = "local", *, timeout: float = 60,
                 backend: str | None = None, grace: float = 3.0, collective_timeout: float = 120,
                 **ipp_kwargs):
        if n is None:
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 4
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ClusterError(f"n must be a positive whole number of engines, got {n!r}: try n=4")
        if isinstance(engines, str) and "." not in engines and engines not in _launcher_names():
            raise ClusterError(f"unknown engine launcher engines={engines!r}: ipyparallel knows "
                               f"{', '.join(_launcher_names())} (or give a launcher class path)")
        if backend not in (None, "gloo", "nccl"):
            raise ClusterError(f"backend must be 'gloo', 'nccl' or None (pick by hardware), got {backend!r}")
        self.n, self.engines, self.timeout, self.backend = n, engines, timeout, backend
        self.grace, self.collective_timeout, self.ipp_kwargs = grace, collective_timeout, ipp_kwargs
        self.config: ParallelConfig | None = None
        self._ipp = self._client = None
        self._ids: list[int] = []                # engine id of each rank
        self._table = RankTable()
        self._broken: str | None = None          # why the cluster needs a restart
        self._busy: dict[int, object] = {}       # rank -> unfinished AsyncResult of a timed-out call

    # ------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._client is not None

    @property
    def needs_restart(self) -> bool:
        return self._broken is not None

    def start(self) -> "Cluster":
        """Start the controller and ``n`` engines, wait for them, initialise torch.distributed."""
        import ipyparallel as ipp

        if self.running:
            raise ClusterError(f"this cluster of {self.world_size} ranks is already running: "
                               "stop() it first, or restart() it")
        kwargs = {"log_level": logging.ERROR, **self.ipp_kwargs}  # SIGKILLed engines are no news
        kwargs["config"] = _preload_torch(kwargs.get("config"))
        try:
            self._ipp = ipp.Cluster(n=self.n, engines=self.engines, **kwargs)
            self._ipp.start_controller_sync()
            self._client = self._ipp.connect_client_sync()
            self._start_engines(self._registered())
        except BaseException as exc:
            self._teardown(kill=True)
            if isinstance(exc, (ClusterError, KeyboardInterrupt)):
                raise
            raise ClusterError(f"could not start {self.n} engines with engines={self.engines!r}: "
                               f"{type(exc).__name__}: {exc}") from exc
        return self

    def stop(self) -> None:
        """Stop the engines and the controller. This host's engines are killed outright (a rank
        stuck in a collective ignores gentler signals); other hosts' go through their launcher."""
        self._teardown(kill=True)

    def restart(self) -> "Cluster":
        """Kill the engines, start fresh ones, re-initialise torch.distributed, re-apply the config."""
        if self._ipp is None:
            raise ClusterError("no cluster to restart: start one first (cluster.start() or %colossal start)")
        old = self._registered()
        try:
            self._kill_local_engines()
            self._ipp.stop_engines_sync()
            self._start_engines(old)
        except BaseException as exc:
            self._teardown(kill=True)
            if isinstance(exc, (ClusterError, KeyboardInterrupt)):
                raise
            raise ClusterError(f"restart failed, the cluster is stopped: {type(exc).__name__}: {exc}") from exc
        return self

    def __enter__(self) -> "Cluster":
        return self if self.running else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _registered(self) -> set[tuple[int, str]]:
        """(engine id, engine uuid) of every registered engine: launchers such as mpi reuse ids."""
        engines = self._client._engines
        return {(i, engines.get(i)) for i in self._client.ids}

    def _start_engines(self, old: set[tuple[int, str]]) -> None:
        """Start an engine set, wait for ``n`` new engines, then bring torch.distributed up."""
        self._ids, self._table, self._broken, self._busy = [], RankTable(), None, {}
        self._ipp.start_engines_sync(self.n)
        self._ids = self._wait_for_engines(old)
        self._init_dist()
        if self.config is not None:
            self.set_config(self.config)

    def _wait_for_engines(self, old: set[tuple[int, str]]) -> list[int]:
        deadline = time.monotonic() + self.timeout
        while True:
            new = sorted(i for i, _ in self._registered() - old)
            if len(new) >= self.n:
                return new[:self.n]
            sets = list(self._ipp.engines.values())
            dead = sets and all(getattr(s, "state", "running") == "after" for s in sets)
            if dead or time.monotonic() > deadline:
                why = "all engine processes exited" if dead else f"within {self.timeout:g} s"
                raise ClusterError(
                    f"only {len(new)} of {self.n} engines registered {why} (engines={self.engines!r}). "
                    f"Check that the launcher works on this machine, or give more time with timeout=..."
                    + self._engine_output())
            time.sleep(0.05)

    def _engine_output(self) -> str:
        text = ""
        for s in self._ipp.engines.values():
            try:
                out = s.get_output()
                text += "\n".join(out.values()) if isinstance(out, dict) else str(out or "")
            except Exception:  # noqa: BLE001 - output is a hint only
                pass
        tail = "\n".join(text.strip().splitlines()[-8:])
        return f"\nlast lines of the engines' output:\n{tail}" if tail else ""

    def _init_dist(self) -> None:
        """probe -> rank 0 opens the store -> every rank joins the process group."""
        host = re.sub(r"^\w+://|:\d+$", "", self._client._config.get("interface", "tcp://127.0.0.1"))
        if host in ("*", "0.0.0.0", ""):
            host = self._client._config.get("location") or "127.0.0.1"
        ranks = list(range(self.n))
        info = self._gather(self._apply(ranks, remote.probe, host, list(sys.path), os.getcwd()), self.timeout,
                            "start (probe)")
        hosts = [info[r]["host"] for r in range(self.n)]
        local = [hosts[:r].count(h) for r, h in enumerate(hosts)]
        per_host = [hosts.count(h) for h in hosts]
        gpus_ok = all(info[r]["cuda"] >= per_host[r] for r in range(self.n))
        backend = self.backend or ("nccl" if gpus_ok else "gloo")
        if backend == "nccl" and not gpus_ok:
            short = [r for r in range(self.n) if info[r]["cuda"] < per_host[r]]
            raise ClusterError(f"backend='nccl' needs one GPU per engine, but ranks {short} see fewer GPUs "
                               "than engines on their host: use backend='gloo' or fewer engines per host")
        addr, port = self._gather(self._apply([0], remote.open_store, info[0]["ip"], self.n, self.timeout),
                                  self.timeout, "start")[0]
        done = self._gather({r: self._client[self._ids[r]].apply_async(
            remote.init_rank, r, self.n, local[r], per_host[r], addr, port, backend, self.collective_timeout)
            for r in ranks}, self.timeout, "start (init_process_group)")
        self._table = RankTable({"rank": r, "host": hosts[r], "pid": info[r]["pid"], "device": done[r]["device"],
                                 "backend": backend} for r in range(self.n))

    def _kill_local_engines(self) -> None:
        """SIGKILL this host's engines: a rank blocked in a C++ collective ignores gentler signals."""
        me = socket.gethostname()
        for row in self._table:
            if row["host"] == me:
                try:
                    os.kill(row["pid"], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _teardown(self, kill: bool) -> None:
        if kill:
            self._kill_local_engines()
        if self._client is not None:
            self._client.close()
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception:  # noqa: BLE001 - best effort: the processes may be gone already
                pass
        self._ipp = self._client = None
        self._ids, self._table, self._broken, self._busy = [], RankTable(), None, {}

    # ------------------------------------------------------------ use
    def ranks(self) -> RankTable:
        """One row per rank: rank, host, pid, device, backend."""
        return RankTable(dict(r) for r in self._table)

    @property
    def world_size(self) -> int:
        return len(self._ids)

    def set_config(self, config: ParallelConfig | None) -> None:
        """Check ``config`` against the world size, then set ``config`` and build ``mesh`` on every rank."""
        self._check_usable()
        if config is not None:
            config.check_world_size(self.world_size)
        self._gather(self._apply(list(range(self.world_size)), remote.set_config, config and config.to_dict()),
                     self.timeout, "set_config")
        self.config = config

    def run(self, fn, *args, ranks: list[int] | None = None, timeout: float | None = None):
        """``fn(*args)`` on every rank (or ``ranks``): a list by rank, or a dict rank -> result."""
        targets = self._targets(ranks)
        ars = self._apply(targets, remote.call, fn, args, {})
        out = self._gather(ars, timeout, getattr(fn, "__name__", "run"), unwrap=unwrap_call)
        return [out[r] for r in targets] if ranks is None else {r: out[r] for r in targets}

    def execute(self, code: str, ranks: list[int] | None = None, timeout: float | None = None,
                where: str = "execute", progress=None) -> dict[int, RankOutput]:
        """Run ``code`` in every rank's namespace; rank -> RankOutput (stdout, stderr, result).

        On failure the RankError carries ``outputs`` (every rank's RankOutput, the
        stuck ones with what they printed so far), so a caller can still show them.
        ``progress(seconds, {rank: stdout so far})`` is called about once a second while waiting.
        """
        targets = self._targets(ranks)
        ars = split(self._view(targets).execute(code, silent=False, block=False), targets)
        tick = None if progress is None else (lambda t: progress(t, {r: ar.stdout or "" for r, ar in ars.items()}))
        try:
            self._gather(ars, timeout, where, unwrap=unwrap_execute, tick=tick)
        except RankError as err:
            err.outputs = {r: rank_output(r, ar, err) for r, ar in ars.items()}
            raise
        return {r: rank_output(r, ar, None) for r, ar in ars.items()}

    def status(self) -> str:
        """One line: running or not, ranks, backend, config, and whether a restart is needed."""
        if not self.running:
            return "no cluster running"
        backend = self._table[0]["backend"] if self._table else "?"
        text = (f"{self.world_size} ranks ({self.engines} engines, {backend}); config: "
                + (self.config.describe() if self.config else "none set"))
        if self._broken:
            text += f"; NEEDS RESTART ({self._broken})"
        busy = [r for r, ar in self._busy.items() if not ar.ready()]
        if busy:
            text += f"; ranks {busy} still running a call that timed out"
        return text

    def __repr__(self) -> str:
        return f"Cluster(n={self.n}, engines={self.engines!r}: {self.status()})"

    # ------------------------------------------------------------ sending, and waiting with failure handling
    def _interrupt(self, pending: dict) -> None:
        """Pass an interrupt on to the ranks still running (this host's, by SIGINT); a rank that
        does not stop within ``grace`` (blocked in a C++ collective) leaves the cluster needing a restart."""
        me = socket.gethostname()
        for rank in pending:
            row = self._table[rank] if rank < len(self._table) else None
            if row is not None and row["host"] == me:
                try:
                    os.kill(row["pid"], signal.SIGINT)
                except OSError:
                    pass
        cf.wait(list(pending.values()), timeout=self.grace)
        still = sorted(r for r, ar in pending.items() if not ar.ready())
        self._busy = {}
        if still:
            self._broken = f"ranks {still} did not stop when interrupted (blocked in a collective?)"

    def _view(self, ranks: list[int]):
        """One DirectView on the engines of ``ranks``: a call is serialised once for all of them."""
        ids = [self._ids[r] for r in ranks]
        gone = [r for r, i in zip(ranks, ids) if i not in self._client.ids]
        if gone:
            self._broken = f"the engines of ranks {gone} are gone (killed, or out of memory?)"
            raise ClusterError(f"{self._broken}: run %colossal restart (or cluster.restart()) for fresh engines")
        return self._client[ids]

    def _apply(self, ranks: list[int], fn, *args) -> dict:
        """``fn(*args)`` on ``ranks``: rank -> AsyncResult."""
        return split(self._view(ranks).apply_async(fn, *args), ranks)

    def _targets(self, ranks: list[int] | None) -> list[int]:
        self._check_usable()
        if ranks is None:
            return list(range(self.world_size))
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.world_size)]
        if bad or not ranks:
            raise ClusterError(f"ranks {bad or ranks} are not ranks of this cluster: "
                               f"choose among 0..{self.world_size - 1}")
        return sorted(set(ranks))

    def _check_usable(self) -> None:
        if not self.running:
            raise ClusterError("no cluster is running: start one with %colossal start -n 4 "
                               "(or ck.Cluster(n=4).start())")
        if self._broken:
            raise ClusterError(f"the cluster needs a restart: {self._broken}. Run %colossal restart "
                               "(or cluster.restart()) first")
        busy = sorted(r for r, ar in self._busy.items() if not ar.ready())
        if busy:
            raise ClusterError(f"ranks {busy} are still running a call that timed out, so new work would "
                               "queue behind it: wait for them (%colossal status), or run %colossal restart")
        self._busy = {}

    def _gather(self, ars: dict, timeout: float | None, where: str, unwrap=None, tick=None) -> dict:
        """Wait for one AsyncResult per rank; give up on the rest ``grace`` s after a failure."""
        unwrap = unwrap or unwrap_plain
        t0 = time.monotonic()
        deadline = float("inf") if timeout is None else t0 + timeout
        pending, results, failures = dict(ars), {}, {}
        try:
            while pending and time.monotonic() < deadline:
                left = min(deadline - time.monotonic(), 1.0)
                done, _ = cf.wait(list(pending.values()), timeout=max(left, 0), return_when=cf.FIRST_COMPLETED)
                if tick is not None and not done:
                    tick(time.monotonic() - t0)
                for rank in [r for r, ar in pending.items() if ar in done]:
                    ok, value = unwrap(pending.pop(rank))
                    if ok:
                        results[rank] = value
                    else:
                        failures[rank] = value
                        deadline = min(deadline, time.monotonic() + self.grace)
        except KeyboardInterrupt:  # Ctrl-C or the notebook's stop button
            self._interrupt(pending)
            raise
        if failures:
            advice = ""
            died = [r for r, text in failures.items() if text.startswith("EngineError")]
            if pending or died:
                self._broken = (f"the engines of ranks {died} died in {where}" if died else
                                f"rank {next(iter(failures))} failed in {where} while ranks {sorted(pending)} waited")
                advice = RESTART_ADVICE
            raise RankError(failures, sorted(pending), where, advice)
        if pending:
            self._busy = pending
            raise RankTimeout(sorted(pending), timeout, where,
                              "they are still running it: wait for them (%colossal status), or run "
                              "%colossal restart (cluster.restart()) to stop them")
        return results

