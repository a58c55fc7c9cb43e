"""Hang diagnostics: when a pipeline rank waits too long, every rank says where it is.

Every blocking receive of the executor waits at most ``engine.pipeline.timeout``
seconds. When one runs out, that rank

1. writes its report (rank, position in its plan, the action it waits on, for how long)
   under a key of the torch.distributed store, and raises a flag there;
2. every other rank's ``HangMonitor`` thread, which watches that flag during a step,
   answers with its own report at once, even if its main thread is busy computing,
   sleeping or blocked in a collective (the thread only talks to the store);
3. the first rank gathers the reports (waiting at most ``report_wait`` seconds) and raises
   ``PipelineHang``, whose message is the plan's timestep x rank grid with each rank's
   current action in brackets, then one line per rank. Ranks blocked on a receive time
   out in turn; a rank whose monitor saw the flag raises ``PipelineHang`` before its next
   action instead of going on.

A rank whose action raises (a bug in a stage, an interrupt) publishes a ``failed`` report
and raises the flag before re-raising, so the others show where it failed and stop.

Worked example, pp=2 GPipe, 2 microbatches, rank 0 lost its send ``0SF1``::

    PipelineHang: rank 1 (pp 1 dp 0 tp 0) waited 2.0 s for 1RF1 ...
    step | rank 0   | rank 1
       0 | 0F0      | .
       1 | 0SF0     | 1RF0
       2 | 0F1      | 1F0
       3 | 0SF1     | [1RF1]
       4 | [0RB1]   | 1F1
       ...
    rank 0 (pp 0 dp 0 tp 0): waiting 2.0 s for 0RB1, position 4 of 8 (timestep 4)
    rank 1 (pp 1 dp 0 tp 0): waiting 2.0 s for 1RF1, position 2 of 8 (timestep 3)

A rank blocked inside a receive or a collective does not wait for its own timeout:
during a step the executor hands the flag to ``colab_kit.comm`` (``mesh.abort_flag``), whose
waits wake at least every ``comm.ABORT_POLL`` seconds (0.25) to look at it, so a blocked rank
stops within a second of any other rank's report.

After a hang the backend's connections between the stuck ranks may be closed and messages
of the broken step may still be in flight: the executor refuses ``begin()`` from then on
and says so. Restart the ranks (``cluster.restart()``) before training again.

The monitor's thread and its store connection belong to one executor: ``close()`` (called
by ``engine.close()``, or when the executor is garbage collected) ends the thread and drops
the connection, so building engines in a loop leaks neither.
"""
from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..config import Axis
from .check import format_grid

__all__ = ["PipelineHang", "HangMonitor", "render_grid", "describe", "hang_message"]


class PipelineHang(RuntimeError):
    """A pipeline rank waited longer than the timeout; ``reports`` maps rank -> where it was."""

    def __init__(self, message: str, reports: dict[int, dict] | None = None, rank: int | None = None):
        super().__init__(message)
        self.reports, self.rank = dict(reports or {}), rank

    def __reduce__(self):  # crosses process boundaries (launch, ipyparallel) intact
        return (type(self), (str(self), self.reports, self.rank))


def describe(report: dict) -> str:
    """One line: ``rank 1 (pp 1 dp 0 tp 0): waiting 2.0 s for 1RF1, position 2 of 8 (timestep 3)``."""
    who = f"rank {report['rank']} (pp {report['pp']} dp {report['dp']} tp {report['tp']})"
    state, action, since = report.get("state"), report.get("action"), report.get("since", 0.0)
    where = "" if report.get("position") is None else f", position {report['position']} of {report['of']}" + (
        f" (timestep {report['timestep']})" if report.get("timestep") is not None else "")
    if state == "waiting":
        what = f"waiting {since:.1f} s for {action or report.get('note')}"
    elif state == "running":
        what = f"running {action} for {since:.1f} s"
    elif state == "failed":
        what = f"failed in {action}: {report.get('note')}"
    elif state == "stopped":
        what = f"stopped before {action}, on another rank's report"
    elif state == "done":
        what = "ran its whole plan" + (f"; now {report['note']}" if report.get("note") else "")
    else:
        what = f"paused before {action}" if action else "not in a step"
    wire = report.get("pending") or []  # under nccl_rules: what the rank issued and is not complete
    more = "".join(f"\n    issued, not complete: {p}" for p in wire[:6]) + (
        f"\n    ... and {len(wire) - 6} more" if len(wire) > 6 else "")
    return f"{who}: {what}{where}{more}"


def render_grid(plan, timesteps: list[list[int]], positions: dict[int, int], window: int = 3) -> str:
    """The plan's timestep x pipeline-rank grid, each rank's action at ``positions[r]`` in brackets.

    ``timesteps[r][i]`` is the timestep of rank r's i-th action. Long grids keep the rows
    from ``window`` steps before the earliest bracket to ``window`` after the latest.
    """
    n_steps = 1 + max((t for row in timesteps for t in row), default=-1)
    cells = [["."] * plan.pp for _ in range(n_steps)]
    for r, row in enumerate(plan.actions):
        for i, a in enumerate(row):
            mark = positions.get(r) == i
            cells[timesteps[r][i]][r] = f"[{a}]" if mark else str(a)
    marked = [timesteps[r][i] for r, i in positions.items() if i < len(timesteps[r])]
    lo, hi = 0, n_steps
    if n_steps > 4 * window + 6 and marked:
        lo, hi = max(0, min(marked) - window), min(n_steps, max(marked) + window + 1)
    rows = [(str(t), cells[t]) for t in range(lo, hi)]
    text = format_grid(rows)
    if lo > 0:
        text = text.replace("\n", f"\n  ... ({lo} earlier steps)\n", 1)
    if hi < n_steps:
        text += f"\n  ... ({n_steps - hi} later steps)"
    return text


def hang_message(reason: str, reports: dict[int, dict], plan, timesteps, coords: dict, world: int,
                 timeout: float, report_wait: float) -> str:
    """The reason, the grid of this rank's pipeline with every rank's position, one line per rank."""
    mine = (coords[Axis.DP], coords[Axis.SP], coords[Axis.TP])
    same = {r["pp"]: r["position"] for r in reports.values()
            if (r["dp"], r["sp"], r["tp"]) == mine and r["position"] is not None}
    lines = [reason, "", f"plan of pipeline (dp {mine[0]}, sp {mine[1]}, tp {mine[2]}), "
             "[action] = where each rank is (actions above it ran, below it not yet):",
             render_grid(plan, timesteps, same), ""]
    lines += [describe(reports[r]) if r in reports else
              f"rank {r}: no report within {report_wait:g} s (its process may be gone)" for r in range(world)]
    lines.append("the connections between these ranks may now be closed: restart the ranks before training "
                 f"again (engine.pipeline.timeout = {timeout:g} s)")
    return "\n".join(lines)


def _store_client():
    """Our own connection to the job's TCPStore (a second client: no lock shared with the process group)."""
    store = dist.distributed_c10d._get_default_store()
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        try:
            return dist.TCPStore(base.host, base.port, is_master=False, timeout=timedelta(seconds=30))
        except Exception:  # noqa: BLE001 - fall back to the shared client  # pragma: no cover
            pass
    return base


class HangMonitor:
    """Per-rank watcher of one job's hang flag, over the torch.distributed store.

    ``start(step, report)`` watches the flag of that step from a daemon thread; ``report()``
    returns this rank's current report (a JSON-able dict). ``flagged`` is set once any rank
    raised the flag. ``fail(report)`` publishes this rank's report, raises the flag and
    returns every report gathered within ``report_wait`` seconds.
    """

    poll = 0.05

    def __init__(self, nonce: int, world_size: int, rank: int):
        self.prefix, self.world, self.rank = f"colab_kit/pipeline/{nonce}", world_size, rank
        self._store, self._lock = None, threading.Lock()
        self.flagged, self._active = threading.Event(), threading.Event()
        self._step: int | None = None  # the step being watched, None between steps
        self._thread: threading.Thread | None = None
        self._report = None
        self._closed = threading.Event()
        self.report_wait = 2.0

    def _key(self, step, what: str) -> str:
        return f"{self.prefix}/{step}/{what}"

    @property
    def store(self):
        if self._store is None:
            self._store = _store_client()
        return self._store

    def start(self, step: int, report) -> None:
        if self._closed.is_set():
            raise RuntimeError("this hang monitor was closed with its engine: boost a new engine")
        _ = self.store  # connect in the main thread
        self.flagged.clear()
        self._step, self._report = step, report
        self._active.set()
        if self._thread is None:  # one thread per monitor, idle between steps: starting a step costs nothing
            self._thread = thread = threading.Thread(target=self._watch, daemon=True,
                                                     name="colab_kit pipeline hang monitor")
            thread.start()

    def stop(self) -> None:
        self._step, self._report = None, None  # the thread keeps no reference to the executor between steps
        self._active.clear()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ended this monitor (its engine was closed)."""
        return self._closed.is_set()

    def close(self) -> None:
        """End the watcher thread (within one poll) and drop the store connection; idempotent."""
        self.stop()
        self._closed.set()
        self._active.set()  # wake the thread so it sees the close
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5 * self.poll + 1.0)
        self._store = None  # the client's socket closes with the object

    @property
    def alive(self) -> bool:
        """Whether the watcher thread is running (False before the first step and after ``close``)."""
        return self._thread is not None and self._thread.is_alive()

    def _watch(self) -> None:
        answered = None
        while not self._closed.is_set():
            self._active.wait()
            if self._closed.is_set():
                return
            step = self._step
            if step is None or step == answered:
                time.sleep(self.poll)
                continue
            try:
                with self._lock:
                    hit = self.store.check([self._key(step, "hang")])
                report = self._report if hit and step == self._step else None
                if report is not None:
                    self.flagged.set()
                    self._publish(step, report())
                    answered = step
                report = None  # hold no reference to the executor between looks
            except Exception:  # noqa: BLE001 - the store went away (the job is ending): nothing left to watch
                self._thread = None
                return
            time.sleep(self.poll)

    def _publish(self, step, report: dict) -> None:
        with self._lock:
            self.store.set(self._key(step, f"report/{self.rank}"), json.dumps(report))

    def first(self) -> dict:
        """The flag: ``{"rank": r, "reason": ...}`` of the rank that raised it first (empty if none yet)."""
        key = self._key(self._step if self._step is not None else -1, "hang")
        with self._lock:
            return json.loads(self.store.get(key)) if self.store.check([key]) else {}

    def announce(self, report: dict, reason: str) -> None:
        """Publish ``report`` and raise the flag (unless a rank raised it first)."""
        step = self._step if self._step is not None else -1
        self._publish(step, report)
        with self._lock:  # only the first rank's reason stays
            self.store.compare_set(self._key(step, "hang"), "", json.dumps({"rank": self.rank, "reason": reason}))
        self.flagged.set()

    def fail(self, report: dict, reason: str) -> dict[int, dict]:
        """``announce``, then gather every rank's report (rank -> dict) for ``report_wait`` seconds at most."""
        step = self._step if self._step is not None else -1
        self.announce(report, reason)
        keys = {r: self._key(step, f"report/{r}") for r in range(self.world)}
        got: dict[int, dict] = {}
        deadline = time.monotonic() + self.report_wait
        while True:
            for r, k in keys.items():
                if r not in got:
                    with self._lock:
                        if self.store.check([k]):
                            got[r] = json.loads(self.store.get(k))
            if len(got) == self.world or time.monotonic() > deadline:
                return got
            time.sleep(self.poll)
