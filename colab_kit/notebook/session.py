"""``ColossalState``: what the ``%colossal`` magics act on (one cluster, one kernel-side config).

Usable without IPython::

    s = ColossalState()
    s.apply_config(ck.ParallelConfig(dp=2))   # kept in the kernel: no cluster yet
    s.start(2)                                # engines up, the kept config applied on both ranks
"""
from __future__ import annotations

import inspect
import os
from typing import Any

from .cluster import Cluster, ClusterError, RankOutput
from ..config import ConfigError, ParallelConfig

__all__ = ["ColossalState", "with_progress", "current", "find"]


class ColossalState:
    """What the magics act on: at most one cluster, and the config chosen in the kernel.

    Usable without IPython: ``s = ColossalState(); s.start(4); s.apply_config(cfg)``.
    """

    def __init__(self):
        self.cluster: Cluster | None = None
        self.config: ParallelConfig | None = None   # also kept while no cluster runs (for mesh, next start)
        self.last: dict[int, RankOutput] | None = None  # outputs of the last %%colossal cell
        self.dropped: ParallelConfig | None = None
        """The kept config the last ``start`` dropped because it did not fit the ranks that started (the magic says
        so): the session's config is always what the ranks have, once a cluster runs."""
        self.recorded: list[tuple] = []
        """What this cluster ran, in order, for ``%colossal export``: ``("config", dict)``, ``("cell", source,
        ranks)`` (cells that ran without an error), ``("restart",)``."""

    def require_cluster(self) -> Cluster:
        if self.cluster is None or not self.cluster.running:
            raise ClusterError("no cluster started: run %colossal start -n 4 first")
        return self.cluster

    def start(self, n: int | None = None, engines: str = "local", timeout: float | None = None,
              progress=None, *, ip: str | None = None, hosts: dict | None = None,
              profile: str | None = None, fit: bool = False) -> Cluster:
        """Start a cluster (``progress(stage, done, total)`` is told how far it got) and apply the kept config.

        ``ip``, ``hosts`` and ``profile`` are ``Cluster``'s: the controller's address, the engines per host
        for ``engines="ssh"``, and the ipyparallel profile (a name, or a directory) whose
        ``ipcluster_config.py`` configures the launcher; ``fit`` starts fewer than ``n`` engines where this
        host's memory would not hold n (``Cluster``'s)."""
        if self.cluster is not None and self.cluster.running:
            raise ClusterError(f"a cluster of {self.cluster.world_size} ranks is already running: "
                               "%colossal stop it first, or %colossal restart it")
        extra: dict[str, Any] = {}  # profile or profile_dir, for ipyparallel
        if profile:
            is_dir = os.sep in profile or profile.startswith(("~", "."))
            extra["profile_dir" if is_dir else "profile"] = os.path.expanduser(profile) if is_dir else profile
        cluster = with_progress(Cluster(n, engines, ip=ip, hosts=hosts, timeout=timeout or 60, fit=fit, **extra).start,
                                progress)
        self.cluster = cluster
        self.recorded = []  # a new cluster: what it runs from here
        self.dropped = None
        if self.config is not None and self.config.world_size == cluster.world_size:
            cluster.set_config(self.config)
            self.recorded.append(("config", self.config.to_dict()))
        elif self.config is not None:  # %colossal config, mesh and schedule then show what the ranks have: none
            self.config, self.dropped = None, self.config
        return cluster

    def restart(self, progress=None) -> Cluster:
        cluster = with_progress(self.require_cluster().restart, progress)
        self.recorded.append(("restart",))
        return cluster

    def record_cell(self, source: str, ranks) -> None:
        """A ``%%colossal`` cell that ran without an error (for ``%colossal export``)."""
        self.recorded.append(("cell", source, list(ranks) if ranks is not None else None))

    def apply_config(self, config: ParallelConfig) -> str:
        """The one path a config takes to the ranks (``%colossal config`` and ConfigPicker's Apply)."""
        if self.cluster is None or not self.cluster.running:
            self.config = config
            return f"config {config.describe()} kept in the kernel; %colossal start will apply it"
        config.check_world_size(self.cluster.world_size)  # before any engine is touched
        self.cluster.set_config(config)
        self.config = config
        self.recorded.append(("config", config.to_dict()))
        return f"config set on {self.cluster.world_size} ranks: {config.describe()}"

    def mesh_config(self, words: list[str]) -> ParallelConfig:
        if words:
            return ParallelConfig.parse(words)
        if self.config is not None:
            return self.config
        if self.cluster is not None and self.cluster.running:
            return ParallelConfig(dp=self.cluster.world_size)
        raise ConfigError("no config to draw: set one with %colossal config dp=2 tp=2, "
                          "or give it inline: %colossal mesh dp=2 tp=2")

    def stop(self) -> None:
        self.require_cluster().stop()
        self.cluster = None


def with_progress(method, progress):
    """``method(progress=progress)`` where the method takes a ``progress`` keyword (``Cluster.start``
    and ``restart`` as of this version), else ``method()``: progress is shown where it can be."""
    if progress is not None and "progress" in inspect.signature(method).parameters:
        return method(progress=progress)
    return method()


def current(shell=None) -> ColossalState:
    """The session of ``shell`` (default: the running IPython) that ``%load_ext colab_kit`` made; the magics,
    the widgets and ``ck.export`` all act on this one. Raises when the extension is not loaded."""
    from IPython import get_ipython

    shell = shell or get_ipython()
    magics = shell and shell.magics_manager.registry.get("ColossalMagics")
    if magics is None:
        raise RuntimeError("the colab_kit extension is not loaded: run %load_ext colab_kit")
    return magics.state


def find(shell=None) -> ColossalState | None:
    """``current()``, or None where there is no IPython or the extension is not loaded (a widget used from a
    script gets its cluster passed in instead)."""
    try:
        return current(shell)
    except Exception:  # noqa: BLE001 - no IPython, or the extension is not loaded
        return None
