"""Local engines forked from one process that has imported torch already (a fork server).

A local ipyparallel engine started the usual way is a fresh interpreter that imports torch, ipyparallel and
colab_kit's remote part before it registers (and its nanny is one more): about 4 s of CPU each, so on a
2-core Intel Xeon VM ipyparallel starts 4 engines in 10.1 s and restarts them in 12.1 s; forked, 2.4 s (the
median of three starts; the first of the run also starts the server) and 1.5 s
(``python bench/cluster.py``; bench/results/cluster.json).
``ForkedEngineSetLauncher`` is ipyparallel's local launcher with one change: each engine is forked from a server process
that imported those modules once (the server's own code: ``forked_server.py``).
The server is started by ``%load_ext colab_kit`` (``prestart``), or else by the first cluster of a kernel, and
serves every later start and restart.

What each process is, for ``Cluster(4)`` in a notebook kernel::

    kernel ── fork server (python -c '...forked_server import serve; serve()': torch imported, no thread started)
           │      ├── engine 0   (forked: ipyparallel.engine's main, its own session, output to its log)
           │      │      └── nanny (ipyparallel's KernelNanny: forked by the engine before its first thread)
           │      ├── engine 1 ...
           ├── controller (python -m ipyparallel.controller)
           └── watchdog

An engine is the same program as before: ``ipyparallel.engine``'s ``main`` with the launcher's arguments,
environment, working directory and log file. The launcher signals and waits on it by pid (psutil), as
ipyparallel does for any process it started. The server reaps its children at once, so an engine that
died is gone from the process table (no zombie for ``wait`` to mistake as alive); its exit code is then
not known to the launcher (``None``), but the server writes it to a file the kernel reads (``exit_code``), so a
rank whose engine died is reported with how it ended ("killed by SIGKILL", ``how_it_ended``); what it printed
is in its log file as before. It exits when its
standard input closes, which is when the kernel that started it exits, however it ended (a SIGKILLed kernel
included); the watchdog (``watchdog.py``) ends the engines themselves. It runs in a session of its own, so
the signals ipykernel sends its process group (SIGINT on an interrupt, SIGTERM at shutdown) do not reach it,
and a kernel shuts down in 0.4 s as without a cluster, not 2.6 s.

``Cluster(engines="local")`` (the default) uses it, unless a profile gives the engines a command of its own
(``EngineLauncher.engine_cmd``). The server's imports are those of when it started: a kernel whose colab_kit
or torch was reinstalled or edited since should be restarted (or the server ended: ``forked.fork_server().close()``,
and the next start makes a new one). Engines start the usual way with
``COLAB_KIT_FORK_ENGINES=0`` in the environment, or with ipyparallel's class named:
``Cluster(engines="ipyparallel.cluster.launcher.LocalEngineSetLauncher")``.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from ...launch.warm import register_forker
from .watchdog import has_ended
from .forked_server import WARM_MODULES  # what the server imports (its own code is in forked_server.py)

# and ForkedEngineSetLauncher
__all__ = ["ForkServer", "fork_server", "prestart", "forking", "server_pid", "exit_code", "how_it_ended",
           "WARM_MODULES"]


class ForkServer:
    """The server process, seen from the kernel: ``fork(argv, env, cwd, log)`` returns the new engine's pid."""

    def __init__(self, command: list[str] | None = None, exits: str | None = None):
        """This machine's server by default; ``command`` runs one elsewhere (``ssh_forked.RemoteForkServer``:
        ``ssh host python -c SERVE <exits>``), whose directory of exit statuses ``exits`` is on that host."""
        # a session of its own: out of the kernel's process group, which ipykernel signals on an interrupt
        # (SIGINT would end the server during its imports) and at shutdown, where it waits for every child in
        # its group to be gone; this one, signalled but not reaped until the kernel's own exit, stayed listed
        # as a zombie, and the kernel waited until Jupyter gave up on it and sent SIGTERM (2.5 s, atexit skipped)
        # the server writes each child's exit status into ``exits``
        self.local = exits is None  # the directory is this machine's (a remote server removes its own)
        self.exits = exits if exits is not None else tempfile.mkdtemp(prefix="colab_kit-exits-")
        self.forked: set[int] = set()
        self.host: str | None = None  # the server's hostname, from its first line
        self.proc = subprocess.Popen(command or [sys.executable, "-c", SERVE, self.exits], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fork(self, argv: list[str], env: dict, cwd: str | None, log: str, timeout: float = 120.0,
             merge_env: bool = False) -> int:
        """Ask for one engine; its pid. ``merge_env``: ``env`` is set over the server's own environment (an
        empty value unsets), else it is the whole environment; ``cwd`` None: the server's directory.

        The server says it is ready once its imports are done, and no request is written before: a server that
        is not ready within ``timeout`` (its imports hung) has been asked nothing, and is ended (``abandon``); a
        ready one forks at once, so its reply has ``REPLY_SECONDS``. Lines that are no reply (what a login shell
        prints over ssh) are skipped. A request cut short (Ctrl-C) or a reply that does not come also end the
        server, so that no later request reads an earlier reply; the next ``fork_server()`` starts a new one."""
        request = dict(argv=argv, env=env, cwd=cwd, log=log, **({"merge_env": True} if merge_env else {}))
        return self._ask(request, timeout, "an engine")

    def call(self, target: str, args: list, log: str, timeout: float = 120.0) -> int:
        """Fork a child that runs ``target`` (``"module:function"``) on ``args`` with this kernel's environment
        and directory, its output appended to ``log``, and exits (``launch.warm.fork_call``); its pid. Its exit
        code is ``exit_code(pid)``'s once it ends."""
        request = dict(call=target, args=list(args), env=dict(os.environ), cwd=os.getcwd(), log=log)
        return self._ask(request, timeout, f"a child for {target}")

    def _ask(self, request: dict, timeout: float, what: str) -> int:
        stdin = self.proc.stdin
        assert stdin is not None  # a pipe (subprocess.PIPE)
        with self._lock:
            try:
                self._wait_ready(timeout)
                stdin.write(json.dumps(request) + "\n")
                stdin.flush()
                reply = self._reply(REPLY_SECONDS, f"forked {what}")
            except BaseException:
                self.abandon()
                raise
        if "error" in reply:
            raise RuntimeError(f"colab_kit's engine fork server could not fork {what}: {reply['error']}")
        self.forked.add(int(reply["pid"]))
        return int(reply["pid"])

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Return once the server has finished its imports (at once when it said so before): what it holds in
        memory then is all it will hold (``Cluster(fit=True)`` counts it). A server not ready within ``timeout``
        is ended, as in ``fork``."""
        with self._lock:
            try:
                self._wait_ready(timeout)
            except BaseException:
                self.abandon()
                raise

    def _wait_ready(self, timeout: float) -> None:
        if not self.ready:
            hello = self._reply(timeout, "got ready")
            self.ready, self.host = True, hello.get("host", self.host)

    ready = False
    """Whether the server said it finished its imports (its first line)."""
    _buf = b""

    def _reply(self, timeout: float, what: str) -> dict:
        """The server's next reply (a JSON object of ``ready``, ``pid`` or ``error``), within ``timeout`` s."""
        import select
        import time

        assert self.proc.stdout is not None  # a pipe (subprocess.PIPE)
        fd, end = self.proc.stdout.fileno(), time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                try:
                    reply = json.loads(line)
                except ValueError:
                    continue  # not the server's (a login shell's banner over ssh)
                if isinstance(reply, dict) and reply.keys() & {"ready", "pid", "error"}:
                    return reply
            left = end - time.monotonic()
            ready = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                raise TimeoutError(f"colab_kit's engine fork server (pid {self.pid}) has not {what} within "
                                   f"{timeout:g} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"colab_kit's engine fork server (pid {self.pid}) exited with code "
                                   f"{self.proc.wait()} before it {what}")
            self._buf += chunk

    def abandon(self) -> None:
        """End the server now (its replies can no longer be trusted to match the requests)."""
        self.proc.kill()
        self.proc.wait()

    def exit_code(self, pid: int, wait: float = 2.0) -> int | None:
        """How engine ``pid`` ended, as ``Popen.returncode`` says it (``-9``: killed by SIGKILL), once the server
        has reaped it (waiting up to ``wait`` seconds); None for a pid it did not fork or one still running."""
        import time

        if pid not in self.forked:
            return None
        path, end = os.path.join(self.exits, str(pid)), time.monotonic() + wait
        while True:
            try:
                with open(path, encoding="ascii") as fh:
                    return int(fh.read())
            except (OSError, ValueError):
                pass
            if _running(pid):  # still running (the controller dropped a live engine): nothing to wait for
                return None
            if time.monotonic() >= end:
                return None
            time.sleep(0.05)

    def close(self) -> None:
        """End the server (end of input); engines it forked keep running."""
        if self.alive:
            assert self.proc.stdin is not None  # a pipe (subprocess.PIPE)
            self.proc.stdin.close()  # the server exits on end of input
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.local:
            shutil.rmtree(self.exits, ignore_errors=True)


REPLY_SECONDS = 30.0
"""How long a ready server has to answer a request (a fork: milliseconds)."""

SERVE = "from colab_kit.notebook.cluster.forked_server import serve; serve()"
"""The server's program (``python -c SERVE <exits directory>``)."""


def forking(engines) -> bool:
    """Whether ``Cluster(engines=...)`` forks its engines: for ipyparallel's "local" on a system with ``fork``,
    unless ``COLAB_KIT_FORK_ENGINES=0``."""
    return engines == "local" and hasattr(os, "fork") and os.environ.get("COLAB_KIT_FORK_ENGINES", "1") != "0"


_SERVER: ForkServer | None = None
_SERVER_LOCK = threading.Lock()


def fork_server() -> ForkServer:
    """This kernel's fork server, started on first use (its imports run while the controller starts)."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or not _SERVER.alive:
            if _SERVER is None:
                atexit.register(_close_server)
            else:
                _SERVER.close()  # the dead one's pipes and its directory of exit statuses
            _SERVER = ForkServer()
        return _SERVER


def prestart() -> None:
    """Start this kernel's fork server now (``%load_ext colab_kit`` does, before it imports the magics), so that
    its imports (torch, DTensor, the engine's parts: 3.9 s to ready here) run while the notebook's next cells do,
    not inside ``%colossal start``. Worked example, Run All on 2 cores: the server imports on one core while the
    kernel imports the magics and runs the cells up to ``%colossal start -n 4`` on the other; the start then
    forks 4 engines from a server that is ready, or nearly. Nothing where engines are not forked
    (``COLAB_KIT_FORK_ENGINES=0``, or no ``fork``). A kernel that starts no local cluster keeps an idle server of
    about 310 MiB until it exits (``fork_server().close()`` ends it sooner), which ``Cluster(fit=True)``
    counts as memory in use."""
    if forking("local"):
        try:
            fork_server()
        except OSError:  # no process to spare now: %colossal start tries again, and says why
            pass


class _Child:
    """A child ``ForkServer.call`` forked, as ``launch.warm.Forked``: its exit code from the server's file."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid = server, pid

    def wait(self, timeout: float) -> int | None:
        """Its exit code within ``timeout`` s, else None; -1 when it ended and the server that would have said how
        is gone (killed with it, say)."""
        import time

        end, delay = time.monotonic() + timeout, 0.005
        while True:
            code = self.server.exit_code(self.pid, wait=0)
            if code is not None:
                return code
            if not self.server.alive and not _running(self.pid):
                return -1
            left = end - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(delay, left))
            delay = min(2 * delay, 0.05)

    def kill(self) -> None:
        """SIGKILL, then wait (up to 5 s) until the server has reaped it, as ``multiprocessing``'s kill and join."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.wait(5.0)


def _running(pid: int) -> bool:
    import psutil

    try:
        return not has_ended(psutil.Process(pid))
    except psutil.Error:  # gone already
        return False


def _fork_call(target: str, args: list, log: str) -> _Child | None:
    """``launch.warm``'s forker: this kernel's fork server, where one runs (``%load_ext colab_kit`` starts it)."""
    server = _SERVER
    if server is None or not server.alive:
        return None
    return _Child(server, server.call(target, args, log))


register_forker(_fork_call)


def _close_server() -> None:
    if _SERVER is not None:
        _SERVER.close()


def exit_code(pid: int, wait: float = 2.0) -> int | None:
    """How an engine this kernel's fork server forked ended (``ForkServer.exit_code``); None for any other pid."""
    server = _SERVER
    return server.exit_code(pid, wait) if server is not None else None


def how_it_ended(code: int | None) -> str:
    """A phrase for an engine's exit code, to follow "died": what the code means and where to look.

    >>> how_it_ended(-9)
    'killed by SIGKILL (the out-of-memory killer sends it when memory runs out: `dmesg` says so; or a kill -9)'
    >>> how_it_ended(3)
    'exited with code 3 (os._exit or sys.exit in the code it ran, or the interpreter gave up)'
    """
    if code is None:
        return "killed, crashed or out of memory"
    if code == 0:  # ipyparallel's own SIGTERM handler ends the engine's loop: a clean exit
        return "exited with code 0: told to stop (SIGTERM, ipyparallel's shutdown) or sys.exit(0) in the code it ran"
    if code > 0:
        return f"exited with code {code} (os._exit or sys.exit in the code it ran, or the interpreter gave up)"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"ended by signal {-code}"
    why = {"SIGKILL": "the out-of-memory killer sends it when memory runs out: `dmesg` says so; or a kill -9",
           "SIGSEGV": "a crash in native code: torch, a C extension, or memory corrupted",
           "SIGBUS": "a crash in native code, or shared memory (/dev/shm) that ran out",
           "SIGABRT": "native code gave up: a failed check or std::terminate; the engine's log has its last words",
           "SIGTERM": "someone asked it to stop"}.get(name)
    return f"killed by {name}" + (f" ({why})" if why else "")


def server_pid() -> int | None:
    """The pid of this kernel's fork server while it runs (its children are the forked engines), else None."""
    server = _SERVER
    return server.pid if server is not None and server.alive else None


def _launcher_classes():
    from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher, ProcessStateError

    class ForkedEngineLauncher(LocalEngineLauncher):
        """One engine, forked from the fork server instead of started as a new interpreter."""

        def start(self):
            import psutil

            if list(self.engine_cmd) != [sys.executable, "-m", "ipyparallel.engine"]:
                return super().start()  # a command of the user's (another interpreter, a wrapper): run as asked
            if self.state != "before":
                raise ProcessStateError(f"The process was already started and has state: {self.state}")
            env = os.environ.copy()
            env.update(self.get_env())
            argv = list(self.args[len(self.engine_cmd):])  # the engine's own arguments, after ``-m ipyparallel.engine``
            cwd = os.path.abspath(self.work_dir)  # the kernel's directory now (after a %cd), not the server's
            self.pid = fork_server().fork(argv, env, cwd, self.output_file)
            try:
                self.process = psutil.Process(self.pid)
            except psutil.NoSuchProcess:  # it ended at once and the server reaped it: say so as a stop
                self.notify_start(self.pid)
                self.notify_stop(dict(exit_code=None, pid=self.pid, identifier=self.identifier))
                return
            self.notify_start(self.pid)
            self._start_waiting()

    class ForkedEngineSetLauncher(LocalEngineSetLauncher):
        """ipyparallel's local engine set, each engine forked from colab_kit's fork server."""

        launcher_class = ForkedEngineLauncher
        entrypoint_name = f"{__name__}.ForkedEngineSetLauncher"  # how ipyparallel's cluster file names it

    ForkedEngineLauncher.__module__ = ForkedEngineSetLauncher.__module__ = __name__
    return ForkedEngineLauncher, ForkedEngineSetLauncher


def built_on_first_use(scope: dict, names: tuple[str, ...], build):
    """A module ``__getattr__``: the classes ``names`` (launchers, which import ipyparallel), made by ``build()``
    the first time one of them is asked for and kept in ``scope`` (the module's globals) from then on."""
    def __getattr__(name):
        if name not in names:
            raise AttributeError(name)
        scope.update(zip(names, build()))
        return scope[name]
    return __getattr__


__getattr__ = built_on_first_use(globals(), ("ForkedEngineLauncher", "ForkedEngineSetLauncher"), _launcher_classes)
