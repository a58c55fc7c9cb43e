"""Engines over SSH, started, signalled and stopped host by host at once instead of one after another.

ipyparallel's ``SSHEngineSetLauncher`` starts its engines one at a time, and each start is several ssh
round trips, each a remote Python (the shell's kind, Python's presence, ``IPython profile create``, the
connection files, the engine); its ``signal`` goes engine by engine, and its stop, for every engine in turn,
waits with a remote Python that imports ipyparallel and fetches the engine's log in three more calls. On 8
hosts of 8 GPUs that is 64 engines in a row, where the hosts could all be working. (``pytest -s
tests/cluster/test_two_hosts.py -k ssh`` prints the seconds a start, a restart and a stop take.)

``ConcurrentSSHEngineSetLauncher`` is that launcher with the work reordered: per host, the first engine
starts first (it checks the shell and Python, makes the profile and sends the connection files, which the
host's other engines read), then the host's other engines start together, and every host does so at the same
time. Each engine is forked by the host's fork server (``ssh_forked.py``: one process per host that imported
torch once, kept by the kernel for later starts) where the login shell is POSIX, else started with one ssh
call of its own. A restart sends nothing again (the same files to the same host). Signals and stops go to
every engine at once; on a POSIX shell a signal is ``kill``, the connection files go in one ``mkdir -p`` and
one ``scp``, and an engine is waited on with ``kill -0``, its exit status and log read in the same call. At
most ``PER_HOST`` ssh sessions open at once on one host: sshd's default ``MaxStartups 10:30:100`` starts
refusing new connections at random beyond 10 unauthenticated ones. ``Cluster(engines="ssh")`` uses it;
``engines="ipyparallel.cluster.launcher.SSHEngineSetLauncher"`` gives ipyparallel's own.

Worked example, ``hosts={"a": 2, "b": 2}``::

    round 1   a/0 (sends the files)    b/0 (sends the files)       both hosts at once, each host's fork
    round 2   a/1 (forked only)        b/1 (forked only)           server importing torch meanwhile
    ranks     0, 1 on a; 2, 3 on b     (by each engine's ``SLOT``, whichever registered first)
"""
from __future__ import annotations

import asyncio
import os
import posixpath
import shlex
import time
from subprocess import check_output
from concurrent.futures import ThreadPoolExecutor

from . import ssh_forked
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


POSIX_SHELLS = {"sh", "bash", "dash", "zsh", "ksh", "ash"}
"""Remote login shells whose engines are waited on with ``_WAIT`` (others: ipyparallel's remote Python)."""

# one ssh call: poll the engine every 0.1 s up to ``polls`` times; ipyparallel's markers, its parser's format
# (a ``sleep`` without fractions sleeps 1 s instead of spinning)
_WAIT = ("i=0; while kill -0 {pid} 2>/dev/null; do i=$((i+1)); if [ $i -ge {polls} ]; then "
         "echo __process_running=1__; exit 0; fi; sleep 0.1 2>/dev/null || sleep 1; done; "
         "echo __process_running=0__")


STARTUP_VARS = frozenset({"PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONUSERBASE",
                          "LD_LIBRARY_PATH", "LD_PRELOAD", "OMP_NUM_THREADS", "MKL_NUM_THREADS"})
"""Environment variables an interpreter (or torch) reads as it starts: an engine whose environment sets one is
started as a new interpreter, not forked from a server that started without it."""

_SENT: set[tuple] = set()  # hosts that have a profile and these connection files from this kernel


def _sent_key(ssh: list[str], profile: str, to_send) -> tuple | None:
    """What a host's first engine made and sent there (the ssh command, the remote profile, each remote file
    with the local file's bytes), or None where a local file cannot be read. A restart sends the same files to
    the same host: the key says it is done already."""
    import hashlib

    try:
        files = tuple((remote, hashlib.sha256(open(local, "rb").read()).hexdigest()) for local, remote in to_send)
    except OSError:
        return None
    return tuple(ssh), profile, files


_LOG = "__colab_kit_engine_log__"  # in a wait's output: the ended engine's log follows


def _run_all(calls, workers: int) -> None:
    """Run ``calls`` (no-argument functions) on ``workers`` threads; raise the first failure after all ended.
    At the interpreter's exit (ipyparallel stops its clusters from an atexit hook, where no new thread may
    start) they run one after another here."""
    if not calls:
        return
    try:
        with ThreadPoolExecutor(max(1, min(workers, len(calls)))) as pool:
            futures = [pool.submit(c) for c in calls]
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        errors = []
        for c in calls:
            try:
                c()
            except Exception as e:  # noqa: BLE001 - every call is made; the first failure is raised
                errors.append(e)
        if errors:
            raise errors[0] from None
        return
    for f in futures:
        error = f.exception()
        if error is not None:
            raise error


def _per_host(groups: list[list], workers: int = PER_HOST) -> None:
    """Each group (one host's calls) on ``workers`` threads of its own, every host at once: at most
    ``workers`` ssh sessions open on a host whatever the other hosts run."""
    _run_all([lambda g=g: _run_all(g, workers) for g in groups if g], len(groups))


async def _in_thread(fn, *args):
    """``fn(*args)`` off the event loop; inline where no thread may start (the interpreter's exit)."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    except RuntimeError as e:
        if "shutdown" not in str(e):
            raise
        return fn(*args)


def _launcher_classes():
    from signal import SIGKILL, SIGTERM

    from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher

    class ConcurrentSSHEngineLauncher(SSHEngineLauncher):
        """One engine over SSH. A host's later engines reuse its first engine's ssh sender (its shell is known,
        the profile made, the files sent: only the engine's own start goes over ssh); waiting on an engine
        polls ``kill -0`` in the remote POSIX shell (ipyparallel's wait starts a remote Python that imports
        ipyparallel each time) and its log comes back in one call; its stop sends SIGTERM from a thread, so
        that the set's stops overlap."""

        host_first = None  # the launcher of this host's first engine, for the host's later ones
        server = None  # the host's fork server (``ssh_forked``); None: engines start as new interpreters
        forked_by = None  # the server that forked this engine, if one did
        pid: int  # ipyparallel's trait (the engine's pid on its host), declared for the type checker only
        hostname: str  # ipyparallel's traits, likewise
        user: str
        _output: str | None  # ipyparallel's cache of the engine's log (None: not fetched yet), likewise

        def start(self, hostname=None, user=None, port=None):
            first = self.host_first
            if first is None and not ssh_forked.forking(self.engine_cmd, self.remote_python):
                return super().start(hostname=hostname, user=user, port=port)
            if first is None:
                self._prepare(hostname, user, port)
            else:
                self.hostname, self.user = hostname if hostname is not None else self.hostname, user or self.user
                self._ssh_sender = first.ssh_sender  # the same host, user, port and arguments; set up once
                self.server = first.server
            self.pid = self._launch()
            self.notify_start({"host": self.location, "pid": self.pid})
            self._start_waiting()
            self.fetch_files()

        def _prepare(self, hostname, user, port):
            """A host's first engine: ipyparallel's checks, profile and connection files (its ``start`` up to
            the engine's own start), with the host's fork server started after the shell check, so that its
            imports run during the rest."""
            if hostname is not None:
                self.hostname = hostname
            if user is not None:
                self.user = user
            if port is not None:
                if "-p" not in self.ssh_args:
                    self.ssh_args.extend(["-p", str(port)])
                if "-P" not in self.scp_args:
                    self.scp_args.extend(["-P", str(port)])
            self.ssh_sender.get_shell_info()
            ssh = [*self.ssh_cmd, *self.ssh_args, self.location]
            if self._posix():
                self.server = ssh_forked.remote_fork_server(ssh, self.remote_python)
            sent = _sent_key(ssh, self.remote_profile_dir, self.to_send)
            if sent is not None and sent in _SENT and self._still_there():  # a restart: the same files are there
                return
            self.ssh_sender.has_python()
            self.ssh_sender.check_output_python_module(
                ["IPython", "profile", "create", "--profile-dir", self.remote_profile_dir])
            self.send_files()
            if sent is not None:
                _SENT.add(sent)

        def _still_there(self) -> bool:
            """Whether the host still has the connection files and the log directory (one ssh call): a host
            rebooted or wiped since the first start gets them again."""
            paths = [posixpath.dirname(self.remote_output_file), *(r for _, r in self.to_send)]
            test = " && ".join(f"test -e {shlex.quote(p)}" for p in paths if p)
            try:
                return "__there__" in self.ssh_sender.check_output(f"{test} && echo __there__; true",
                                                                   universal_newlines=True)
            except Exception:  # noqa: BLE001 - not known: send them again
                return False

        def _launch(self) -> int:
            """The engine's pid on its host: forked by the host's server, else started by ipyparallel's way (also
            where the engine's environment sets what an interpreter reads as it starts, ``STARTUP_VARS``: a
            forked engine would not see it)."""
            env = self.get_env()
            if self.server is not None and STARTUP_VARS & {k for k, v in env.items() if v not in (None, "")}:
                self.log.info(f"{self.location}: the engine's environment sets "
                              f"{sorted(STARTUP_VARS & set(env))}: it starts as a new interpreter")
            elif self.server is not None:
                try:
                    pid = self.server.fork(list(self.program_args), env, None, self.remote_output_file,
                                           merge_env=True)
                    self.forked_by = self.server
                    return pid
                except Exception as e:  # noqa: BLE001 - the usual start still works: said, not raised
                    self.log.warning(f"{self.location}: colab_kit's fork server did not fork an engine ({e}); "
                                     "it starts as a new interpreter")
            return self.ssh_sender.cmd_start(self.program + self.program_args, env=env,
                                             output_file=self.remote_output_file)

        def send_files(self):
            """The connection files in two calls on a POSIX shell: one ``mkdir -p`` of their directories, one
            ``scp`` per directory (ipyparallel checks each directory with a remote Python, then copies each file
            on its own)."""
            if not self.to_send or not self._posix():
                return super().send_files()
            for _ in range(10):  # as ipyparallel's: the controller may still be writing them
                if all(os.path.exists(local) for local, _ in self.to_send):
                    break
                time.sleep(1)
            dirs: dict[str, list[str]] = {}
            for local, remote in self.to_send:
                remote = remote.replace(os.path.sep, "/")
                if os.path.basename(local) != posixpath.basename(remote):
                    return super().send_files()  # renamed on the way: a copy each, ipyparallel's way
                dirs.setdefault(posixpath.dirname(remote), []).append(local)
            if any(dirs):
                self.ssh_sender.check_output("mkdir -p " + " ".join(shlex.quote(d) for d in dirs if d),
                                             universal_newlines=True)
            for remote_dir, locals_ in dirs.items():
                check_output([*self.scp_cmd, *self.scp_args, *locals_, f"{self.location}:{remote_dir or '.'}/"])

        def signal(self, sig):
            """``kill -SIG pid`` in a POSIX remote shell (ipyparallel's starts a remote Python for it)."""
            if self.state != "running":
                return
            if not self._posix():
                return super().signal(sig)
            self.ssh_sender.check_output(f"kill -{int(sig)} {int(self.pid)}", universal_newlines=True)

        def _posix(self) -> bool:
            return os.path.basename(self.ssh_sender.get_shell_info()[1] or "") in POSIX_SHELLS

        @property
        def started(self) -> bool:
            """Whether this engine was started (a host whose first engine failed leaves its others unstarted:
            nothing of theirs is asked over ssh)."""
            return int(self.pid) > 0

        def _read_log(self, remove: bool) -> str:
            """Shell that prints the engine's remote log (and removes it with ``remove``)."""
            path = shlex.quote(self.remote_output_file)
            return f"cat {path} 2>/dev/null" + (f"; rm -f {path}" if remove else "")

        def get_output(self, remove=False):
            """The engine's remote log in one ssh call (``cat``, then ``rm`` if ``remove``): ipyparallel's polls
            for the file, copies it with scp and removes it, three calls per engine, one engine after another,
            as each stop is noticed."""
            if self._output is None and not self.started:
                self._output = ""
            if self._output is not None:
                return self._output
            try:
                if not self._posix():
                    return super().get_output(remove=remove)
                self._output = self.ssh_sender.check_output(self._read_log(remove), universal_newlines=True)
            except Exception as e:  # noqa: BLE001 - as ipyparallel's: the output is a hint only
                self.log.error(f"Failed to get output file {self.remote_output_file}: {e}")
                self._output = ""
            return self._output

        def wait_one(self, timeout):
            if not self.started:  # nothing to wait for (and ``kill -0 -1`` would ask about every process)
                return -1
            if not self._posix():
                return super().wait_one(timeout)
            polls = max(1, int(10 * (timeout if timeout is not None else 1e9)))
            script = _WAIT.format(pid=int(self.pid), polls=polls)
            if self.forked_by is not None and self.forked_by.alive:  # then how it ended, as its server wrote it
                script += "; " + self.forked_by.exit_script(int(self.pid))
            if self._output is None:  # and its log, read and removed (ipyparallel does so as it notices the end)
                script += f"; echo {_LOG}; {self._read_log(remove=True)}"
            out, _, log = self.ssh_sender.check_output(script, universal_newlines=True).partition(_LOG + "\n")
            if "__process_running=" not in out:
                raise RuntimeError(out)
            if "__process_running=1__" in out:
                raise TimeoutError("still running")
            if _LOG in script and self._output is None:
                self._output = log
            code = ssh_forked.parse_exit(out)
            # as ipyparallel's when not forked: the engine is not the waiting shell's child, its code is not known
            return -1 if code is None else code

        async def stop(self):
            if not self.started:
                return
            try:
                await _in_thread(self.signal, SIGTERM)
            except Exception as e:  # noqa: BLE001 - as ipyparallel's stop: an engine gone already
                self.log.debug(f"TERM failed: {e!r}")
            try:
                await self.join(timeout=self.stop_seconds_until_kill)
                return
            except TimeoutError:
                self.log.warning(f"Process {self.pid} did not exit in {self.stop_seconds_until_kill} s after TERM")
            try:
                await _in_thread(self.signal, SIGKILL)
            except Exception as e:  # noqa: BLE001 - gone between the TERM's wait and the KILL
                self.log.debug(f"KILL failed: {e!r}")
            await self.join(timeout=self.stop_timeout)

    class ConcurrentSSHEngineSetLauncher(SSHEngineSetLauncher):
        """ipyparallel's SSH engine set, every host's engines started at once (see the module docstring)."""

        launcher_class = ConcurrentSSHEngineLauncher
        entrypoint_name = f"{__name__}.ConcurrentSSHEngineSetLauncher"  # how ipyparallel's cluster file names it

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
                group: list = []
                for i in range(min(count, n - started)):
                    kwargs = {attr: getattr(self, attr) for attr in inherited}
                    kwargs.update(overrides)
                    for args in ("ssh_args", "scp_args"):  # each engine's own: a first engine appends its port
                        kwargs[args] = list(kwargs.get(args, getattr(self, args)))
                    kwargs["parent"], kwargs["identifier"] = self, f"{full_host}/{i}"
                    kwargs["environment"] = {**kwargs.get("environment", {}), SLOT: str(started)}
                    el = self.launchers[kwargs["identifier"]] = self.launcher_class(**kwargs)
                    # its own log file: the default is named by the time, read by engines starting at once
                    base, ext = os.path.splitext(el.remote_output_file)
                    el.remote_output_file = f"{base}-{self.cluster_id or 'ck'}-{started}{ext}"
                    if i > 0:
                        el.to_send = []  # the host's first engine sends the connection files
                        el.host_first = group[0][0]
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
            _per_host([[start_one(*e) for e in g[1:]] for g in per_host])
            dlist = [el.identifier for g in per_host for el, *_ in g]
            self.notify_start(dlist)
            self.n = started
            return dlist

        def signal(self, sig):
            hosts: dict = {}
            for el in self.launchers.values():
                hosts.setdefault(el.location, []).append(lambda el=el: el.signal(sig))
            _per_host(list(hosts.values()))

    for cls in (ConcurrentSSHEngineLauncher, ConcurrentSSHEngineSetLauncher):
        cls.__module__ = __name__
    return ConcurrentSSHEngineLauncher, ConcurrentSSHEngineSetLauncher


__getattr__ = built_on_first_use(globals(), ("ConcurrentSSHEngineLauncher", "ConcurrentSSHEngineSetLauncher"),
                                 _launcher_classes)
