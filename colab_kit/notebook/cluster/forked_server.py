"""The fork server's own code: what runs in the server process and in the engines it forks (``forked.py`` is
the kernel's side: it starts this with ``python -c "from colab_kit.notebook.cluster.forked_server import serve;
serve()" <exits directory>`` and writes one JSON request a line).

Per request ``{"argv", "env", "cwd", "log"}`` the server forks; the child becomes ``python -m ipyparallel.engine
<argv>`` (``_become_engine``: its own session, the log as stdout and stderr, the environment and directory of
the request) after forking its own nanny (``_prefork_nanny``); the server answers ``{"pid": ..., "host": ...}``.
A request ``{"call": "module:function", "args", "env", "cwd", "log"}`` forks a child that runs that function
and exits (``launch.warm.fork_call``: ``ck.dry_run`` in a kernel, without a new interpreter's imports).
Before any request it says ``{"ready": true, "host": ...}``, once its imports are done.
A server on an SSH host (``ssh_forked.py``) is sent ``"merge_env": true`` and no ``cwd``: the engine's environment
is the server's login environment with the request's variables set (an empty value unsets one), in the
server's directory, as ipyparallel's remote start would give it. Each child
that ends is reaped at once (``_reap``) and its exit code written to ``<exits>/<pid>`` for the kernel
(``forked.exit_code``). Worked example, ``Cluster(2)``::

    kernel -> {"argv": [...], "env": {...}, "cwd": "/home/me/nb", "log": ".../engine-0.log"}   <- {"pid": 4101}
    kernel -> {... "engine-1.log"}                                                             <- {"pid": 4102}
    rank 1 is SIGKILLed by the OOM killer: the server writes "-9" to <exits>/4102
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys

from ...launch import ENGINE_MODULES
from ...launch.warm import run_target

__all__ = ["serve", "WARM_MODULES"]

WARM_MODULES = ("torch", "torch.distributed", "ipyparallel.engine.app", "ipyparallel.engine.nanny",
                "colab_kit.notebook.cluster.remote", *ENGINE_MODULES, "colab_kit.notebook.magics.training")
"""What the server imports before it forks: what an engine's start-up would import itself, and what its first
``boost`` and its first ``%%colossal`` cell would (``ck.launch``'s ``ENGINE_MODULES``: torch._dynamo, DTensor,
the engine's parts; the summary line's ``rank_training``). Imported once here, in the server, each engine
starts with them and shares their pages; an engine that imported them itself would spend 0.8 s of CPU on the
summary line's module alone at its first cell, and hold its own copy (an engine and its nanny after a small
GPT's steps: 67 MiB of their own, against 143 MiB so)."""

_EXITS: list[str] = []  # in the server: the directory its kernel reads exit statuses from
_BASE_ENV: dict[str, str] = {}  # in the server: its environment as it started, before its imports


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
            # a signal handler, run between any two bytecodes, also while the interpreter shuts down (codecs
            # gone: open(..., encoding=) raised LookupError there): bytes through os calls, and nothing raises
            try:
                path = os.path.join(_EXITS[0], str(pid))
                fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.write(fd, b"%d" % os.waitstatus_to_exitcode(status))
                finally:
                    os.close(fd)
                os.replace(path + ".tmp", path)
            except Exception:  # noqa: BLE001 - the kernel removed the directory, an odd status, a dying interpreter
                pass


class _Nanny:
    """What the engine keeps of its nanny (ipyparallel keeps the Popen): the pipe whose closing, when the engine
    exits, tells the nanny so."""

    def __init__(self, pid: int, pipe):
        self.pid, self.pipe = pid, pipe


def _prefork_nanny():
    """Fork this engine's nanny now, while the process has no thread, and return the ``start_nanny`` that hands it
    its arguments. ipyparallel starts the nanny as a new interpreter (``python -m ipyparallel.engine.nanny``: 0.2 s
    of CPU for its start and imports on a 2-core Intel Xeon VM, ``/usr/bin/time python -c "import
    ipyparallel.engine.nanny"``, and 27 MiB of its own against 9 forked); forked here it has them already. The
    protocol is ipyparallel's: the engine writes the pickled arguments, the nanny answers the URL of its relay socket on
    a line and then watches that pipe, whose closing means the engine has exited. A nanny whose engine never asks
    (``enable_nanny=False``) reads end of input when the engine exits, and exits too."""
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
    asked: list[bool] = []

    def start_nanny(**kwargs):
        if asked:  # its pipes are spent: one nanny an engine, as ipyparallel starts one
            raise RuntimeError("this engine's nanny was started already")
        asked.append(True)
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
    """In the forked child: become ``python -m ipyparallel.engine <argv>`` in ``cwd`` with ``env``, or, for a
    request with ``"call": "module:function"`` (``ForkServer.call``), run that on ``"args"`` and exit; never
    returns."""
    code = 1
    _EXITS.clear()  # the server's: an engine reaps nobody for the kernel
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})  # held by the server around the fork
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
        if request.get("cwd"):
            os.chdir(request["cwd"])
        env = dict(_BASE_ENV) if request.get("merge_env") else {}
        for key, value in request["env"].items():
            if value is None or (value == "" and request.get("merge_env")):
                env.pop(key, None)
            else:
                env[key] = str(value)
        os.environ.clear()
        os.environ.update(env)
        if "call" in request:  # not an engine: one function, then exit (launch.warm.fork_call: a dry run)
            code = run_target(request["call"], request["args"], request["log"])
        else:
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
        except BaseException:  # noqa: BLE001 - an exit hook's failure must not stop the os._exit below
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
                pass
        os._exit(code)


def serve() -> None:
    """Import ``WARM_MODULES``, then fork an engine for each request line on stdin until stdin closes."""
    import importlib

    _BASE_ENV.update(os.environ)
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an engine imports what it needs itself
            pass
    import gc

    gc.collect()
    gc.freeze()  # the imports' objects out of the collector's reach: an engine's collections leave their pages shared
    _EXITS[:] = sys.argv[1:2]
    if _EXITS:
        os.makedirs(_EXITS[0], mode=0o700, exist_ok=True)  # made by a local kernel already; on an SSH host, here
    host = socket.gethostname()
    requests, replies = sys.stdin, sys.stdout
    try:
        replies.write(json.dumps({"ready": True, "host": host}) + "\n")  # imports done: the kernel may ask now
        replies.flush()
    except OSError:  # the kernel is gone already (killed during the imports): end below, as on end of input
        pass
    signal.signal(signal.SIGCHLD, _reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the kernel's terminal is not for the server
    while True:
        line = requests.readline()
        if not line:
            break  # the kernel is gone, or closed us
        try:
            request = json.loads(line)
            # SIGCHLD held until an earlier child's status under the same pid is gone: a reused pid never reads it
            pid = -1
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
            try:
                pid = os.fork()
                if pid and _EXITS:
                    try:
                        os.unlink(os.path.join(_EXITS[0], str(pid)))
                    except OSError:
                        pass
            finally:
                if pid != 0:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        except Exception as exc:  # noqa: BLE001 - answered, the server goes on
            replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
            replies.flush()
            continue
        if pid == 0:
            _become_engine(request)
        try:
            replies.write(json.dumps({"pid": pid, "host": host}) + "\n")
            replies.flush()
        except OSError:  # the kernel is gone: nobody reads the replies
            break
    if _EXITS:  # no kernel is left to read the exit statuses: a kernel that was killed leaves no directory behind
        import shutil

        path = _EXITS.pop()  # first: a child reaped now writes nothing into the directory being removed
        shutil.rmtree(path, ignore_errors=True)
    os._exit(0)


if __name__ == "__main__":
    serve()
