"""Live progress lines, below both the cluster and the magics: what ``Cluster.start`` / ``restart`` /
``run`` show while they wait, and how their ``progress=`` argument is read.

In a notebook each line is one display, updated in place and emptied when the wait ends::

    starting 4 ranks: engines registered 3/4 (5 s)
    running on 4 ranks for 7 s; rank 0: step 10  loss 3.0004

``progress=`` reads like tqdm's ``disable``: True or False mean on or off; a callable gets the ticks.
"""
from __future__ import annotations

import sys
import time

from IPython.display import display

__all__ = ["Line", "LiveLine", "Progress", "StageProgress", "call_progress", "stage_progress", "notebook_progress"]


class Line:
    """A one-line display (HTML in a notebook, plain text elsewhere)."""

    def __init__(self, text: str):
        self.text = text

    def _repr_html_(self) -> str:
        escaped = self.text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        return f"<code>{escaped}</code>" if self.text else ""

    def __repr__(self) -> str:
        return self.text


class LiveLine:
    """One line of a notebook's output, updated in place (``display_id``); emptied by ``close``."""

    handle = None

    def show(self, text: str) -> None:
        if self.handle is None:
            self.handle = display(Line(text), display_id=True)
        else:
            self.handle.update(Line(text))

    def close(self) -> None:
        if self.handle is not None:
            self.handle.update(Line(""))


class Progress(LiveLine):
    """A live line saying that a long cell still runs, with the latest line a rank printed;
    emptied when the cell ends (its grouped output follows)::

        running on 4 ranks for 7 s; rank 0: step 10  loss 3.0004
    """

    def __init__(self, n: int, after: float = 2.0):
        self.n, self.after = n, after

    def __call__(self, seconds: float, stdout: dict[int, str]) -> None:
        if seconds < self.after:
            return
        said = [(r, out.rstrip().splitlines()[-1]) for r, out in stdout.items() if out.strip()]
        self.show(f"running on {self.n} ranks for {seconds:.0f} s"
                  + (f"; rank {said[0][0]}: {said[0][1]}" if said else ""))


class StageProgress(LiveLine):
    """``progress(stage, done, total)`` for ``Cluster.start`` / ``restart``: a live line,
    redrawn only when its text changes, emptied when the cluster is up::

        starting 4 ranks: engines registered 3/4 (5 s)
        starting 4 ranks: torch.distributed ready 4/4 (8 s)
    """

    def __init__(self, what: str):
        self.what, self.t0 = what, time.monotonic()
        self.text: str | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        text = f"{self.what}: {stage} {done}/{total} ({time.monotonic() - self.t0:.0f} s)"
        if text != self.text:
            self.text = text
            self.show(text)


def call_progress(progress, auto="auto"):
    """``progress`` of ``run``/``execute``: a callable ``(seconds, {rank: stdout})``; True or "auto" (shown where
    it can be: a live line in a notebook), False or None (off), as tqdm's ``disable`` reads a bool."""
    if progress is None or progress is False:
        return None
    if progress is True or progress == "auto":
        return auto
    if callable(progress):
        return progress
    raise TypeError(f"progress={progress!r}: give True or False (on or off), 'auto', or a callable "
                    "progress(seconds, {rank: stdout so far})")


def stage_progress(progress):
    """``progress`` of ``start``/``restart``: a callable ``(stage, done, total)``; True prints each stage on
    stderr; False or None, nothing."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return lambda stage, done, total: print(f"{stage}: {done}/{total}", file=sys.stderr, flush=True)
    if callable(progress):
        return progress
    raise TypeError(f"progress={progress!r}: give True or False (on or off), or a callable "
                    "progress(stage, done, total)")


def notebook_progress(n: int):
    """A live progress line when running inside a notebook kernel, else None."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return None
    return Progress(n)
