"""``Cluster``: ipyparallel engines, one per rank, with torch.distributed initialised.

    >>> with ck.Cluster(n=4) as cluster:            # 4 local engines, nccl_rules on CPU  # doctest: +SKIP
    ...     cluster.run(lambda x: torch.distributed.get_rank() * x, 10)
    [0, 10, 20, 30]

Rank = the engine's index in sorted engine-id order. Every engine's namespace has
``rank``, ``config`` and ``mesh`` (see ``colab_kit.notebook.cluster.remote``), so code sent with
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

import logging
import os
import signal
import sys
import time
from typing import Any

from ...config import ParallelConfig
from ...errors import RankError
from ...launch import seconds_refusal
from ...net import LOOPBACK
from ...errors.tracebacks import pack, source_map
from . import forked, remote, ssh
from .forked import fork_server, forking
from ..progress import call_progress, notebook_progress, stage_progress
from .gather import RESTART_ADVICE, ClusterError, Waiting
from .results import RankOutput, RankTable, check_ranks, rank_output, split, unwrap_call, unwrap_execute
from .room import CONTROLLER_BYTES, FORK_SERVER_BYTES, fitting
from .startup import Startup, check_hosts, check_ipp_options, controller_args, launcher_names, preload_torch
from .watchdog import Watchdog, cluster_processes, descendant_pids, end_processes, launcher_pids, with_descendants

__all__ = ["Cluster", "ClusterError", "RankOutput", "RankTable", "RESTART_ADVICE"]

LOCAL_LAUNCHERS = ("local",)  # launchers that only ever start engines on this host


class Cluster(Startup, Waiting):
    """ipyparallel engines with torch.distributed up on every one of them.

    n: engines (ranks); None means one per GPU when CUDA is available, else 4.
    engines: ipyparallel's engine launcher ("local", "mpi", "slurm", "ssh", ...).
    ip: the address the controller and the rendezvous store listen on. Local engines
        use 127.0.0.1 (nothing listens beyond loopback); a launcher that can start
        engines on other hosts needs it named (``ip="10.0.0.5"``, or ``ip="127.0.0.1"``
        when every engine is on this host), since that opens the cluster to the network.
    hosts: for ``engines="ssh"``, the engines to start on each host, in rank order:
        ``{"10.0.0.1": 2, "10.0.0.2": 2}`` (ipyparallel's ``SSHEngineSetLauncher.engines``);
        ``n`` defaults to their sum. ssh itself reads ``~/.ssh/config`` (keys, user), or the
        profile's ``ipcluster_config.py`` (``c.SSHLauncher.ssh_args``, ``profile=`` or
        ``profile_dir=`` below).
    timeout: seconds to wait for engines to register and for the rendezvous.
    backend: "nccl", "nccl_rules" (gloo on CPU under NCCL's rules: what runs here runs on GPUs) or "gloo"
    (gloo's own, forgiving semantics); None picks nccl when every engine has a GPU of its own, else nccl_rules.
    grace: seconds the other ranks get to finish after one failed.
    collective_timeout: the process group's timeout, so a rank left waiting in a
        collective gives up by itself instead of blocking its engine forever.
    fit: start fewer than ``n`` engines where this host's memory would not hold n: the largest of
        n, n/2, n/4, ... that fits (``colab_kit.notebook.cluster.room``: Binder's 2 GiB holds about 4);
        ``fit_note`` says why, and is empty when n started. Local engines only.
    ipp_kwargs: passed to ``ipyparallel.Cluster`` (profile, profile_dir, config, ...).

    Ranks are contiguous per host, so tp groups, the fastest-varying axis, stay inside a host: SSH
    engines in ``hosts`` order (each is told its place, ``ssh.SLOT``), other launchers' engines in
    engine-id order, the hosts in the order their first engine registered.

    POSIX only (Linux, macOS): engines are signalled and watched as POSIX processes.
    The engines and the controller die with the process that started them, however it
    dies (``colab_kit.notebook.cluster.watchdog``).
    """

    def __init__(self, n: int | None = None, engines: str = "local", *, ip: str | None = None,
                 hosts: dict[str, int] | None = None, timeout: float = 60, backend: str | None = None,
                 grace: float = 3.0, collective_timeout: float = 120, fit: bool = False, **ipp_kwargs):
        if os.name != "posix":
            raise ClusterError(f"colab_kit's cluster runs on POSIX systems (Linux, macOS), not {sys.platform}: "
                               "on Windows use WSL, or ck.launch for local ranks")
        hosts = check_hosts(hosts, engines, n, ipp_kwargs)
        if n is None and hosts:
            n = sum(hosts.values())
        if n is None:
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 4
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ClusterError(f"n must be a positive whole number of engines, got {n!r}: try n=4")
        self.fit_note = ""  # why fewer than n started (fit=True), else empty
        if fit:
            if engines not in LOCAL_LAUNCHERS:
                raise ClusterError(f"fit=True counts this host's memory, and engines={engines!r} may start engines "
                                   "elsewhere: give n for that launcher, or use engines='local'")
            try:
                server = FORK_SERVER_BYTES if forking(engines) and forked.server_pid() is None else 0
                if forking(engines) and not server:  # started by %load_ext: counted once its imports are done
                    forked.fork_server().wait_ready()
                n, self.fit_note = fitting(n, beside=CONTROLLER_BYTES + server)
            except (MemoryError, ValueError) as exc:
                raise ClusterError(str(exc)) from None
            except (TimeoutError, RuntimeError) as exc:  # the fork server hung or died in its imports
                raise ClusterError(f"could not count this host's memory for fit=True: {exc}") from None
        if isinstance(engines, str) and "." not in engines and engines not in launcher_names():
            raise ClusterError(f"unknown engine launcher engines={engines!r}: ipyparallel knows "
                               f"{', '.join(launcher_names())} (or give a launcher class path)")
        if backend not in (None, "gloo", "nccl", "nccl_rules"):
            raise ClusterError(f"backend must be 'nccl', 'nccl_rules', 'gloo' or None (pick by hardware), got "
                               f"{backend!r}")
        for name, value, default in (("timeout", timeout, 60), ("grace", grace, 3.0),
                                     ("collective_timeout", collective_timeout, 120)):
            why = seconds_refusal(name, value, zero_ok=name == "grace")
            if why is not None:
                raise ClusterError(f"{why} (the default: {default})")
        check_ipp_options(engines, ip or ipp_kwargs.get("controller_ip"), ipp_kwargs)
        if "controller_ip" in ipp_kwargs:
            ip = ip or ipp_kwargs.pop("controller_ip")
        if ip is None and engines not in LOCAL_LAUNCHERS:
            raise ClusterError(
                f"engines={engines!r} can start engines on other hosts, which must reach this one: name the "
                "address to listen on with ip='10.0.0.5' (an address of this host that they can reach), or "
                "ip='127.0.0.1' when every engine runs on this host. Local engines need no ip (loopback only)")
        self.n, self.engines, self.ip, self.timeout, self.backend = n, engines, ip or LOOPBACK, timeout, backend
        self.hosts = hosts
        self.grace, self.collective_timeout, self.ipp_kwargs = grace, collective_timeout, ipp_kwargs
        self.config: ParallelConfig | None = None
        self._ipp: Any = None                    # ipyparallel's Cluster and Client, once started
        self._client: Any = None
        self._watchdog: Watchdog | None = None
        self._engine_procs: list = []            # this host's engine processes (psutil), for the watchdog
        self._controller_procs: list = []        # the controller's processes: a dead one is noticed
        self._ids: list[int] = []                # engine id of each rank
        self._table = RankTable()
        self._broken: str | None = None          # why the cluster needs a restart
        self._busy: dict[int, Any] = {}       # rank -> unfinished AsyncResult of a timed-out call

    # ------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._client is not None

    @property
    def needs_restart(self) -> bool:
        self._notice_deaths()
        return self._broken is not None

    def _notice_deaths(self) -> None:
        """Mark the cluster for restart where an engine or the controller has died since the last call (an engine
        killed, or out of memory, between cells): ``status()`` and ``needs_restart`` say so before the next cell
        finds it. The engines' nannies tell the controller at once; no engine is asked anything."""
        if self._client is None or self._broken is not None:
            return
        try:
            dead = self._dead_ranks(range(len(self._ids)))
        except Exception:  # noqa: BLE001 - a client whose controller is gone cannot list its engines
            dead = []
        if dead:
            self._broken = f"the engines of ranks {dead} are gone (killed, or out of memory?)"
        elif self._controller_dead():
            self._broken = "the controller process has ended"

    def start(self, progress=None) -> Cluster:
        """Start the controller and ``n`` engines, wait for them, initialise torch.distributed.

        ``progress(stage, done, total)``, if given, is called while this runs (True prints each stage
        on stderr, False or None nothing): with
        "engines registered" as engines come up, then "torch.distributed ready".
        """
        import ipyparallel as ipp

        progress = stage_progress(progress)
        if self.running:
            raise ClusterError(f"this cluster of {self.world_size} ranks is already running: "
                               "stop() it first, or restart() it")
        kwargs = {"log_level": logging.ERROR, **self.ipp_kwargs}  # SIGKILLed engines are no news
        kwargs["config"] = preload_torch(kwargs.get("config"))
        if self.hosts:
            kwargs["config"].SSHEngineSetLauncher.engines = dict(self.hosts)
        try:
            self._watchdog = watchdog = Watchdog()
            engines = self.engines
            if forking(engines):
                # the kernel's, not this cluster's: before ``before``; its imports overlap the controller's start
                fork_server()
                engines = forked.ForkedEngineSetLauncher
            elif engines == "ssh":  # every host's engines at once (ssh.py)
                engines = ssh.ConcurrentSSHEngineSetLauncher
            before = descendant_pids()
            self._ipp = ipp.Cluster(n=self.n, engines=engines, controller_ip=self.ip, **kwargs)
            # a 0.5 s heartbeat, after the profile's and config's own controller arguments (startup.controller_args)
            self._ipp.controller_args = controller_args(self._ipp.controller_args)
            self._ipp.start_controller_sync()
            # the controller and its schedulers: what its launcher started, not any other new child of the kernel
            self._controller_procs = cluster_processes(before, launcher_pids(self._ipp.controller))
            watchdog.watch(self._controller_procs)
            self._client = self._ipp.connect_client_sync()
            self._start_engines(progress)
        except BaseException as exc:
            self._teardown()
            if isinstance(exc, (ClusterError, KeyboardInterrupt)):
                raise
            raise ClusterError(f"could not start {self.n} engines with engines={self.engines!r}: "
                               f"{type(exc).__name__}: {exc}") from exc
        return self

    def stop(self) -> None:
        """Stop the engines and the controller. Engines are killed outright, through their launcher
        (a rank stuck in a collective ignores gentler signals)."""
        self._teardown()

    def restart(self, progress=None) -> Cluster:
        """Kill the engines, start fresh ones, re-initialise torch.distributed, re-apply the config."""
        progress = stage_progress(progress)
        if self._ipp is None:
            raise ClusterError("no cluster to restart: start one first (cluster.start() or %colossal start)")
        try:
            self._stop_engines()
            self._start_engines(progress)
        except BaseException as exc:
            self._teardown()
            if isinstance(exc, (ClusterError, KeyboardInterrupt)):
                raise
            raise ClusterError(f"restart failed, the cluster is stopped: {type(exc).__name__}: {exc}") from exc
        return self

    def __enter__(self) -> Cluster:
        return self if self.running else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start_engines(self, progress=None) -> None:
        """Start an engine set, wait for ``n`` engines, then bring torch.distributed up."""
        self._ids, self._table, self._broken, self._busy = [], RankTable(), None, {}
        watchdog = self._watchdog
        assert watchdog is not None, "start() makes the watchdog before any engine starts"
        if forking(self.engines):
            fork_server()  # a server that died since the start is replaced before ``before``
        before = descendant_pids()
        self._ipp.start_engines_sync(self.n)
        # watched from the start (a failed start ends them too); never the kernel's fork server
        launched = set().union(*(launcher_pids(s) for s in (self._ipp.engines or {}).values()))
        self._engine_procs = [p for p in cluster_processes(before, launched) if p.pid != forked.server_pid()]
        watchdog.watch(self._engine_procs)
        self._ids = self._wait_for_engines(progress)
        self._engine_procs = with_descendants(self._engine_procs)  # and now their nannies
        self._controller_procs = with_descendants(self._controller_procs)  # its schedulers are up by now
        watchdog.watch(self._engine_procs + self._controller_procs)
        self._init_dist()
        if progress is not None:
            progress("torch.distributed ready", self.n, self.n)
        if self.config is not None:
            self.set_config(self.config)

    def _stop_engines(self) -> None:
        """SIGKILL every engine through its launcher, and wait until the controller has seen them go."""
        try:
            self._ipp.signal_engines_sync(signal.SIGKILL)
        except Exception:  # noqa: BLE001 - engines that are gone already
            pass
        self._ipp.stop_engines_sync()
        deadline = time.monotonic() + self.timeout
        while self._client.ids and time.monotonic() < deadline:  # their nannies report at once
            time.sleep(0.05)
        if self._client.ids:
            raise ClusterError(f"engines {self._client.ids} were still registered {self.timeout:g} s after "
                               "they were killed")
        assert self._watchdog is not None, "start() makes the watchdog before any engine starts"
        self._watchdog.forget(self._engine_procs)

    def _teardown(self) -> None:
        if self._ipp is not None:
            try:
                self._ipp.signal_engines_sync(signal.SIGKILL)
            except Exception:  # noqa: BLE001 - best effort: the processes may be gone already
                pass
        if self._client is not None:
            self._client.close()
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception:  # noqa: BLE001 - best effort: the processes may be gone already
                pass
        end_processes(self._engine_procs + self._controller_procs)  # e.g. a dead controller's schedulers
        if self._watchdog is not None:
            self._watchdog.close()
        self._ipp = self._client = self._watchdog = None
        self._engine_procs, self._controller_procs = [], []
        self._ids, self._table, self._broken, self._busy = [], RankTable(), None, {}

    # ------------------------------------------------------------ use
    def ranks(self) -> RankTable:
        """One row per rank: rank, host, pid, device, backend."""
        return RankTable(dict(r) for r in self._table)

    @property
    def world_size(self) -> int:
        return len(self._ids)

    def set_config(self, config: ParallelConfig | str | dict | None) -> None:
        """Check ``config`` against the world size, then set ``config`` and build ``mesh`` on every rank. Given
        as a ``ParallelConfig``, its words (``"dp=2 tp=2"``, as ``%colossal config`` takes them) or its fields
        (``{"dp": 2, "tp": 2}``); None clears it."""
        if isinstance(config, str):
            config = ParallelConfig.parse(config)
        elif isinstance(config, dict):
            config = ParallelConfig(**config)
        elif config is not None and not isinstance(config, ParallelConfig):
            raise ClusterError(f"set_config takes a ck.ParallelConfig (or its words, 'dp=2 tp=2', or its fields, "
                               f"{{'dp': 2}}), or None to clear it; got {type(config).__name__}")
        self._check_usable()
        if config is not None:
            config.check_world_size(self.world_size)
        self._gather(self._apply(list(range(self.world_size)), remote.set_config, config and config.to_dict()),
                     self.timeout, "set_config")
        self.config = config

    def run(self, fn, *args, ranks: list[int] | None = None, timeout: float | None = None, progress="auto"):
        """``fn(*args)`` on every rank (or ``ranks``): a list by rank, or a dict rank -> result.

        ``progress(seconds, {rank: stdout so far})`` is called about once a second while
        waiting; the default ("auto", or True) shows a live line in a notebook once a call has run
        for 2 s (``running on 4 ranks for 7 s; rank 0: step 10 loss 3.0``), nothing elsewhere;
        False or None shows nothing.
        """
        mode = call_progress(progress)  # a bad value is refused before anything is sent
        if not callable(fn):
            raise ClusterError(f"run takes a function to call on the ranks, got {type(fn).__name__}: "
                               "cluster.run(fn, *args), or cluster.execute(code) for a string of code")
        targets = self._targets(ranks, timeout)
        # pickled here with cloudpickle (tracebacks.pack), not ipyparallel's canning: a class defined in the
        # notebook (a user's nn.Module, whose methods' super() cell refers back to it) travels by value
        ars = self._apply(targets, remote.call_packed, pack((fn, args)), source_map(fn, args))
        line = notebook_progress(len(targets)) if mode == "auto" else mode
        tick = None if line is None else (lambda t: line(t, {r: ar.stdout or "" for r, ar in ars.items()}))
        try:
            out = self._gather(ars, timeout, getattr(fn, "__name__", "run"), unwrap=unwrap_call, tick=tick)
        finally:
            if mode == "auto" and line is not None:
                line.close()
        check_ranks(ars, self._ids)
        return [out[r] for r in targets] if ranks is None else {r: out[r] for r in targets}

    def submit(self, fn, *args, rank: int = 0) -> tuple:
        """Send ``fn(*args)`` to ``rank`` and return at once: ``(rank, AsyncResult)``, for ``collect``. An
        engine runs its requests in the order they came, so a call submitted from ``execute``'s ``sent``
        runs on its engine right behind the code: the ``%%colossal`` magic asks rank 0 what a cell trained
        that way, in the cell's round trip: a no-op cell on 4 ranks 12.8-14.0 ms, against 14.4-15.4 with the
        question in a round trip of its own after the cell and 8.5-9.2 for ipyparallel's ``execute`` alone
        (medians of 60 alternating runs, twice, by hand; ``bench/cluster.py`` keeps the last ratio)."""
        self._check_usable()
        target = self._targets([rank])[0]
        return target, self._apply([target], remote.call_packed, pack((fn, args)), source_map(fn, args))[target]

    def collect(self, submitted: tuple, timeout: float | None = None):
        """The value of a ``submit``ted call; its rank's exception as a RankError, TimeoutError past ``timeout``
        (the call keeps its place in the engine's queue)."""
        rank, ar = submitted
        ar.wait(timeout)
        if not ar.ready():
            raise TimeoutError(f"rank {rank} did not answer within {timeout} s")
        ok, value = unwrap_call(ar)
        if not ok:
            raise RankError({rank: str(value)}, [], "submit")  # the rank's traceback text
        return value

    def execute(self, code: str, ranks: list[int] | None = None, timeout: float | None = None,
                where: str = "execute", progress=None, sent=None) -> dict[int, RankOutput]:
        """Run ``code`` in every rank's namespace; rank -> RankOutput (stdout, stderr, result).
        ``sent()``, when given, is called once the code is on its way and before the wait (see ``submit``).

        On failure the RankError carries ``outputs`` (every rank's RankOutput, the
        stuck ones with what they printed so far), so a caller can still show them; so
        does the KeyboardInterrupt of a Ctrl-C (and ``cluster_status``: whether the ranks
        passed the health check that follows an interrupt).
        ``progress(seconds, {rank: stdout so far})`` is called about once a second while waiting;
        execute draws no line of its own, so True and "auto" show nothing here (the magic passes its own).
        """
        progress = call_progress(progress, auto=None)
        if not isinstance(code, str):
            raise ClusterError(f"execute takes code as a string, got {type(code).__name__}: cluster.run(fn) calls "
                               "a function")
        targets = self._targets(ranks, timeout)
        ars = split(self._view(targets).execute(code, silent=False, block=False), targets)
        if sent is not None:
            sent()
        tick = None if progress is None else (lambda t: progress(t, {r: ar.stdout or "" for r, ar in ars.items()}))
        try:
            self._gather(ars, timeout, where, unwrap=unwrap_execute, tick=tick, cell=code)
            check_ranks(ars, self._ids)
        except RankError as err:
            err.outputs = {r: rank_output(r, ar, err) for r, ar in ars.items()}
            raise
        except KeyboardInterrupt as stop:  # the ranks were interrupted and checked: keep what they said
            # on the interrupt itself, which the magic catches (another KeyboardInterrupt lacks them): two attributes
            # of ours on a builtin exception, which mypy cannot know
            outputs = {r: rank_output(r, ar, None, interrupted=True) for r, ar in ars.items()}
            stop.outputs = outputs  # type: ignore[attr-defined]
            stop.cluster_status = self.status()  # type: ignore[attr-defined]
            raise
        return {r: rank_output(r, ar, None) for r, ar in ars.items()}

    def status(self) -> str:
        """One line: running or not, ranks, backend, config, and whether a restart is needed."""
        if not self.running:
            return "no cluster running"
        self._notice_deaths()
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
