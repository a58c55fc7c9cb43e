"""Where a rank that is still running is: its Python stack, asked for when ``ck.launch`` gives up on it.

A rank that hangs says nothing; the peer waiting for it in a collective is the one that times out and
reports. So each rank arms ``faulthandler`` on ``SIGUSR1`` (``arm``): asked, it writes every thread's Python
stack to its file, from C, whatever the rank is blocked in (a collective, a sleep, a lock). When launch
stops ranks that never reported, it asks each for its stack first (``where_ranks_are``) and the error says
where each one was, the caller's own lines included (``describe``). Worked example, rank 1 sleeps while
rank 0 all-reduces::

    RankError: rank 0 failed in launch: RuntimeError: [...] Timed out waiting 15000ms for recv operation
      ranks 1 were still waiting (...)
      where each rank still running was:
        rank 1: train.py:6 in step: time.sleep(1000)
        ...

The notebook cluster asks its engines the same way (``faulthandler`` writes to the engine's stderr, which
ipykernel relays as the running call's output: ``user_frames`` reads it there).
"""
from __future__ import annotations

import faulthandler
import linecache
import os
import re
import signal
import time

__all__ = ["arm", "where_ranks_are", "describe", "user_frames", "without_dumps"]

_FILES: list = []  # in a rank: the open file faulthandler writes to (kept open for the process's life)
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (\S+)')


def arm(path: str) -> None:
    """In a rank: write every thread's Python stack to ``path`` on SIGUSR1 (nothing else changes)."""
    fh = open(path, "w")  # faulthandler writes to it from C until the process ends
    _FILES.append(fh)
    faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True, chain=False)


def _threads(text: str) -> list[list[tuple[str, int, str]]]:
    """Each thread's frames in a ``faulthandler`` dump, innermost first (as it writes them)."""
    return [[(f, int(n), fn) for f, n, fn in (m.groups() for m in map(_FRAME.match, block.splitlines()) if m)]
            for block in re.split(r"\n\s*\n", text)]


def _main_frames(text: str, entry: str) -> list[tuple[str, int, str]]:
    """The frames of the thread whose stack holds ``entry`` (the rank's main function), oldest first, after it.

    >>> dump = '''Thread 0x1 (most recent call first):
    ...   File "/usr/lib/python3.11/threading.py", line 320 in wait
    ...
    ... Current thread 0x2 (most recent call first):
    ...   File "/home/me/train.py", line 6 in step
    ...   File "/x/colab_kit/launch/__init__.py", line 201 in _worker
    ...   File "/x/multiprocessing/process.py", line 108 in run
    ... '''
    >>> _main_frames(dump, "_worker")
    [('/home/me/train.py', 6, 'step')]
    """
    for frames in _threads(text):
        names = [fn for _, _, fn in frames]
        if entry in names:
            return frames[:names.index(entry)][::-1]
    return []


def user_frames(text: str) -> list[tuple[str, int, str]]:
    """The frames, oldest first, of the thread in a ``faulthandler`` dump that runs code of the caller's own
    (a frame outside Python's and the installed packages' directories): an engine's main thread, running a
    cell, among ipykernel's and zmq's threads; [] where none does.

    >>> import sysconfig
    >>> lib = sysconfig.get_paths()["purelib"]
    >>> dump = f'''Thread 0x1 (most recent call first):
    ...   File "{lib}/zmq/devices/basedevice.py", line 248 in run
    ...
    ... Current thread 0x2 (most recent call first):
    ...   File "/tmp/ipykernel_7/1234.py", line 3 in <module>
    ...   File "{lib}/ipykernel/kernelbase.py", line 400 in dispatch
    ... '''
    >>> user_frames(dump)[-1]
    ('/tmp/ipykernel_7/1234.py', 3, '<module>')
    """
    libs = _library_dirs()
    for frames in _threads(text):
        if any(not os.path.abspath(f).startswith(libs) for f, _, _ in frames):
            return frames[::-1]
    return []


def where_ranks_are(pids: dict[int, int], directory: str, entry: str = "_worker",
                    wait: float = 1.0) -> dict[int, list[tuple[str, int, str]]]:
    """Ask each rank (``{rank: pid}``, still running) for its stack and read it from ``directory/<rank>``:
    ``{rank: frames, oldest first}``; a rank that does not answer within ``wait`` seconds is left out."""
    asked = {}
    for rank, pid in pids.items():
        try:
            path = os.path.join(directory, str(rank))
            asked[rank] = (path, os.path.getsize(path) if os.path.exists(path) else 0)
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            asked.pop(rank, None)
    out: dict = {}
    until = time.monotonic() + wait
    while asked and time.monotonic() < until:
        time.sleep(0.05)
        for rank, (path, before) in list(asked.items()):
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    fh.seek(before)
                    text = fh.read()
            except OSError:
                continue
            frames = _main_frames(text, entry)
            if frames:
                out[rank] = frames
                del asked[rank]
    return out


def _library_dirs() -> tuple[str, ...]:
    """Where Python's own modules, installed packages and colab_kit live: frames there are not the caller's."""
    import sysconfig

    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # colab_kit itself
    return tuple(os.path.join(p, "") for p in paths)


_CELL = re.compile(r"ipykernel_\d+/\d+\.py$")
"""Where ipykernel compiles a cell it runs (an engine's ``execute``): its lines are the cell's."""


def _frame(path: str, line: int, fn: str, cell: str | None = None) -> str:
    if cell is not None and _CELL.search(path):
        lines = cell.splitlines()
        src = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        return f"cell line {line}" + (f": {src}" if src else "")
    src = linecache.getline(path, line).strip()
    return f"{os.path.basename(path)}:{line} in {fn}" + (f": {src}" if src else "")


_DUMP = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):\n(?:  File .*\n|\n)*",
                   re.MULTILINE)


def without_dumps(text: str) -> str:
    """``text`` (what a rank printed) without the stacks it wrote when asked where it is.

    >>> without_dumps('step 1\\nThread 0x1 (most recent call first):\\n  File "a.py", line 3 in f\\n\\nstep 2\\n')
    'step 1\\nstep 2\\n'
    """
    return _DUMP.sub("", text)


def describe(where: dict[int, list[tuple[str, int, str]]], cell: str | None = None) -> str:
    """The lines an error adds: for each rank, the innermost frame of the caller's own code (with its source
    line where it is known), and the innermost frame of all where that is in a library (a collective's wait).

    >>> import colab_kit.errors.stacks as s
    >>> print(describe({1: [("/home/me/train.py", 6, "step"), (s.__file__, 40, "wait")]}))
      where each rank still running was:
        rank 1: train.py:6 in step (inside wait, stacks.py:40)
    """
    if not where:
        return ""
    libs = _library_dirs()
    lines = ["  where each rank still running was:"]
    for rank in sorted(where):
        frames = where[rank]
        own = [f for f in frames if not os.path.abspath(f[0]).startswith(libs)]
        text = _frame(*own[-1], cell=cell) if own else _frame(*frames[-1])
        if own and frames[-1] != own[-1]:
            path, line, fn = frames[-1]
            text += f" (inside {fn}, {os.path.basename(path)}:{line})"
        lines.append(f"    rank {rank}: {text}")
    return "\n".join(lines)
