"""``fork_call(target, args, log)``: run one function in a process forked from a warm server, not a new interpreter.

A new interpreter imports torch and colab_kit before it does anything: 3.5 s of CPU for a dry run of a small
GPT on a 2-core Intel Xeon VM, of which the dry run itself is 0.07 s. Forked from a process that imported them
already, the child starts with them. Which server forks it:

1. a server the notebook layer registered (``register_forker``): a kernel's engine fork server, started by
   ``%load_ext colab_kit`` (``notebook/cluster/forked.py``), so a kernel runs no second server for it;
2. otherwise ``ck.launch``'s forkserver (``launch._context()``: torch, colab_kit and the engine's parts
   imported once), started here if no launch started it yet; it lives as long as this process;
3. inside a rank of ``ck.launch`` (a daemonic process, which ``multiprocessing`` lets start no child), a new
   interpreter, as before.

The child runs ``module:function`` with string ``args``, with its stdout and stderr in ``log`` (appended), and
exits 0, or 1 if the function raised (its traceback in the log). What it returns is not sent back: the callers
write their results into a file (``planner.dry_runs``). Worked example, ``ck.dry_run`` in a kernel after
``%load_ext colab_kit``::

    fork_call("colab_kit.planner.dry_runs.child:run_jobs", [jobs.pkl, results.pkl], log=log)
        -> the kernel's fork server forks pid 5120; handle.wait(120) -> 0 after 0.07 s; results.pkl written
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import Protocol

from . import _context

__all__ = ["Forked", "fork_call", "register_forker"]


class Forked(Protocol):
    """A forked child, seen from the caller."""

    pid: int

    def wait(self, timeout: float) -> int | None:
        """Its exit code (``Popen.returncode``'s convention: -9 killed by SIGKILL) within ``timeout`` s, else None."""

    def kill(self) -> None:
        """End it now (SIGKILL); nothing if it has ended."""


Forker = Callable[[str, list, str], "Forked | None"]
"""``(target, args, log) -> Forked``, or None where that server cannot fork now (it is gone)."""

_FORKERS: list[Forker] = []


def register_forker(forker: Forker) -> None:
    """Prefer ``forker`` to ``ck.launch``'s forkserver (the last registered is asked first); once per forker."""
    if forker not in _FORKERS:
        _FORKERS.append(forker)


def fork_call(target: str, args: list, log: str) -> Forked:
    """Fork a child that runs ``target`` (``"module:function"``) on ``args``, output appended to ``log``."""
    for forker in reversed(_FORKERS):
        child = forker(target, list(args), log)
        if child is not None:
            return child
    import multiprocessing as mp

    if mp.current_process().daemon:  # a rank of ck.launch: multiprocessing lets a daemon start no child
        return _Interpreter(target, list(args), log)
    process = _context().Process(target=run_target, args=(target, list(args), log, dict(os.environ)), daemon=True)
    with _main_left_out():
        process.start()
    return _Process(process)


@contextmanager
def _main_left_out():
    """Start the child without importing the caller's main module (multiprocessing would, by its ``__spec__`` or
    ``__file__``): the target is a module's function and its arguments are strings, so the child never needs
    it, and a script that calls ``ck.dry_run`` outside ``if __name__ == "__main__":`` would run again in it."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__}
    for key in saved:
        setattr(main, key, None) if key == "__spec__" else delattr(main, key)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(main, key, value)


def run_target(target: str, args: list, log: str, env: dict | None = None) -> int:
    """In the child: stdout and stderr to ``log``, the caller's environment ``env`` (a forkserver's child has the
    server's, from when it started), then ``target(*args)``; its exit code (0, or 1 if it raised)."""
    import importlib
    import traceback

    if env is not None:
        os.environ.clear()
        os.environ.update(env)

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        import torch

        torch.set_num_threads(1)  # a dry run's work is bookkeeping: one core, as a new interpreter got before
        module, _, name = target.partition(":")
        getattr(importlib.import_module(module), name)(*args)
        code = 0
    except BaseException:  # noqa: BLE001 - into the log, which the caller reads
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code:
        raise SystemExit(code)
    return code


class _Interpreter:
    """A new interpreter running ``run_target``: where no server may fork (inside a daemonic process)."""

    def __init__(self, target: str, args: list, log: str):
        import subprocess

        code = ("import sys; from colab_kit.launch.warm import run_target; "
                "run_target(sys.argv[1], sys.argv[3:], sys.argv[2])")
        path = os.pathsep.join(p for p in sys.path if p)
        self._popen = subprocess.Popen([sys.executable, "-c", code, target, log, *args],
                                       env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"})
        self.pid = self._popen.pid

    def wait(self, timeout: float) -> int | None:
        import subprocess

        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self._popen.kill()
        self._popen.wait()


class _Process:
    """A child of ``ck.launch``'s forkserver (a ``multiprocessing.Process``)."""

    def __init__(self, process):
        self._process, self.pid = process, process.pid

    def wait(self, timeout: float) -> int | None:
        self._process.join(timeout)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()
        self._process.join(5)

