"""Engines over SSH, started, signalled and stopped host by host at once instead of one after another.

ipyparallel's ``SSHEngineSetLauncher`` starts its engines one at a time, and each start is several ssh
round trips and a remote Python (the shell's kind, ``IPython profile create``, the connection files, the
engine); its ``signal`` and ``stop`` go engine by engine too. On two hosts of two engines each (the suite's
two network namespaces, ``tests/cluster/test_two_hosts.py``) that was 8 s to start the engines and 1.6 s to
signal them; on 8 hosts of 8 GPUs it grows 16 times, where the hosts could all be working.

``ConcurrentSSHEngineSetLauncher`` is that launcher with one change of order: per host, the first engine
starts first (it sends the connection files, which the host's other engines read), then the host's other
engines start together, and every host does so at the same time. Signals and stops go to every engine at
once. At most ``PER_HOST`` ssh sessions open at once on one host: sshd's default ``MaxStartups 10:30:100``
starts refusing new connections at random beyond 10 unauthenticated ones. ``Cluster(engines="ssh")`` uses it;
``engines="ipyparallel.cluster.launcher.SSHEngineSetLauncher"`` gives ipyparallel's own.

Worked example, ``hosts={"a": 2, "b": 2}``::

    round 1   a/0 (sends the files)    b/0 (sends the files)       two ssh starts at once
    round 2   a/1                      b/1                         then the rest of each host at once
    ranks     0, 1 on a; 2, 3 on b     (by each engine's ``SLOT``, whichever registered first)
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from .forked import built_on_first_use

__all__ = ["PER_HOST", "SLOT"]  # and ConcurrentSSHEngineSetLauncher, built on first use

PER_HOST = 8
"""ssh sessions opened at once on one host (sshd refuses at random beyond 10 unauthenticated by default)."""

SLOT = "COLAB_KIT_ENGINE_SLOT"
"""Environment variable: the engine's place in ``hosts`` order (0, 1, ... over every host). Engines started at
once register in any order; the cluster gives ranks by this slot, so ``hosts="a:2,b:2"`` puts ranks 0 and 1
on a whatever came up first (``remote.probe`` reads it, ``Startup._init_dist`` orders by it)."""


def _split(host: str) -> tuple[str | None, str, str | None]:
    """``user@host:port`` as ipyparallel's launcher reads it: (user, host, port).

    >>> _split("root@10.0.0.2:2222"), _split("node7")
    (('root', '10.0.0.2', '2222'), (None, 'node7', None))
    """
    user, host = host.split("@", 1) if "@" in host else (None, host)
    host, port = host.split(":", 1) if ":" in host else (host, None)
    return user, host, port


def _run_all(calls, workers: int) -> None:
    """Run ``calls`` (no-argument functions) on ``workers`` threads; raise the first failure after all ended."""
    if not calls:
        return
    with ThreadPoolExecutor(max(1, min(workers, len(calls)))) as pool:
        futures = [pool.submit(c) for c in calls]
    for f in futures:
        error = f.exception()
        if error is not None:
            raise error


def _launcher_classes():
    from signal import SIGKILL, SIGTERM

    from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher

    class ConcurrentSSHEngineLauncher(SSHEngineLauncher):
        """One engine over SSH; its stop sends SIGTERM from a thread, so that the set's stops overlap."""

        async def stop(self):
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.signal, SIGTERM)
            except Exception as e:  # noqa: BLE001 - as ipyparallel's stop: an engine gone already
                self.log.debug(f"TERM failed: {e!r}")
            try:
                await self.join(timeout=self.stop_seconds_until_kill)
                return
            except TimeoutError:
                self.log.warning(f"Process {self.pid} did not exit in {self.stop_seconds_until_kill} s after TERM")
            await asyncio.get_running_loop().run_in_executor(None, self.signal, SIGKILL)
            await self.join(timeout=self.stop_timeout)

    class ConcurrentSSHEngineSetLauncher(SSHEngineSetLauncher):
        """ipyparallel's SSH engine set, every host's engines started at once (see the module docstring)."""

        launcher_class = ConcurrentSSHEngineLauncher

        def start(self, n):
            engine_traits = self.launcher_class.class_traits(config=True)
            inherited = set(self.traits(config=True)).intersection(engine_traits).difference(
                {"location", "user", "hostname", "to_send", "to_fetch"}).union({"profile_dir", "cluster_id"})
            per_host: list[list] = []  # [(launcher, user, host, port)] a host, in the config's order
            started = 0
            for full_host, n_or_config in self.engines.items():
                overrides = dict(n_or_config) if isinstance(n_or_config, dict) else {}
                count = overrides.pop("n", 1) if isinstance(n_or_config, dict) else n_or_config
                user, host, port = _split(full_host)
                group = []
                for i in range(min(count, n - started)):
                    kwargs = {attr: getattr(self, attr) for attr in inherited}
                    kwargs.update(overrides)
                    kwargs["parent"], kwargs["identifier"] = self, f"{full_host}/{i}"
                    kwargs["environment"] = {**kwargs.get("environment", {}), SLOT: str(started)}
                    el = self.launchers[kwargs["identifier"]] = self.launcher_class(**kwargs)
                    if i > 0:
                        el.to_send = []  # the host's first engine sends the connection files
                    el.loop  # noqa: B018 - the IO loop is read here, on the kernel's thread, not in a worker
                    el.on_stop(self._notice_engine_stopped)
                    group.append((el, user, host, port))
                    started += 1
                if group:
                    per_host.append(group)
                if started >= n:
                    break

            def start_one(el, user, host, port):
                return lambda: el.start(user=user, hostname=host, port=port)

            _run_all([start_one(*g[0]) for g in per_host], len(per_host))  # each host's files first
            rest = [start_one(*e) for g in per_host for e in g[1:]]
            _run_all(rest, PER_HOST * len(per_host))
            dlist = [el.identifier for g in per_host for el, *_ in g]
            self.notify_start(dlist)
            self.n = started
            return dlist

        def signal(self, sig):
            launchers = list(self.launchers.values())
            _run_all([lambda el=el: el.signal(sig) for el in launchers], PER_HOST * max(1, len(self.engines)))

    for cls in (ConcurrentSSHEngineLauncher, ConcurrentSSHEngineSetLauncher):
        cls.__module__ = __name__
    return ConcurrentSSHEngineLauncher, ConcurrentSSHEngineSetLauncher


__getattr__ = built_on_first_use(globals(), ("ConcurrentSSHEngineLauncher", "ConcurrentSSHEngineSetLauncher"),
                                 _launcher_classes)
