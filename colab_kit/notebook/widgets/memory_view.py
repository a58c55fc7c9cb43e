"""``MemoryView``: each rank's memory, measured beside the estimate, refreshed after each step.

    view = ck.widgets.MemoryView()   # the %colossal cluster; the engine is `engine` on every rank
    view                             # by category / by place, Refresh, the step, the figure
    view.watch()                     # from now on refreshed after every %%colossal cell that ran

``refresh()`` calls ``engine.memory()``, ``engine.memory_estimate()``, ``engine.device_budget``
(None: no budget line) and ``engine.step_count`` on every rank in one ``cluster.run`` and
redraws ``viz.memory.memory_by_rank_figure``: per rank a stacked bar of what was measured,
beside it a hatched bar labelled "estimated", and a dashed line at the device budget.
Outside a kernel (or where widgets cannot render) the view is this text, with one unit for
the whole table and ``measured / estimated`` in each cell (README's GPT, d_model=64 x 2
layers, batch 32 of 32 tokens, dp=2 x tp=2, AdamW, after one step)::

    MemoryView('engine' on 4 ranks, step 1; MiB, measured / estimated)
      rank  params            grads             optimizer         activations       device            host
      0     0.22 / 0.22       0.22 / 0.22       0.43 / 0.43       2.85 / 2.85       3.71 / 3.71       0.00 / 0.00
      ...
      3     0.22 / 0.22       0.22 / 0.22       0.43 / 0.43       2.85 / 2.85       3.71 / 3.71       0.00 / 0.00
      device budget: none set

"Refreshed after each step": ``watch()`` registers a ``post_run_cell`` callback with the
IPython shell. After a cell that ran ``%%colossal`` (the cell's first line) and succeeded,
the view refreshes, so a cell like ``%%colossal`` / ``engine.train_step(batch)`` is followed
by the new numbers and step. ``watch(every_cell=True)`` refreshes after every successful
cell (a ``cluster.run(train)`` in plain Python, say), one round trip to the ranks each
(~10-20 ms). A failed cell, a cluster that needs a restart or is not running is skipped;
a refresh that fails shows its error in the widget and never in the cell. ``unwatch()`` stops.
``%colossal memory`` shows a view that watches (and stops the one it showed before).
"""
from __future__ import annotations

from typing import Any

from .display import KernelDisplay, html
from .figure_view import figure_view, redraw
from .watching import RankView
from ...errors import RankError
from ...viz.memory import memory_by_rank_figure, segments
from colab_kit.notebook.cluster.remote import namespace

__all__ = ["MemoryView", "NoMemory"]

BY = ("category", "place")


class NoMemory(LookupError):
    """No cluster, or a rank without an engine in that variable."""


def _rank_memory(var: str):
    """On a rank: what the view shows of the engine in ``var``, or None when there is none."""
    eng = namespace().get(var)
    if eng is None or not callable(getattr(eng, "memory", None)):
        return None
    est = eng.memory_estimate() if callable(getattr(eng, "memory_estimate", None)) else None
    return {"memory": eng.memory(), "estimate": est, "budget": getattr(eng, "device_budget", None),
            "step": getattr(eng, "step_count", None)}


def _unit(values) -> tuple[str, int]:
    top = max([v for v in values if v is not None] or [0])
    return next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if top >= s or s == 1)


def fmt(value: int | None, scale: int) -> str:
    """``value`` bytes in the table's unit (``scale`` bytes): 0 decimals for bytes, else 2."""
    return "-" if value is None else f"{value:.0f}" if scale == 1 else f"{value / scale:.2f}"


class MemoryView(RankView, KernelDisplay):
    """Memory per rank (``engine.memory()``) beside its estimate, with the device budget.

    cluster: a ``Cluster``, a ``ColossalState`` (its cluster is looked up at each refresh, so
        a restarted or new cluster is followed), or None: the ``%colossal`` state's.
    var: the engine's variable in each rank's namespace.
    by: "category" (params, grads, optimizer, activations) or "place" (device, host).

    Gathers at once (``NoMemory`` says what to do when a rank has no engine there).
    """

    missing = NoMemory

    def __init__(self, cluster=None, var: str = "engine", *, by: str = "category"):
        self._source, self.var = cluster, var
        self.by = self._check_by(by)
        self.measured: list[dict] = []
        self.estimated: list[dict | None] | None = None
        self.budget: int | None = None
        self.steps: list[int | None] = []
        self.refreshes, self.busy = 0, False
        self.error: str | None = None
        self._ui: dict[str, Any] | None = None  # the widgets, once built
        self._init_watch()
        self.refresh()

    # ------------------------------------------------------------ logic (no widgets)
    def set_by(self, by: str) -> MemoryView:
        self.by = self._check_by(by)
        if self._ui is not None and self._ui["by"].value != by:
            self._ui["by"].value = by  # its observer calls set_by again, which redraws
        else:
            self._redraw()
        return self

    @property
    def step(self) -> str:
        steps = set(self.steps)
        return f"step {self.steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, self.steps))}"

    def figure(self):
        """``viz.memory.memory_by_rank_figure`` of the last refresh (by ``self.by``)."""
        est = ", beside the estimate" if self.estimated is not None else ""
        title = f"Memory per rank{' by place' if self.by == 'place' else ''} after {self.step} (measured{est})"
        return memory_by_rank_figure(self.measured, self.estimated, self.budget, by=self.by, title=title)

    def table(self) -> str:
        """The text form: one row per rank, each cell ``measured / estimated`` in one unit."""
        cols = {**segments(self.measured), **segments(self.measured, "place")}
        ests = self.estimated or [None] * len(self.measured)
        est = {**segments(ests), **segments(ests, "place")} if self.estimated is not None else {}
        unit, scale = _unit([v for vs in (*cols.values(), *est.values()) for v in vs])
        lines = [f"MemoryView({self.var!r} on {len(self.measured)} ranks, {self.step}; {unit}, measured"
                 + (" / estimated)" if est else ")"),
                 "  rank  " + "".join(f"{c:<18}" for c in cols).rstrip()]
        for r in range(len(self.measured)):
            cells = [fmt(cols[c][r], scale) + (f" / {fmt(est[c][r], scale)}" if c in est else "") for c in cols]
            lines.append(f"  {r:<6}" + "".join(f"{c:<18}" for c in cells).rstrip())
        lines.append(f"  device budget: {self.budget:,} B" if self.budget is not None else "  device budget: none set")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table() + (f"\n  last refresh failed: {self.error}" if self.error else "")

    # ------------------------------------------------------------ refreshed after each step: watching.CellWatcher
    # ------------------------------------------------------------ the ranks
    def _gather(self) -> list:
        cluster = self.cluster
        try:
            got = cluster.run(_rank_memory, self.var, progress=None)
        except RankError as exc:
            raise NoMemory(f"could not read memory on the ranks: {str(exc).splitlines()[0]}") from None
        missing = [r for r, g in enumerate(got) if g is None]
        if missing:
            raise NoMemory(f"ranks {missing} have no engine in a variable {self.var!r}: build one on every rank "
                           f"(in a %%colossal cell: {self.var} = ck.boost(model, optimizer_factory, config, "
                           "mesh=mesh)), or name its variable with --var NAME / MemoryView(var=NAME)")
        return got

    def _take(self, got: list) -> None:
        self.measured = [g["memory"] for g in got]
        ests = [g["estimate"] for g in got]
        self.estimated = ests if any(e is not None for e in ests) else None
        self.budget = next((g["budget"] for g in got if g["budget"] is not None), None)
        self.steps = [g["step"] for g in got]
        self.refreshes, self.error = self.refreshes + 1, None
        self._redraw()

    @staticmethod
    def _check_by(by: str) -> str:
        if by not in BY:
            raise ValueError(f"by={by!r}: choose 'category' or 'place'")
        return by

    # ------------------------------------------------------------ widgets (lazy)
    def widget(self):
        """A by category / by place toggle, Refresh, a status line (step, budget, watching), errors, the figure."""
        if self._ui is None:
            import ipywidgets as w

            ui = {"by": w.ToggleButtons(options=[("by category", "category"), ("by place", "place")], value=self.by),
                  "refresh": w.Button(description="Refresh", tooltip="read memory() and memory_estimate() again"),
                  "status": w.HTML(), "errors": w.Output(), "figure": figure_view(self.figure())}
            ui["by"].observe(lambda change: self.set_by(change["new"]), names="value")
            ui["refresh"].on_click(lambda _: self.click_refresh())
            ui["box"] = w.VBox([w.HBox([ui["by"], ui["refresh"]]), ui["status"], ui["errors"], ui["figure"]])
            self._ui = ui
            self._redraw()
        return self._ui["box"]

    def _redraw(self) -> None:
        ui = self._ui
        if ui is None:
            return
        budget = f"device budget {self.budget:,} B" if self.budget is not None else "no device budget set"
        est = "measured beside the estimate (hatched)" if self.estimated is not None else "measured (no estimate)"
        how = ("refreshed after every cell" if self._every_cell else "refreshed after each %%colossal cell") \
            if self.watching else "Refresh to read again"
        ui["status"].value = html(f"{self.step} on {len(self.measured)} ranks ({self.var!r}): {est}; {budget}; {how}")
        redraw(ui["figure"], self.figure())
