"""``PlannerView``: the planner's candidates as a table and a memory-vs-time scatter; Apply one.

    cands = ck.plan(model_cfg, 8, batch=16, memory_per_rank=64 * 2**20)
    view = ck.widgets.PlannerView(cands)     # the %colossal state's cluster receives Apply
    view                                     # table (click a row), scatter (click a point), Apply
    view.select(2); view.apply()             # the same without a browser

Choosing a row or a point selects that candidate (ringed in the scatter); Apply sends its
config through ``ColossalState.apply_config``, the one path ``%colossal config`` takes (the
world size is checked there, then the config and mesh are set on every rank). Every number
shown is the planner's estimate, and the view says so. Outside a kernel (or where widgets
cannot render) the view is its text table: one row per candidate, MiB per rank by category
(estimated), the estimated step time, whether it fits and what dominates its cost. For a
made-up pair of candidates on 4 ranks under 8 MiB per rank the text reads::

    PlannerView: 2 candidates, best first (planned: estimated, not run); memory per rank 8.00 MiB
         #  config  params   grads  optimizer  activations  step ms  fits  why
     >   0  dp=4      3.00    0.00       0.00         0.00    20.00  yes   compute
         1  tp=4      9.00    0.00       0.00         0.00    30.00  no    tp all-reduce
      chosen: #0 dp=4: %colossal config dp=4

(``>`` marks the chosen row; Apply's result follows on a last line once applied.)
"""
from __future__ import annotations

from typing import Any

from ...viz.memory import CATEGORIES, MIB
from ..session import find
from ...viz.planner import config_words, plan_figure
from .display import KernelDisplay, html, then
from .figure_view import figure_view, redraw
from ...config import ConfigError
from ...errors import RankError
from ..cluster import ClusterError

__all__ = ["PlannerView"]

_STYLE = "<style>.ck-planner select {font-family: monospace; font-size: 12px}</style>"


def _label(candidate) -> str:
    """A candidate's short name: ``Candidate.describe()`` (``dp=2 x pp=2 zero=2 zb-v m=2 v=2``) where it has one,
    else the config words."""
    describe = getattr(candidate, "describe", None)
    return describe() if callable(describe) else config_words(candidate.config)


class PlannerView(KernelDisplay):
    """Candidates of ``ck.plan`` (best first) as a table and a scatter; Apply sends the chosen one.

    candidates: what ``ck.plan`` returned (or any list of objects with ``.config``, ``.memory``,
        ``.step_seconds``, ``.fits``, ``.why``).
    state: the ``ColossalState`` Apply goes through; None: the ``%colossal`` state of this shell.
    memory_per_rank: bytes, for the scatter's dashed line; None: the candidates' own
        ``memory_per_rank`` where they carry one.
    top: show only the first ``top`` candidates.
    """

    def __init__(self, candidates, state=None, *, memory_per_rank: int | None = None, top: int | None = None):

        if top is not None and top < 1:
            raise ValueError(f"top={top}: show at least one candidate (top >= 1)")
        self.total = len(candidates)
        self.candidates = list(candidates)[:top]
        if not self.candidates:
            raise ValueError("no candidates to show: the planner found no config for this model, batch and ranks")
        self.memory_per_rank = memory_per_rank if memory_per_rank is not None \
            else getattr(candidates, "memory_per_rank", None)
        self.state = state if state is not None else find()
        self.selected = next((i for i, c in enumerate(self.candidates) if c.fits), 0)
        self.message = ""
        self._ui: dict[str, Any] | None = None  # the widgets, once built

    # ------------------------------------------------------------ logic (no widgets)
    @property
    def chosen(self):
        return self.candidates[self.selected]

    def select(self, index: int) -> str:
        """Choose candidate ``index`` (as a row or point click does); returns the 'chosen: ...' line."""
        if not isinstance(index, int) or not 0 <= index < len(self.candidates):
            raise ValueError(f"candidate {index!r}: choose 0..{len(self.candidates) - 1}")
        if index != self.selected:
            self.selected, self.message = index, ""
            self._redraw()
        return self.status()

    def status(self) -> str:
        c = self.chosen
        line = f"chosen: #{self.selected} {_label(c)}: %colossal config {config_words(c.config)}"
        return line if c.fits else f"{line}; estimated not to fit: {c.why}"

    def figure(self):
        """``viz.planner.plan_figure`` of the candidates, the chosen one ringed."""
        return plan_figure(self.candidates, self.memory_per_rank, chosen=self.selected)

    def rows(self) -> tuple[str, list[str]]:
        """(header, one line per candidate): config words, MiB per category, step ms, fits, why."""
        width = max(6, *(len(_label(c)) for c in self.candidates))
        head = f"{'#':>3}  {'config':<{width}}  " + "  ".join(f"{k:>{max(6, len(k))}}" for k in CATEGORIES) \
            + f"  {'step ms':>7}  fits  why"
        lines = []
        for i, c in enumerate(self.candidates):
            mib = "  ".join(f"{c.memory.get(k, 0) / MIB:>{max(6, len(k))}.2f}" for k in CATEGORIES)
            lines.append(f"{i:>3}  {_label(c):<{width}}  {mib}  {c.step_seconds * 1e3:>7.2f}  "
                         f"{'yes' if c.fits else 'no':<4}  {c.why}")
        return head, lines

    def table(self) -> str:
        """The text form (see the module docstring)."""
        head, lines = self.rows()
        budget = f"; memory per rank {self.memory_per_rank / MIB:.2f} MiB" if self.memory_per_rank else ""
        shown = len(self.candidates)
        count = f"{shown} of {self.total} candidates" if shown < self.total else \
            f"{shown} candidate{'s' * (shown > 1)}"
        out = [f"PlannerView: {count}, best first (planned: estimated, not run){budget}", f"   {head}"]
        out += [f"{'>' if i == self.selected else ' ':>2} {line}" for i, line in enumerate(lines)]
        out.append(f"  {self.status()}")
        return "\n".join(out + ([f"  {self.message}"] if self.message else []))

    def __repr__(self) -> str:
        return self.table()

    def apply(self) -> str:
        """Send the chosen config to the cluster by ``%colossal config``'s path; returns what happened."""
        self.message = self._apply()
        if self._ui is not None:
            self._ui["message"].value = html(self.message)
        return self.message

    def _apply(self) -> str:
        if self.state is None:
            return "not applied: no %colossal state (run %load_ext colab_kit, or pass PlannerView(cands, state))"
        try:
            done = self.state.apply_config(self.chosen.config)
        except (ConfigError, ClusterError, RankError) as exc:
            return f"not applied: {str(exc).splitlines()[0]}"
        kwargs = getattr(self.chosen, "boost_kwargs", None)  # e.g. offload='auto' runs under a device budget
        return done + (f"; boost with {', '.join(f'{k}={v!r}' for k, v in kwargs.items())}" if kwargs else "")

    def _attempt(self) -> str:
        try:
            return self._apply()
        except Exception as exc:  # noqa: BLE001 - a button has nowhere else to report
            return f"not applied: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"

    # ------------------------------------------------------------ widgets (lazy)
    def widget(self):
        """A note, the table (a Select: one row per candidate), the status line, Apply, the scatter."""
        if self._ui is None:
            import ipywidgets as w

            head, lines = self.rows()
            nbsp = [line.replace(" ", "\u00a0") for line in lines]  # a browser collapses spaces in an <option>
            ui = {"table": w.Select(options=[(line, i) for i, line in enumerate(nbsp)], value=self.selected,
                                    rows=min(len(lines), 12), layout=w.Layout(width="100%")),
                  "status": w.HTML(), "message": w.HTML(value=html(self.message)),
                  "apply": w.Button(description="Apply", button_style="primary",
                                    tooltip="set the chosen config on every rank (as %colossal config does)"),
                  "figure": figure_view(self.figure())}
            ui["table"].add_class("ck-planner")
            ui["table"].observe(lambda change: self.select(change["new"]), names="value")
            ui["apply"].on_click(lambda _: self.click_apply())
            note = w.HTML(_STYLE + "<b>Planned</b>: every number below is the planner's estimate (MiB per rank, "
                          "step time); click a row or a point, then Apply.")
            header = w.HTML(f"<pre style='margin:0;font-size:12px'>{html(head)}</pre>")
            ui["box"] = w.VBox([note, header, ui["table"], ui["status"], w.HBox([ui["apply"], ui["message"]]),
                                ui["figure"]])
            self._ui = ui
            for trace in getattr(ui["figure"], "data", ()):  # a FigureWidget: a click on a marker chooses
                trace.on_click(self.click_point)
            self._redraw(figure=False)  # the figure was just drawn with the chosen ring where it belongs
        return self._ui["box"]

    def click_point(self, trace, points, selector=None) -> None:
        """A click on the scatter: the clicked marker's ``customdata`` is the candidate's index."""
        if points.point_inds:
            self.select(int(trace.customdata[points.point_inds[0]]))

    def click_apply(self):
        """The Apply button: disabled and "Applying…" while the ranks set the config (in a worker thread
        when the kernel's loop runs, so the kernel stays free); then the result. Returns the task, or None."""
        ui = self._ui
        assert ui is not None  # a click: the widgets exist
        ui["apply"].disabled, ui["apply"].description = True, "Applying…"
        ui["message"].value = html(f"applying {config_words(self.chosen.config)}: building the mesh on every rank…")
        return then(self._attempt, self._applied)

    def _applied(self, message: str) -> None:
        self.message = message
        ui = self._ui
        assert ui is not None  # the end of a click: the widgets exist
        ui["message"].value = html(message)
        ui["apply"].disabled, ui["apply"].description = False, "Apply"

    def _redraw(self, figure: bool = True) -> None:
        ui = self._ui
        if ui is None:
            return
        if ui["table"].value != self.selected:
            ui["table"].value = self.selected  # its observer calls select() again: no change, no redraw
        ui["status"].value = html(self.status())
        ui["message"].value = html(self.message)
        if figure:
            self._move_ring()

    def _move_ring(self) -> None:
        """Ring the chosen candidate: on a FigureWidget only the "chosen" trace moves (its markers keep their
        click handlers and nothing is deleted and re-added); an Output is drawn again."""
        assert self._ui is not None  # called by _redraw once they are built
        view = self._ui["figure"]
        ring = next((t for t in getattr(view, "data", ()) if t.name == "chosen"), None)
        if ring is None:
            redraw(view, self.figure())
            return
        new = plan_figure([self.chosen]).data[0]
        with view.batch_update():
            ring.x, ring.y, ring.customdata = new.x, new.y, [self.selected]
