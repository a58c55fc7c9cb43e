"""No orphans: a cluster's processes die with the kernel that started them, however it died.

ipyparallel starts the controller and every engine in a session of its own (so that a
Ctrl-C in the kernel does not reach them), and its clean-up runs at interpreter exit,
which a SIGKILL (a kernel restart of a busy kernel, the OOM killer) never reaches.
So each ``Cluster`` starts one small watchdog process and holds the write end of a
pipe to it. The kernel tells it which processes belong to the cluster; when the pipe
reaches end-of-file without a goodbye, the kernel is gone, and the watchdog ends them::

    kernel (pid 100) --pipe--> watchdog: "watch 201 1700000000.12"   controller
                                         "watch 305 1700000001.50"   engine 0 (and its nanny ...)
                                         "forget 305 ..."            an engine that restart() replaced
    kernel SIGKILLed -> pipe EOF -> watchdog: SIGTERM 201, 305, ...; SIGKILL what is left after 3 s
    cluster.stop()   -> "bye", pipe closed -> watchdog exits and kills nothing

Every process is named by (pid, creation time), so a pid the OS reused for something
else after the process ended is never signalled. The watchdog is POSIX-only, like
the rest of the cluster layer.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

__all__ = ["Watchdog", "cluster_processes", "launcher_pids", "descendant_pids", "with_descendants", "end_processes",
           "has_ended", "wait_ended"]

KILL_AFTER = 3.0


class Watchdog:
    """The kernel's side: start the watchdog, tell it what to watch, say goodbye on a clean stop."""

    def __init__(self):
        # run as a file, not ``-m colab_kit.notebook.cluster.watchdog``: the package's __init__ would import torch
        # (145 MiB and about a second of CPU per cluster, for a process that needs psutil alone)
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True, text=True)
        self.pid = self._proc.pid
        self.watched: set[tuple[int, float]] = set()

    def _say(self, line: str) -> None:
        stdin = self._proc.stdin
        assert stdin is not None  # a pipe (subprocess.PIPE)
        try:
            stdin.write(line + "\n")
            stdin.flush()
        except (BrokenPipeError, ValueError, OSError):  # the watchdog is gone: nothing to tell
            pass

    def watch(self, procs) -> None:
        for p in procs:
            key = (p.pid, p.create_time())
            if key not in self.watched:
                self.watched.add(key)
                self._say(f"watch {key[0]} {key[1]!r}")

    def forget(self, procs) -> None:
        """Processes that ended or were replaced on purpose (a restart's old engines)."""
        for p in procs:
            key = next((k for k in self.watched if k[0] == p.pid), None)
            if key is not None:
                self.watched.discard(key)
                self._say(f"forget {key[0]} {key[1]!r}")

    def close(self) -> None:
        """A clean stop: the watchdog exits without killing anything."""
        self._say("bye")
        assert self._proc.stdin is not None  # a pipe (subprocess.PIPE)
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def cluster_processes(before: set[int], roots: set[int] | None = None) -> list[psutil.Process]:
    """This kernel's descendants that were not there in ``before`` (pids): the processes a cluster start has
    just created (controller, its schedulers, engines, their nannies). ``roots``: the pids its launcher
    started (``launcher_pids``); then only those and their descendants, so a process the kernel started
    meanwhile for something else (another cluster, a subprocess of the user's) is never taken for one of
    the cluster's, nor killed with it. None or empty (a launcher that does not say): every new descendant.

        cluster_processes(before, {4242})   # 4242 (the controller) and what it started, nothing else new
    """
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    if not roots:
        return new
    out = []
    for p in new:
        try:
            if p.pid in roots or any(a.pid in roots for a in p.parents()):
                out.append(p)
        except psutil.Error:  # gone meanwhile
            pass
    return out


def launcher_pids(launcher) -> set[int]:
    """The pids an ipyparallel launcher started: its own process and those of the launchers it holds (an
    engine set's one per engine); empty where it keeps none (its processes are then found by ancestry)."""
    pids = set()
    for one in [launcher, *getattr(launcher, "launchers", {}).values()]:
        try:
            pid = getattr(one, "pid", None)
        except Exception:  # noqa: BLE001 - a launcher whose pid cannot be read says nothing
            pid = None
        if isinstance(pid, int) and pid > 0:
            pids.add(pid)
    return pids


def descendant_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def with_descendants(procs: list[psutil.Process]) -> list[psutil.Process]:
    """``procs`` and every process they have started since (still running ones)."""
    out = {p.pid: p for p in procs}
    for p in procs:
        try:
            out.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            pass
    return list(out.values())


def end_processes(procs: list[psutil.Process]) -> None:
    """TERM, then KILL after a short wait, whatever of ``procs`` still runs (pid reuse is checked)."""
    keys = set()
    for p in procs:
        try:
            keys.add((p.pid, p.create_time()))
        except psutil.Error:  # gone already
            pass
    _end(keys, wait=1.0)


def _alive(pid: int, created: float):
    try:
        p = psutil.Process(pid)
        return p if abs(p.create_time() - created) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def has_ended(p: psutil.Process) -> bool:
    """Whether ``p`` has ended: gone, its pid taken by another process since, or a zombie (``wait_ended``
    says why a zombie counts). A process that denies access still runs."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # AccessDenied: it runs
        return False


def wait_ended(procs, timeout: float) -> tuple[list, list]:
    """``psutil.wait_procs`` that counts a zombie as ended: ``(ended, running)`` after at most ``timeout`` s.

    A process that exits after its parent is reparented to PID 1, and stays a zombie until PID 1 reaps it; some
    inits poll for that (this project's CI machine, a Firecracker VM: 1.85 s measured for an orphan that exited).
    ``psutil.wait_procs`` waits for the pid itself to go, so every ``cluster.stop()`` waited out its whole grace
    second for engines and schedulers that had already exited. A zombie runs no code and holds no memory or
    ports: for "did it end?" it has.

    Worked example: engines 305 and 306 got SIGTERM; 305 exited at once (a zombie until PID 1 reaps it), 306
    ignores the signal: ``wait_ended([p305, p306], 1.0)`` returns ``([p305], [p306])`` after 1.0 s, where
    ``wait_procs`` returned ``([], [p305, p306])``.
    """
    procs, deadline, delay = list(procs), time.monotonic() + timeout, 0.005
    while True:
        running = [p for p in procs if not has_ended(p)]
        if not running or time.monotonic() >= deadline:
            return [p for p in procs if p not in running], running
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.05)


def _end(watched: set[tuple[int, float]], wait: float = KILL_AFTER) -> None:
    procs = [p for p in (_alive(pid, c) for pid, c in watched) if p is not None]
    for p in procs:  # TERM first: a controller or engine that can still clean up does
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, left = wait_ended(procs, wait)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass


def main() -> None:
    """The watchdog's side: read lines until EOF; at EOF without "bye", end what is watched."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the kernel is not for us
    watched: set[tuple[int, float]] = set()
    for line in sys.stdin:
        verb, *rest = line.split()
        if verb == "bye":
            return
        if verb in ("watch", "forget") and len(rest) == 2:
            key = (int(rest[0]), float(rest[1]))
            (watched.add if verb == "watch" else watched.discard)(key)
    _end(watched)


if __name__ == "__main__":
    main()
