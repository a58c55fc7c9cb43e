"""Local engines forked from one process that has imported torch already (a fork server).

A local ipyparallel engine started the usual way is a fresh interpreter that imports torch, ipyparallel and
colab_kit's remote part before it registers (and its nanny is one more): about 4 s of CPU each, so on a
2-core Intel Xeon VM ipyparallel starts 4 engines in 8.4 s and restarts them in 9.0 s; forked, 1.6 s (2.2 s
for the first start of a kernel, which starts the server) and 1.5 s (``python bench/cluster.py``;
bench/results/cluster.json).
``ForkedEngineSetLauncher`` is ipyparallel's local launcher with one change: each engine is forked from a server process that imported those modules once.
The server is started by the first cluster of a kernel and serves every later start and restart.

What each process is, for ``Cluster(4)`` in a notebook kernel::

    kernel ── fork server (python -c '...forked import serve; serve()': torch imported, no thread started)
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

__all__ = ["ForkServer", "fork_server", "forking", "server_pid", "exit_code", "how_it_ended", "WARM_MODULES"]  # and ForkedEngineSetLauncher

WARM_MODULES = ("torch", "torch.distributed", "ipyparallel.engine.app", "ipyparallel.engine.nanny",
                "colab_kit.notebook.cluster.remote")
"""What the server imports before it forks: what an engine's start-up would import itself."""


class ForkServer:
    """The server process, seen from the kernel: ``fork(argv, env, cwd, log)`` returns the new engine's pid."""

    def __init__(self):
        # a session of its own: out of the kernel's process group, which ipykernel signals on an interrupt
        # (SIGINT would end the server during its imports) and at shutdown, where it waits for every child in
        # its group to be gone; this one, signalled but not reaped until the kernel's own exit, stayed listed
        # as a zombie, and the kernel waited until Jupyter gave up on it and sent SIGTERM (2.5 s, atexit skipped)
        self.exits = tempfile.mkdtemp(prefix="colab_kit-exits-")  # the server writes each child's exit status here
        self.forked: set[int] = set()
        self.proc = subprocess.Popen([sys.executable, "-c", "from colab_kit.notebook.cluster.forked import serve; serve()",
                                      self.exits], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     start_new_session=True)
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fork(self, argv: list[str], env: dict, cwd: str, log: str, timeout: float = 120.0) -> int:
        """Ask for one engine; its pid. A server that does not answer within ``timeout`` (its imports hung), or a
        request cut short (Ctrl-C), ends the server, so that no later request reads an earlier reply; the next
        ``fork_server()`` starts a new one."""
        import select

        with self._lock:
            try:
                self.proc.stdin.write(json.dumps(dict(argv=argv, env=env, cwd=cwd, log=log)) + "\n")
                self.proc.stdin.flush()
                ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
                if not ready:
                    raise TimeoutError(f"colab_kit's engine fork server (pid {self.pid}) did not fork an engine "
                                       f"within {timeout:g} s")
                line = self.proc.stdout.readline()
            except BaseException:
                self.proc.kill()
                self.proc.wait()
                raise
        if not line:
            raise RuntimeError(f"colab_kit's engine fork server (pid {self.pid}) exited with code "
                               f"{self.proc.wait()} before it forked an engine")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"colab_kit's engine fork server could not fork an engine: {reply['error']}")
        self.forked.add(int(reply["pid"]))
        return int(reply["pid"])

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
                if time.monotonic() >= end:
                    return None
                time.sleep(0.05)

    def close(self) -> None:
        """End the server (end of input); engines it forked keep running."""
        if self.alive:
            self.proc.stdin.close()  # the server exits on end of input
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.exits, ignore_errors=True)


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
            _SERVER = ForkServer()
        return _SERVER


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
    if code >= 0:
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

    ForkedEngineLauncher.__module__ = ForkedEngineSetLauncher.__module__ = __name__
    return ForkedEngineLauncher, ForkedEngineSetLauncher


def __getattr__(name):  # the launcher classes import ipyparallel: built when first asked for
    if name in ("ForkedEngineLauncher", "ForkedEngineSetLauncher"):
        classes = dict(zip(("ForkedEngineLauncher", "ForkedEngineSetLauncher"), _launcher_classes()))
        globals().update(classes)
        return classes[name]
    raise AttributeError(name)


# ----------------------------------------------------------------------------------------- the server itself
_EXITS: list[str] = []  # in the server: the directory its kernel reads exit statuses from


def _reap(signum, frame) -> None:
    """Reap every child that ended, writing its exit code (``Popen.returncode``'s convention) to ``<exits>/<pid>``."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if _EXITS:
            try:
                path = os.path.join(_EXITS[0], str(pid))
                with open(path + ".tmp", "w", encoding="ascii") as fh:
                    fh.write(str(os.waitstatus_to_exitcode(status)))
                os.replace(path + ".tmp", path)
            except (OSError, ValueError):  # the kernel removed the directory, or an odd status: nobody asks
                pass


class _Nanny:
    """What the engine keeps of its nanny (ipyparallel keeps the Popen): the pipe whose closing, when the engine
    exits, tells the nanny so."""

    def __init__(self, pid: int, pipe):
        self.pid, self.pipe = pid, pipe


def _prefork_nanny():
    """Fork this engine's nanny now, while the process has no thread, and return the ``start_nanny`` that hands it
    its arguments. ipyparallel starts the nanny as a new interpreter (``python -m ipyparallel.engine.nanny``, about
    0.7 s of CPU for its imports); forked here it has them already. The protocol is ipyparallel's: the engine
    writes the pickled arguments, the nanny answers the URL of its relay socket on a line and then watches that
    pipe, whose closing means the engine has exited. A nanny whose engine never asks (``enable_nanny=False``)
    reads end of input when the engine exits, and exits too."""
    import pickle

    args_r, args_w = os.pipe()
    url_r, url_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the nanny
        os.close(args_w)
        os.close(url_r)
        code = 0
        try:
            os.setsid()  # as ipyparallel's Popen(start_new_session=True): the engine's signals are not ours
            with os.fdopen(args_r, "rb") as fh:
                try:
                    kwargs = pickle.load(fh)
                except EOFError:
                    os._exit(0)
            from ipyparallel.engine.nanny import KernelNanny

            KernelNanny.main(**kwargs, pipe=os.fdopen(url_w, "w", buffering=1))
        except BaseException:  # noqa: BLE001 - in the engine's log, as a nanny's error would be
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(args_r)
    os.close(url_w)

    def start_nanny(**kwargs):
        kwargs["pid"] = os.getpid()
        with os.fdopen(args_w, "wb") as fh:
            pickle.dump(kwargs, fh)
        pipe = os.fdopen(url_r, "rb")
        url = pipe.readline().decode("utf8").strip()
        if not url:
            raise RuntimeError("nanny failed")
        return url, _Nanny(pid, pipe)

    return start_nanny


def _become_engine(request: dict) -> None:
    """In the forked child: become ``python -m ipyparallel.engine <argv>`` in ``cwd`` with ``env``; never returns."""
    code = 1
    _EXITS.clear()  # the server's: an engine reaps nobody for the kernel
    try:
        os.setsid()  # first, as ipyparallel's launcher does (start_new_session): the kernel's signals are not ours
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # an engine's interrupt is KeyboardInterrupt
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["ipyparallel.engine", *request["argv"]]
        import ipyparallel.engine.app as app

        app.start_nanny = _prefork_nanny()  # after the streams and environment are the engine's, before any thread
        app.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the engine's log, then the process ends
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit
            atexit._run_exitfuncs()  # what the engine registered, as an interpreter's exit would run them
        except BaseException:  # noqa: BLE001
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def serve() -> None:
    """Import ``WARM_MODULES``, then fork an engine for each request line on stdin until stdin closes."""
    import importlib

    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an engine imports what it needs itself
            pass
    import gc

    gc.collect()
    gc.freeze()  # the imports' objects out of the collector's reach: an engine's collections leave their pages shared
    _EXITS[:] = sys.argv[1:2]
    signal.signal(signal.SIGCHLD, _reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the kernel's terminal is not for the server
    requests, replies = sys.stdin, sys.stdout
    while True:
        line = requests.readline()
        if not line:
            break  # the kernel is gone, or closed us
        try:
            request = json.loads(line)
            pid = os.fork()
        except Exception as exc:  # noqa: BLE001 - answered, the server goes on
            replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
            replies.flush()
            continue
        if pid == 0:
            _become_engine(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
    os._exit(0)


if __name__ == "__main__":
    serve()
