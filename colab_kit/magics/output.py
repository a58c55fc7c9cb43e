"""Showing what the ranks printed, grouped per rank; live progress lines for long cells and for
starting engines (notebooks only: a plain terminal gets the final output alone)."""
from __future__ import annotations

import json
import sys
import time

from IPython.display import display, publish_display_data

from ..cluster import RankOutput

__all__ = ["show_outputs", "LiveLine", "Progress", "StageProgress"]


def show_outputs(outputs: dict[int, RankOutput]) -> None:
    """Print outputs grouped per rank; ranks with identical output share one group."""
    groups: dict[str, list[RankOutput]] = {}
    for out in outputs.values():
        key = json.dumps([out.stdout, out.stderr, out.result, out.status, out.error, out.displays],
                         sort_keys=True, default=str)
        groups.setdefault(key, []).append(out)
    for outs in groups.values():
        o, ranks = outs[0], [x.rank for x in outs]
        if not (o.stdout or o.stderr or o.result is not None or o.displays or o.status != "ok"):
            continue
        name = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        print(f"[{name}]" + {"ok": "", "error": " FAILED", "interrupted": " interrupted",
                                 "stuck": " still running (given up on)"}[o.status])
        if o.stdout:
            print(o.stdout, end="" if o.stdout.endswith("\n") else "\n")
        if o.stderr:
            print(o.stderr, end="" if o.stderr.endswith("\n") else "\n", file=sys.stderr)
        for d in o.displays:
            publish_display_data(d["data"], d["metadata"])
        if o.result is not None:
            print(f"Out[{name}]: {o.result}")
        if o.error:
            print(o.error.rstrip(), file=sys.stderr)
    sys.stdout.flush()


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
        self.what, self.t0, self.text = what, time.monotonic(), None

    def __call__(self, stage: str, done: int, total: int) -> None:
        text = f"{self.what}: {stage} {done}/{total} ({time.monotonic() - self.t0:.0f} s)"
        if text != self.text:
            self.text = text
            self.show(text)
