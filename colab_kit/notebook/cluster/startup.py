"""Bringing a ``Cluster``'s engines up: waiting for them (ipyparallel's public wait), then
torch.distributed on every one (probe -> store on rank 0 -> init_process_group).

Worked example, ``Cluster(n=4).start()`` on host "box" (2 cores, no GPU)::

    engines registered 0/4 ... 4/4      (client.wait_for_engines; progress("engines registered", k, 4))
    probe                                every engine: host "box", pid, GPUs 0, route to 127.0.0.1
    open_store                           rank 0: TCPStore on 127.0.0.1:<free port>, loopback only
    init_rank                            rank r: LOCAL_RANK r, nccl_rules (gloo under NCCL's rules), 1 thread each
                                         progress("torch.distributed ready", 4, 4)
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import sys
from collections.abc import Callable
from typing import Any

from ...net import LOOPBACK, is_loopback
from . import remote
from .gather import ClusterError
from .results import RankTable


def own_gpus(info: dict, hosts: list[str]) -> bool:
    """Whether every engine can drive a GPU of its own: it sees at least as many GPUs as its host has engines
    (rank r takes its host's ``local_rank``-th), or it sees exactly one, which no other engine of its host sees
    (Slurm's ``--gpus-per-task=1``, one ``CUDA_VISIBLE_DEVICES`` per engine: it takes that one).

        >>> info = {0: {"cuda": 1, "gpus": ["A"]}, 1: {"cuda": 1, "gpus": ["B"]}}
        >>> own_gpus(info, ["h", "h"]), own_gpus({0: info[0], 1: {"cuda": 1, "gpus": ["A"]}}, ["h", "h"])
        (True, False)
    """
    for r, host in enumerate(hosts):
        mates = [q for q, h in enumerate(hosts) if h == host]
        if info[r]["cuda"] >= len(mates):
            continue
        seen = info[r].get("gpus") or []
        if info[r]["cuda"] != 1 or any(q != r and seen[0] in (info[q].get("gpus") or []) for q in mates):
            return False
    return True


__all__ = ["Startup", "check_hosts", "host_order", "preload_torch", "launcher_names"]


HEARTBEAT_MS, HEARTBEAT_MISSES = 500, 60
ENGINE_HEARTBEAT_MISSES = 175  # an engine checks for the hub's pings every period + 0.5 s: 175 s, as with 3 s x 50


def controller_args(given=None) -> list[str]:
    """The controller's arguments: the user's, then a 0.5 s heartbeat unless they set one.

    The hub takes a new engine on only at its next heartbeats, so ipyparallel's 3 s period made every start and
    restart wait two beats, ~6 s, whatever the engines did. With 6x the misses allowed, an engine that stops
    answering is still dropped after the same 30 s; an engine that hears no ping still gives up after the same
    175 s (``preload_torch`` raises its allowed misses to match)."""
    args = list(given or [])
    if not any("HeartMonitor.period" in a or a.startswith("--ping") for a in args):
        args += [f"--HeartMonitor.period={HEARTBEAT_MS}", f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}"]
    return args


def preload_torch(config=None):
    """ipyparallel config whose engines import torch while they start up: that overlaps the
    import with the engines' registration (about 2 s less for 4 engines on 2 cores)."""
    from traitlets.config import Config

    config = Config(config or {})
    if "engine_args" not in config.EngineLauncher:
        config.EngineLauncher.engine_args = ["--IPEngine.startup_command=import torch, torch.distributed",
                                             f"--IPEngine.max_heartbeat_misses={ENGINE_HEARTBEAT_MISSES}"]
    return config


def launcher_names() -> list[str]:
    from importlib.metadata import entry_points

    return sorted(e.name for e in entry_points(group="ipyparallel.engine_launchers"))


def over_ssh(engines) -> bool:
    """Whether ``engines`` is an SSH engine set: "ssh", or ipyparallel's ``SSHEngineSetLauncher`` (or a subclass),
    named or given as the class.

    >>> over_ssh("ssh"), over_ssh("ipyparallel.cluster.launcher.SSHEngineSetLauncher"), over_ssh("mpi")
    (True, True, False)
    >>> over_ssh("colab_kit.notebook.cluster.ssh.ConcurrentSSHEngineSetLauncher")
    True
    """
    if engines == "ssh":
        return True
    names = [engines] if isinstance(engines, str) else [c.__name__ for c in getattr(engines, "__mro__", ())]
    return any(name.rpartition(".")[2].endswith("SSHEngineSetLauncher") for name in names)


def check_hosts(hosts, engines, n, ipp_kwargs) -> dict[str, int] | None:
    """``hosts=`` of a ``Cluster``, checked before anything starts; an ssh cluster must be told where to go."""
    if hosts is None:
        told = any(k in ipp_kwargs for k in ("config", "profile", "profile_dir"))
        if over_ssh(engines) and not told and not _default_profile_configures_launchers():
            raise ClusterError("engines='ssh' needs the hosts to start engines on: hosts={'10.0.0.1': 2, "
                               "'10.0.0.2': 2} (%colossal start --hosts 10.0.0.1:2,10.0.0.2:2), or "
                               "c.SSHEngineSetLauncher.engines in a profile's ipcluster_config.py (profile=...)")
        return None
    if not over_ssh(engines):
        raise ClusterError(f"hosts= says where ipyparallel's SSH launcher starts engines (engines='ssh'), not "
                           f"engines={engines!r}: the MPI launcher takes a hostfile (c.MPILauncher.mpi_args), and "
                           "Slurm places engines itself")
    good = isinstance(hosts, dict) and hosts and all(
        isinstance(h, str) and h and isinstance(k, int) and not isinstance(k, bool) and k >= 1
        for h, k in hosts.items())
    if not good:
        raise ClusterError(f"hosts must map each host to its number of engines, like {{'10.0.0.1': 2, "
                           f"'10.0.0.2': 2}}, got {hosts!r}")
    if n is not None and n != sum(hosts.values()):
        raise ClusterError(f"n={n} engines, but hosts= names {sum(hosts.values())} ({hosts}): leave n out, "
                           "or make the counts add up to it")
    return dict(hosts)


def check_ipp_options(engines, ip: str | None, ipp_kwargs: dict) -> None:
    """What ``Cluster(**ipp_kwargs)`` passes to ``ipyparallel.Cluster``, and a local cluster's ``ip=``, checked
    before anything starts: a keyword ipyparallel does not take (a typo of one of ``Cluster``'s own, such as
    ``collective_timout``, was silently ignored), a profile that does not exist (ipyparallel made an empty one,
    dropping the launcher settings the user meant), an address local engines cannot listen on."""
    import difflib

    import ipyparallel

    known = set(ipyparallel.Cluster.class_trait_names()) | {"config", "controller_ip"}
    own = ["n", "engines", "ip", "hosts", "timeout", "backend", "grace", "collective_timeout", "fit"]
    for key in ipp_kwargs:
        if key not in known:
            near = difflib.get_close_matches(key, own + sorted(known), n=1)
            raise ClusterError(f"Cluster got an unknown keyword {key}=: it is neither one of Cluster's "
                               f"({', '.join(own)}) nor ipyparallel.Cluster's"
                               + (f"; did you mean {near[0]!r}?" if near else ""))
    profile, profile_dir = ipp_kwargs.get("profile"), ipp_kwargs.get("profile_dir")
    if profile_dir is not None and not os.path.isdir(os.path.expanduser(str(profile_dir))):
        raise ClusterError(f"profile_dir={profile_dir!r} is not a directory: give an ipyparallel profile's directory "
                           "(made by `ipython profile create NAME --parallel`)")
    if profile is not None and profile_dir is None and profile != "default":
        from IPython.paths import get_ipython_dir

        where = get_ipython_dir()
        if not os.path.isdir(os.path.join(where, f"profile_{profile}")):
            have = sorted(d[len("profile_"):] for d in os.listdir(where) if d.startswith("profile_")) \
                if os.path.isdir(where) else []
            near = difflib.get_close_matches(str(profile), have, n=1)
            raise ClusterError(f"no IPython profile {profile!r} in {where}" + (f"; did you mean {near[0]!r}?" if near
                               else f" (there: {', '.join(have) or 'none'})") + f": create it with `ipython profile "
                               f"create {profile} --parallel` and put the launcher's settings in its "
                               "ipcluster_config.py, or leave profile out")
    if ip is not None and engines == "local" and not _this_hosts(ip):
        raise ClusterError(f"ip={ip!r} is not an address, interface or name of this host, and local engines run here: "
                           "leave ip out (loopback), or give one of this host's addresses")


def _this_hosts(ip: str) -> bool:
    """Whether the controller can listen on ``ip`` here: loopback, every interface, an interface's name or
    address, or a host name that resolves to one of them."""
    import socket

    import psutil

    if is_loopback(ip) or ip in ("0.0.0.0", "*", "::", ""):
        return True
    interfaces = psutil.net_if_addrs()
    mine = {a.address.split("%")[0] for addrs in interfaces.values() for a in addrs}
    if ip in interfaces or ip in mine:
        return True
    try:
        named = {str(info[4][0]) for info in socket.getaddrinfo(ip, None)}
    except OSError:
        return False
    return any(is_loopback(a) or a in mine for a in named)


def _default_profile_configures_launchers() -> bool:
    from IPython.paths import get_ipython_dir

    return os.path.isfile(os.path.join(get_ipython_dir(), "profile_default", "ipcluster_config.py"))


def host_order(hosts: list[str], slots: list | None = None) -> list[int]:
    """Old rank of each new rank: by the engines' ``slots`` where every engine has a distinct one (SSH engines:
    their place in ``hosts=``, ``ssh.SLOT``), else contiguous per host, hosts in first-seen order.

    >>> host_order(["a", "b", "a", "b"])   # engines registered alternately from two hosts
    [0, 2, 1, 3]
    >>> host_order(["b", "a", "b", "a"], ["2", "0", "3", "1"])   # host b's engines registered first
    [1, 3, 0, 2]
    """
    if slots and None not in slots and len(set(slots)) == len(slots):
        return sorted(range(len(hosts)), key=lambda r: int(slots[r]))
    return sorted(range(len(hosts)), key=lambda r: hosts.index(hosts[r]))


class Startup:
    """The start-up half of ``Cluster`` (needs ``_client``, ``_ipp``, ``n``, ``ip``, ``timeout``)."""

    # the fields and methods of ``Cluster`` this half uses (``Cluster`` sets and defines them)
    _client: Any  # ipyparallel's Client and Cluster, None until started
    _ipp: Any
    _ids: list[int]
    _table: RankTable
    _relays: frozenset
    n: int
    ip: str
    engines: Any  # a launcher name or class
    backend: str | None
    timeout: float
    collective_timeout: float
    _gather: Callable[..., dict]
    _apply: Callable[..., dict]

    def _wait_for_engines(self, progress=None) -> list[int]:
        """ipyparallel's public wait, reporting how many engines registered while it runs."""
        future = self._client.wait_for_engines(self.n, timeout=self.timeout, block=False, interactive=False)
        said = -1
        while not future.done():  # (its own TimeoutError is concurrent.futures' TimeoutError too)
            cf.wait([future], timeout=0.1)
            got = min(len(self._client.ids), self.n)
            if progress is not None and got != said and not future.done():
                progress("engines registered", got, self.n)
                said = got
        exc = future.exception()
        if exc is not None:  # ipyparallel's TimeoutError, or "engine set stopped"
            got = len(self._client.ids)
            why = "all engine processes exited" if "stopped" in str(exc) else f"within {self.timeout:g} s"
            raise ClusterError(
                f"only {got} of {self.n} engines registered {why} (engines={self.engines!r}). "
                f"Check that the launcher works on this machine, or give more time with timeout=..."
                + self._engine_output())
        if progress is not None:
            progress("engines registered", self.n, self.n)
        return sorted(self._client.ids)[:self.n]

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
        ranks = list(range(self.n))
        info = self._gather(self._apply(ranks, remote.probe, self.ip, list(sys.path), os.getcwd()), self.timeout,
                            "start (probe)")
        order = host_order([info[r]["host"] for r in range(self.n)], [info[r].get("slot") for r in range(self.n)])
        self._ids = [self._ids[r] for r in order]
        info = {new: info[old] for new, old in enumerate(order)}
        self._relays = frozenset(r for r in range(self.n) if info[r].get("relays"))  # before a start can hang
        hosts = [info[r]["host"] for r in range(self.n)]
        local = [hosts[:r].count(h) for r, h in enumerate(hosts)]
        per_host = [hosts.count(h) for h in hosts]
        gpus_ok = own_gpus(info, hosts)
        backend = self.backend or ("nccl" if gpus_ok else "nccl_rules")
        if backend == "nccl" and not gpus_ok:
            short = [r for r in range(self.n) if info[r]["cuda"] < per_host[r]]
            raise ClusterError(f"backend='nccl' needs a GPU of its own for every engine, but ranks {short} see fewer "
                               "GPUs than engines on their host (and no GPU of their own alone): use "
                               "backend='nccl_rules' (CPU ranks under NCCL's rules) or fewer engines per host")
        store_ip = LOOPBACK if is_loopback(self.ip) else info[0]["ip"]
        addr, port = self._gather(self._apply([0], remote.open_store, store_ip, self.n, self.timeout),
                                  self.timeout, "start")[0]
        done = self._gather({r: self._client[self._ids[r]].apply_async(
            remote.init_rank, r, self.n, local[r], per_host[r], addr, port, backend, self.collective_timeout)
            for r in ranks}, self.timeout, "start (init_process_group)")
        self._table = RankTable({"rank": r, "host": hosts[r], "pid": info[r]["pid"], "device": done[r]["device"],
                                 "backend": backend} for r in range(self.n))
